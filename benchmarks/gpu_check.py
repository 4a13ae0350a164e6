"""The engine on a CUDA GPU, end to end, in one short run (for a lent GPU machine).

Greedy output of one model with speculation off, with n-gram chains, with an EAGLE-3 head
(chains and a draft tree), eager and compiled (CUDA graphs): every answer must equal the
eager run without speculation token for token; prints a table of tokens/s and whether
each matched, and exits 1 on a mismatch. Any model and EAGLE-3 head work; the prepared
run uses a tiny random Llama with the default model's tokenizer and a random head (made
here with `tests/tiny_models.py` and `tests/random_heads.py`, since the GPU machine holds
no model weights).

    python benchmarks/gpu_check.py --model DIR --head DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from cluster import LLM, SamplingParams

PROMPTS = [
    "The three primary colours are",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "Repeat after me: red, green, blue, red, green, blue,",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--head", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}")
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    specs = {
        "off": None,
        "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        "eagle3 k=3": {"model": args.head, "num_speculative_tokens": 3},
        "eagle3 tree": {
            "model": args.head,
            "num_speculative_tokens": 3,
            "tree": {"num_nodes": 6, "topk": 2},
        },
    }
    reference = None
    ok = True
    print("| speculation | compile | tokens/s | drafts | accepted | equals eager off |")
    print("|---|---|---:|---:|---:|---|")
    for compile_mode in ("off", "on"):
        for name, spec in specs.items():
            llm = LLM(
                args.model,
                device="cuda",
                dtype=args.dtype,
                compile=compile_mode,
                speculative_config=spec,
                max_model_len=256,
                max_num_seqs=8,
                num_kv_blocks=256,  # engines follow each other in this process
            )
            llm.generate(PROMPTS[:1], params, use_tqdm=False)  # warm-up (and capture)
            start = time.perf_counter()
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            rate = len(PROMPTS) * args.new_tokens / (time.perf_counter() - start)
            tokens = [o.outputs[0].token_ids for o in outs]
            metrics = llm.get_metrics()
            llm.shutdown()
            if reference is None:
                reference = tokens
            same = tokens == reference
            ok &= same
            drafts, accepted = (
                metrics.get("num_draft_tokens", 0),
                metrics.get("num_accepted_tokens", 0),
            )
            print(f"| {name} | {compile_mode} | {rate:.0f} | {drafts} | {accepted} | {same} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
