"""What batch invariance costs: the engine with `batch_invariant=True` (one compiled graph
for every token count, no one-row products) against `False` (one graph per token-count
bucket, autotuned), same weights and dtype, tokens/s at batch 1 and for many requests,
interleaved (on, off, off, on, ...) and reported as medians.

    python benchmarks/batch_invariance.py [--dtype auto] [--num-requests 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import chat_prompts, interleaved, ours_generate

from cluster import LLM


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--batch-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    engines, start_s = {}, {}
    for name, invariant in (("invariant", True), ("per-bucket", False)):
        start = time.perf_counter()
        engines[name] = LLM(
            args.model,
            dtype=args.dtype,
            compile="on",
            batch_invariant=invariant,
            max_model_len=512,
            max_num_seqs=args.num_requests,
        )
        start_s[name] = time.perf_counter() - start
    llm = engines["invariant"]
    tokenizer = llm.get_tokenizer()
    rows = []
    for label, prompts, new in (
        ("decode, batch 1", chat_prompts(tokenizer, 1), args.new_tokens),
        (
            f"{args.num_requests} requests x {args.batch_new_tokens} tokens",
            chat_prompts(tokenizer, args.num_requests),
            args.batch_new_tokens,
        ),
    ):
        for engine in engines.values():
            ours_generate(engine, prompts[:1], 4)  # warm-up
        seconds = interleaved(
            {
                name: lambda e=engine, p=prompts, n=new: ours_generate(e, p, n)
                for name, engine in engines.items()
            },
            args.repeats,
        )
        total = len(prompts) * new
        rows.append((label, total / seconds["invariant"], total / seconds["per-bucket"]))

    print(
        f"model={llm.config.model.path} dtype={llm.config.model.torch_dtype} "
        f"threads={torch.get_num_threads()} start-up: invariant {start_s['invariant']:.0f} s, "
        f"per-bucket {start_s['per-bucket']:.0f} s\n"
    )
    print("| workload | invariant (tok/s) | per-bucket (tok/s) | invariant / per-bucket |")
    print("|---|---:|---:|---:|")
    for label, invariant, bucketed in rows:
        print(f"| {label} | {invariant:.1f} | {bucketed:.1f} | {invariant / bucketed:.2f} |")
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
