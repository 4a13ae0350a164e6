"""Speculative decoding: tokens/s with and without speculation, per method, at batch 1
and 16, with acceptance statistics.

Draft heads are random (untrained), which measures the plumbing's overhead: with an
always-rejected draft, how much slower is a step than speculation off? n-gram drafts do
get accepted on repetitive text. `--head DIR [DIR ...]` adds trained EAGLE-3 heads
("eagle3:DIRNAME"), measured on held-out chat prompts (`--prompts heldout`). The last
column checks the measured mean acceptance length against (1 - a^(k+1)) / (1 - a) from
the measured per-token acceptance a.

Both engines stay loaded and their runs interleave (off, spec, spec, off, ... for
`--rounds` rounds); tokens/s are medians, the speedup is the ratio of the medians.
`--spec-options JSON` adds speculative settings to every method (e.g. the default
manifest's `{"adaptive": true, "hybrid_lookup_min": 2, "min_draft_confidence": 0.3}`).

    python benchmarks/spec_decode.py [--model PATH] [--k 3] [--new-tokens 32] [--batches 1 16]
    python benchmarks/spec_decode.py --head cluster/heads/smollm2-eagle3 --methods eagle3:smollm2-eagle3 ngram --prompts heldout
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from random_heads import write_all

from cluster import LLM, SamplingParams
from cluster.models.default_model import ensure_default_model
from cluster.train.prompts import build_prompts

warnings.filterwarnings("ignore")

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Repeat this list: apples, pears, plums, apples, pears, plums, apples, pears, plums.",
    "Explain how a bicycle works.",
    "Summarise the water cycle in three sentences.",
    "Count from one to twenty in words.",
    "What are the primary colours?",
    "Describe a cat to a child.",
]


def run(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument(
        "--head", nargs="+", default=[], help="trained EAGLE-3 head folders (eagle3:NAME rows)"
    )
    parser.add_argument("--prompts", choices=["builtin", "heldout"], default="builtin")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2, help="off, spec, spec, off per round")
    parser.add_argument("--spec-options", default="{}", help="JSON added to every method's spec")
    args = parser.parse_args()

    path = args.model or ensure_default_model()
    print(f"compile={args.compile} dtype={args.dtype}")
    specs = write_all(tempfile.mkdtemp(prefix="random-heads-"), path, seed=0)
    for head in args.head:
        name = os.path.basename(os.path.normpath(head))
        specs[f"eagle3:{name}"] = {"method": "eagle3", "model": head}
    methods = args.methods or list(specs)
    questions = [({"role": "user", "content": q},) for q in QUESTIONS]
    if args.prompts == "heldout":
        questions = build_prompts()[1][: args.num_prompts]
    engine = dict(
        dtype=args.dtype, max_model_len=512, max_num_seqs=max(args.batches), compile=args.compile
    )
    options = json.loads(args.spec_options)
    rows = []
    with LLM(path, **engine) as off:
        tokenizer = off.get_tokenizer()
        chats = [
            tokenizer.apply_chat_template(
                list(chat), add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for chat in questions
        ]
        batches = {b: [chats[i % len(chats)] for i in range(b)] for b in args.batches}
        run(off, batches[args.batches[0]], 4)  # warm-up
        for method in methods:
            spec = {**specs[method], "num_speculative_tokens": args.k, **options}
            with LLM(path, speculative_config=spec, **engine) as llm:
                run(llm, batches[args.batches[0]], 4)  # warm-up
                for b, prompts in batches.items():
                    before = llm.get_metrics()
                    times: dict[str, list[float]] = {"off": [], "spec": []}
                    for _ in range(args.rounds):
                        for side in ("off", "spec", "spec", "off"):
                            timed = off if side == "off" else llm
                            times[side].append(run(timed, prompts, args.new_tokens))
                    after = llm.get_metrics()
                    drafts = after["num_drafts"] - before["num_drafts"]
                    draft_tokens = after["num_draft_tokens"] - before["num_draft_tokens"]
                    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
                    rows.append(
                        (
                            method,
                            b,
                            statistics.median(times["spec"]),
                            statistics.median(times["off"]),
                            accepted / draft_tokens if draft_tokens else 0.0,
                            1 + accepted / drafts if drafts else 1.0,
                        )
                    )

    heads = "trained EAGLE-3 heads + random heads" if args.head else "random draft heads"
    print(
        f"model={path} k={args.k} new_tokens={args.new_tokens} prompts={args.prompts} ({heads})"
        f" options={options} rounds={args.rounds}\n"
    )
    print(
        "| method | batch | spec tokens/s | off tokens/s | speedup | acceptance rate "
        "| mean acceptance length | (1-a^(k+1))/(1-a) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    k = args.k
    for method, b, tps, base, rate, mal in rows:
        predicted = (1 - rate ** (k + 1)) / (1 - rate) if rate < 1 else k + 1
        print(
            f"| {method} | {b} | {tps:.1f} | {base:.1f} | {tps / base:.2f} | {rate:.2f} "
            f"| {mal:.2f} | {predicted:.2f} |"
        )


if __name__ == "__main__":
    main()
