"""The two expert computations of `cluster.models.moe`, eager and compiled, at decode
token counts: milliseconds per call (median of interleaved rounds) and the ratio to the
eager per-expert loop (the reference, which is what runs eagerly).

    python benchmarks/moe_experts.py [--experts 64 --top-k 8 --hidden 1024 --inter 384]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cluster.models.moe import experts_by_expert, experts_by_token


def _time(fn, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=384)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    e, h, inter = args.experts, args.hidden, args.inter
    w13 = torch.randn(e, 2 * inter, h) / h**0.5
    w2 = torch.randn(e, h, inter) / inter**0.5
    compiled = torch.compile(experts_by_token, fullgraph=True, dynamic=False)
    paths = {
        "by_expert (eager)": experts_by_expert,
        "by_token (eager)": experts_by_token,
        "by_token (compiled)": compiled,
    }
    print(f"experts={e} top_k={args.top_k} hidden={h} inter={inter} float32, ms per call\n")
    print("| tokens | " + " | ".join(paths) + " | compiled by_token / eager by_expert |")
    print("|---" * (len(paths) + 2) + "|")
    with torch.no_grad():
        for n in args.tokens:
            x = torch.randn(n, h)
            ids = torch.stack([torch.randperm(e)[: args.top_k] for _ in range(n)])
            weights = torch.rand(n, args.top_k)
            call = (x, w13, w2, ids, weights)
            compiled(*call)  # compile this shape before timing
            times: dict[str, list[float]] = {name: [] for name in paths}
            for r in range(args.rounds):  # interleaved, alternating the order
                order = list(paths) if r % 2 == 0 else list(reversed(paths))
                for name in order:
                    times[name].append(_time(paths[name], call, args.calls))
            med = {name: statistics.median(t) for name, t in times.items()}
            ratio = med["by_token (compiled)"] / med["by_expert (eager)"]
            cells = " | ".join(f"{med[name]:.3f}" for name in paths)
            print(f"| {n} | {cells} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
