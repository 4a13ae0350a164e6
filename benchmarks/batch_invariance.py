"""What batch invariance costs: the engine with `batch_invariant=True` (one compiled graph
for every token count, no one-row products; on AMX CPUs products in row blocks,
`cluster/kernels/cpu_isa.py`) against `False` (one graph per token-count bucket,
autotuned), same weights and dtype, tokens/s at batch 1 and for many requests,
interleaved (A, B, B, A, ...) and reported as medians.

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
from cluster.kernels.cpu_isa import cpu_has_amx


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

    variants = {"invariant": (True, "on"), "per-bucket": (False, "on")}
    engines, start_s = {}, {}
    for name, (invariant, compile_mode) in variants.items():
        start = time.perf_counter()
        engines[name] = LLM(
            args.model,
            dtype=args.dtype,
            compile=compile_mode,
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
        rows.append((label, {name: total / s for name, s in seconds.items()}))

    starts = ", ".join(f"{name} {s:.0f} s" for name, s in start_s.items())
    print(
        f"model={llm.config.model.path} dtype={llm.config.model.torch_dtype} "
        f"threads={torch.get_num_threads()} amx={cpu_has_amx()} start-up: {starts}\n"
    )
    names = list(engines)
    print(
        "| workload | "
        + " | ".join(f"{n} (tok/s)" for n in names)
        + " | "
        + " | ".join(f"{n} / per-bucket" for n in names if n != "per-bucket")
        + " |"
    )
    print("|---|" + "---:|" * (2 * len(names) - 1))
    for label, rates in rows:
        ratios = [f"{rates[n] / rates['per-bucket']:.2f}" for n in names if n != "per-bucket"]
        print(
            f"| {label} | "
            + " | ".join(f"{rates[n]:.1f}" for n in names)
            + " | "
            + " | ".join(ratios)
            + " |"
        )
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
