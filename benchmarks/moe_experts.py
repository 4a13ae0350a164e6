"""The routed experts of one MoE layer: the per-expert loop (`experts_by_expert`, the
reference in transformers' order) against the fused path (`cluster.kernels.fused_moe`:
pairs sorted by expert; on CPU one matmul per expert over contiguous rows, on CUDA the
Triton grouped GEMMs). Milliseconds per call, medians of interleaved rounds, and the
loop's time over the fused path's.

    python benchmarks/moe_experts.py [--experts 64 --top-k 8 --hidden 1024 --inter 384]
        [--bandwidth-gbs 4800]   # adds the fused path's time over the weight read time
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cluster.kernels.fused_moe import fused_moe
from cluster.models.moe import experts_by_expert


def _time(fn, args, calls: int) -> float:
    sync = torch.cuda.synchronize if args[0].is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    sync()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=384)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument(
        "--bandwidth-gbs",
        type=float,
        help="memory bandwidth (GB/s): report fused / (bytes of the experts used / bandwidth)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    e, h, inter, device = args.experts, args.hidden, args.inter, args.device
    paths = {"per-expert loop": experts_by_expert, "fused": fused_moe}
    print(f"experts={e} top_k={args.top_k} hidden={h} inter={inter} on {device}, ms per call\n")
    roof = " fused / weight read |" if args.bandwidth_gbs else ""
    print("| dtype | tokens | per-expert loop | fused | loop / fused |" + roof)
    print("|---|---:|---:|---:|---:|" + ("---:|" if roof else ""))
    for name in args.dtypes:
        dtype = getattr(torch, name)
        w13 = (torch.randn(e, 2 * inter, h) / h**0.5).to(device, dtype)
        w2 = (torch.randn(e, h, inter) / inter**0.5).to(device, dtype)
        with torch.no_grad():
            for n in args.tokens:
                x = torch.randn(n, h).to(device, dtype)
                ids = torch.stack([torch.randperm(e)[: args.top_k] for _ in range(n)])
                weights = torch.rand(n, args.top_k).to(device, dtype)
                call = (x, w13, w2, ids.to(device), weights)
                times: dict[str, list[float]] = {p: [] for p in paths}
                for fn in paths.values():
                    fn(*call)  # warm up
                for r in range(args.rounds):  # interleaved, alternating the order
                    order = list(paths) if r % 2 == 0 else list(reversed(paths))
                    for p in order:
                        times[p].append(_time(paths[p], call, args.calls))
                med = {p: statistics.median(t) for p, t in times.items()}
                ratio = med["per-expert loop"] / med["fused"]
                cells = f"| {name} | {n} | {med['per-expert loop']:.3f} | {med['fused']:.3f} | "
                cells += f"{ratio:.2f}x |"
                if args.bandwidth_gbs:  # only the experts some token chose are read
                    used = ids.unique().numel() * 3 * inter * h * w13.element_size()
                    read_ms = used / (args.bandwidth_gbs * 1e9) * 1e3
                    cells += f" {med['fused'] / read_ms:.2f}x |"
                print(cells)


if __name__ == "__main__":
    main()
