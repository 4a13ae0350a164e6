"""The gated delta rule over one long prefill: the token loop against the chunked form
(`cluster.models.gated_delta_chunked`) at a few chunk sizes, float32, from a zero state with
nothing kept. Two tables: the recurrence alone (q, k, v, g, beta already prepared; the loop
is `gated_delta_ref`'s per-token update) and the whole op (`gated_delta_ref` with
`chunk_size=None` against `chunk_size=C`, convolution and gathers included). Milliseconds
per call (median of interleaved rounds, the order alternating A, B, B, A) and the speedup
over the token loop. Defaults are Qwen3-Next-like shapes for one rank.

    python benchmarks/gated_delta.py [--tokens 2048 --heads 32 --k-heads 16 --dk 128
                                      --dv 128 --chunks 32 64 128 --rounds 4 --threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cluster.models.attention import AttentionMetadata, attention_context
from cluster.models.gated_delta import gated_delta_ref
from cluster.models.gated_delta_chunked import chunked_delta_rule

Path = Callable[[], torch.Tensor]


def _token_loop(q, k, v, g, beta, s):
    """The per-token update of `gated_delta_ref` (all tokens valid): [1, T, heads, dv]."""
    out = torch.empty_like(v)
    decay = g.exp()
    for t in range(q.shape[1]):
        k_t = k[:, t, :, :, None]
        decayed = s * decay[:, t, :, None, None]
        delta = (v[:, t] - (decayed * k_t).sum(dim=-2)) * beta[:, t, :, None]
        s = decayed + k_t * delta[:, :, None, :]
        out[:, t] = (s * q[:, t, :, :, None]).sum(dim=-2)
    return out


def _table(title: str, paths: dict[str, Path], rounds: int, calls: int) -> None:
    ref = paths["token loop"]()
    for name, fn in paths.items():  # warm up, and check each against the token loop
        err = (fn() - ref).abs().max().item()
        assert err < 1e-3, f"{name}: max abs difference {err} from the token loop"
    times: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(rounds):  # interleaved, alternating the order
        for name in list(paths) if r % 2 == 0 else list(reversed(paths)):
            start = time.perf_counter()
            for _ in range(calls):
                paths[name]()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"\n{title}\n\n| path | ms | speedup over the token loop |\n|---|---|---|")
    for name in paths:
        print(f"| {name} | {med[name]:.1f} | {med['token loop'] / med[name]:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32, help="value heads")
    parser.add_argument("--k-heads", type=int, default=16)
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--kernel", type=int, default=4)
    parser.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, h, nk, dk, dv = args.tokens, args.heads, args.k_heads, args.dk, args.dv
    print(
        f"tokens={n} heads={h} k_heads={nk} dk={dk} dv={dv} float32, "
        f"threads={torch.get_num_threads()}, ms per call"
    )
    g = -torch.rand(n, h) * 0.5
    beta = torch.rand(n, h)

    q = F.normalize(torch.randn(1, n, h, dk), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(1, n, h, dk), dim=-1)
    v = torch.randn(1, n, h, dv)
    s0 = torch.zeros(1, h, dk, dv)
    rule: dict[str, Path] = {"token loop": lambda: _token_loop(q, k, v, g[None], beta[None], s0)}
    for c in args.chunks:
        rule[f"chunked {c}"] = lambda c=c: chunked_delta_rule(q, k, v, g[None], beta[None], s0, c)[
            0
        ]

    conv_dim = 2 * nk * dk + h * dv
    mixed = torch.randn(n, conv_dim)
    weight = torch.randn(conv_dim, args.kernel) * 0.5
    meta = AttentionMetadata.for_prefill([n])

    def whole(chunk: int | None) -> Path:
        def call() -> torch.Tensor:
            with attention_context(meta):
                return gated_delta_ref(mixed, g, beta, weight, 0, nk, dk, dv, chunk_size=chunk)

        return call

    op = {"token loop": whole(None)} | {f"chunked {c}": whole(c) for c in args.chunks}
    with torch.no_grad():
        _table("Recurrence only", rule, args.rounds, args.calls)
        _table("Whole op (gated_delta_ref)", op, args.rounds, args.calls)


if __name__ == "__main__":
    main()
