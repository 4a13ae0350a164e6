"""Drafters side by side on the default model, interleaved with speculation off: the
shipped EAGLE-3 head, n-gram lookup, the hybrid of the two (lookup where the context
repeats, the head elsewhere; `speculative.hybrid_lookup_min`), and the head and the
hybrid with per-request chains (`speculative.min_draft_confidence`), at one k.

Greedy, held-out chat prompts, `--new-tokens` each. Every engine stays up (compiled
as configured, `CLUSTER_COMPILE`); each round runs every engine on every batch size, in
forward then reverse order, and the table reports medians: tokens/s, speedup over
speculation off, tokens per target step (the decode steps' output tokens over their
count: what a step yields, drafting steps or not) and the mean acceptance length over
the steps that drafted.

    python benchmarks/drafters.py [--k 3] [--batches 1 4 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

from spec_sweep import heldout_chats

from cluster import LLM, SamplingParams
from cluster.config.speculative import builtin_head_path
from cluster.models.default_model import ensure_default_model

warnings.filterwarnings("ignore")


def drafters(k: int, lookup_min: int, confidence: float) -> dict[str, dict | None]:
    head = {"method": "eagle3", "model": builtin_head_path("smollm2-eagle3")}
    head = {**head, "num_speculative_tokens": k}
    hybrid = {**head, "hybrid_lookup_min": lookup_min}
    return {
        "off": None,
        "eagle3": head,
        f"eagle3, confidence >= {confidence}": {**head, "min_draft_confidence": confidence},
        "ngram": {"method": "ngram", "num_speculative_tokens": k},
        f"eagle3 + lookup (>= {lookup_min})": hybrid,
        f"eagle3 + lookup, confidence >= {confidence}": {
            **hybrid,
            "min_draft_confidence": confidence,
        },
    }


def measure(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    core = llm.engine.core
    steps, original = [0], core.step

    def counted():
        steps[0] += 1
        return original()

    before = llm.get_metrics()
    core.step = counted
    try:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        core.step = original
    after = llm.get_metrics()
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    tokens = len(prompts) * new_tokens
    decode_steps = steps[0] - 1  # the first step is the prefill (one token each)
    return {
        "tok_s": tokens / seconds,
        "tokens_per_step": (tokens / len(prompts) - 1) / max(1, decode_steps),
        "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--confidence", type=float, default=0.3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    path = ensure_default_model()
    engine = dict(dtype="float32", max_model_len=512, max_num_seqs=max(args.batches))
    llms = {
        name: LLM(path, speculative_config=spec, **engine)
        for name, spec in drafters(args.k, args.lookup_min, args.confidence).items()
    }
    chats = heldout_chats(llms["off"], max(args.batches))
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        for llm in llms.values():
            measure(llm, chats[:1], 4)  # warm-up
        for _ in range(args.rounds):
            for b in args.batches:
                for name in [*llms, *reversed(llms)]:
                    runs.setdefault((name, b), []).append(
                        measure(llms[name], chats[:b], args.new_tokens)
                    )
                    print(f"  {name:40s} batch {b:3d} {runs[name, b][-1]}", flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
    med = {key: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for key, rs in runs.items()}
    print(
        f"\nSmolLM2-135M-Instruct, greedy, k={args.k}, {args.new_tokens} new tokens, held-out "
        f"chats, medians of {args.rounds} interleaved rounds\n"
    )
    print("| drafter | batch | tok/s | speedup | tokens per step | mean acceptance length |")
    print("|---|---:|---:|---:|---:|---:|")
    for (name, b), r in sorted(med.items(), key=lambda kv: (kv[0][1], list(llms).index(kv[0][0]))):
        speedup = r["tok_s"] / med["off", b]["tok_s"]
        print(
            f"| {name} | {b} | {r['tok_s']:.1f} | {speedup:.2f}x | {r['tokens_per_step']:.2f} "
            f"| {r['acceptance_length']:.2f} |"
        )


if __name__ == "__main__":
    main()
