"""Paged attention: the Triton kernel against the torch reference, on CUDA; on a CPU,
the C kernel (`cluster.kernels.cpu_attention`) against the torch path.

Two batches over a shuffled block pool (block size 16, 32 query heads over 8 KV heads,
head_dim 128, bfloat16):
- decode: 64 sequences, one new token each, 1024 tokens of context;
- prefill chunk: 4 sequences, 512 new tokens each after 1536 cached tokens.
Prints a markdown table of median latencies and the effective memory bandwidth: bytes that
must move at least once (every context key and value, the queries and the output) divided
by the latency. Decode is bandwidth-bound, so its GB/s is the figure to compare with the
GPU's peak; the prefill chunk is compute-bound and its GB/s is only indicative.
Without CUDA: decode, verification and prefill cases in SmolLM2-135M's geometry (9 query
heads over 3 KV heads, head_dim 64, bfloat16), C kernel and torch path timed in turns.

    python benchmarks/paged_attention.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from functools import partial
from itertools import pairwise

import torch

from cluster.kernels.paged_attention import paged_attention_ref
from cluster.kernels.paged_attention_triton import paged_attention_triton


def make_batch(
    num_seqs: int,
    context: int,
    new: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
) -> dict:
    """`num_seqs` sequences of `context + new` tokens, `new` of them queries, random data."""
    seq_len = context + new
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    block_tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    return {
        "q": torch.randn(num_seqs * new, heads, head_dim, dtype=dtype, device=device),
        "k_cache": torch.randn(cache_shape, dtype=dtype, device=device),
        "v_cache": torch.randn(cache_shape, dtype=dtype, device=device),
        "block_tables": block_tables.to(torch.int32),  # [num_seqs, blocks_per_seq]
        "seq_lens": [seq_len] * num_seqs,
        "query_start_loc": list(range(0, num_seqs * new + 1, new)),
        "scale": 1.0 / math.sqrt(head_dim),
    }


def bytes_moved(batch: dict) -> int:
    """Context keys and values read once, queries read once, output written once."""
    k_cache, q = batch["k_cache"], batch["q"]
    kv_heads, head_dim = k_cache.shape[2:]
    kv = 2 * sum(batch["seq_lens"]) * kv_heads * head_dim * k_cache.element_size()
    return kv + 2 * q.numel() * q.element_size()


def median_ms(fn: Callable[[], object], sync: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def triton_call(batch: dict) -> Callable[[], torch.Tensor]:
    device = batch["q"].device
    seq_lens = torch.tensor(batch["seq_lens"], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor(batch["query_start_loc"], dtype=torch.int32, device=device)
    max_query_len = max(b - a for a, b in pairwise(batch["query_start_loc"]))
    return lambda: paged_attention_triton(
        batch["q"],
        batch["k_cache"],
        batch["v_cache"],
        batch["block_tables"],
        seq_lens,
        query_start_loc,
        batch["scale"],
        max_query_len,
    )


def cpu_table(repeats: int) -> None:
    """The C kernel against the torch path on this CPU, SmolLM2's attention geometry."""
    from forward import interleaved_ms  # benchmarks/forward.py, beside this script

    from cluster.kernels import cpu_attention
    from cluster.kernels.attention_plan import plan_paged_attention

    if cpu_attention.load() is None:
        print("the C kernel did not build here: nothing to compare")
        return
    torch.manual_seed(0)
    cases = {
        "decode 1 x 128 ctx": (1, 127, 1),
        "decode 16 x 192 ctx": (16, 191, 1),
        "verify 16 x 4 after 188": (16, 188, 4),
        "prefill chunk 1 x 256 new": (1, 0, 256),
        "prefill chunk 1 x 512 new after 1536": (1, 1536, 512),
    }
    print(f"{torch.get_num_threads()} threads, bf16, 9 heads / 3 KV heads, head_dim 64, block 16")
    print("(per layer; medians of interleaved runs)\n")
    print("| case | C kernel (ms) | torch path (ms) | speed-up |")
    print("|---|---:|---:|---:|")
    for name, (num_seqs, context, new) in cases.items():
        batch = make_batch(num_seqs, context, new, 9, 3, 64, 16, torch.bfloat16, "cpu")
        tables, lens, starts = batch["block_tables"], batch["seq_lens"], batch["query_start_loc"]
        pieces = cpu_attention.plan_pieces(tables, lens, starts)
        plan = plan_paged_attention(tables, lens, starts, 16)
        q, k, v, scale = batch["q"], batch["k_cache"], batch["v_cache"], batch["scale"]
        ms = interleaved_ms(
            {
                "c": partial(cpu_attention.paged_attention_cpu, q, k, v, pieces, scale),
                "torch": partial(paged_attention_ref, **batch, plan=plan),
            },
            repeats,
        )
        print(f"| {name} | {ms['c']:.3f} | {ms['torch']:.3f} | {ms['torch'] / ms['c']:.1f}x |")


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    if not torch.cuda.is_available():
        cpu_table(args.repeats)
        return

    torch.manual_seed(0)
    cases = {
        "decode 64 x 1024 ctx": (64, 1024, 1),
        "prefill chunk 4 x 512 new after 1536": (4, 1536, 512),
    }
    print(f"{torch.cuda.get_device_name()}, bf16, 32 heads / 8 KV heads, head_dim 128, block 16\n")
    print("| case | Triton (ms) | torch (ms) | speed-up | Triton GB/s | torch GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (num_seqs, context, new) in cases.items():
        batch = make_batch(num_seqs, context, new, 32, 8, 128, 16, torch.bfloat16, "cuda")
        sync = torch.cuda.synchronize
        t_triton = median_ms(triton_call(batch), sync, args.repeats)
        t_torch = median_ms(lambda batch=batch: paged_attention_ref(**batch), sync, args.repeats)
        moved = bytes_moved(batch)
        print(
            f"| {name} | {t_triton:.3f} | {t_torch:.3f} | {t_torch / t_triton:.1f}x "
            f"| {moved / t_triton / 1e6:.0f} | {moved / t_torch / 1e6:.0f} |"
        )


if __name__ == "__main__":
    main()
