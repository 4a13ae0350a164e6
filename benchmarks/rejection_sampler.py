"""Rejection-sampling throughput on chains: the vectorised torch path against a per-request
Python loop (chains are trees of width one: the same kernel and torch path verify trees).

Prints one table row per (vocab, batch, k): draft tokens verified per second (batch * k /
seconds per call) for
- `loop`:   the random draws, then the per-request Python loop (`rejection_sample_loop`),
- `torch`:  the same draws, then the vectorised torch path (`rejection_sample_ref`),
- `public`: `rejection_sample(..., backend="torch")`, which also checks its inputs (a full
  pass over `target_probs`, the largest cost on a CPU when k is large),
and, on a CUDA device, for `rejection_sample(..., backend="triton")` and for the Triton
kernels alone on pre-drawn inputs, with their effective memory bandwidth (bytes the kernels
must touch / kernel time).

Targets put 0.75 of their mass on one token and drafts propose it 85% of the time, so
requests accept a few drafts and then reject, as in real speculative decoding. Requests
are random (temperature > 0) with delta drafts unless flags say otherwise.

    python benchmarks/rejection_sampler.py                       # about 1.5 min on 2 CPU cores
    python benchmarks/rejection_sampler.py --batch 1 2 4 8 16 32 64 --k 1 2 4 8 --draft-probs
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from rejection_oracle import rejection_sample_loop  # the tests' oracle

from cluster.kernels.rejection import rejection_sample_ref
from cluster.kernels.rejection_inputs import RejectionInputs
from cluster.sample.randomness import draw_inv_exponentials, draw_uniforms
from cluster.sample.rejection import rejection_sample


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4, 8], help="drafts per request")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32_000, 128_256])
    parser.add_argument("--draft-probs", action="store_true", help="pass q (else delta drafts)")
    parser.add_argument("--greedy-fraction", type=float, default=0.0)
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per measurement")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser.parse_args()


def make_case(num_rows: int, vocab: int, with_q: bool, device: torch.device, seed: int = 0):
    """[num_rows, vocab] peaked targets, drafts that usually propose the peak, optional q."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def peaked(weight: float) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.randn(num_rows, vocab, device=device, generator=gen).softmax(dim=1)
        top = probs.argmax(dim=1)
        probs.mul_(1 - weight)[torch.arange(num_rows, device=device), top] += weight
        return probs, top

    target, top = peaked(0.75)
    noise = torch.randint(0, vocab, (num_rows,), device=device, generator=gen)
    hit = torch.rand(num_rows, device=device, generator=gen) < 0.85
    drafts = torch.where(hit, top, noise)
    draft_probs = None
    if with_q:
        draft_probs, _ = peaked(0.6)
        draft_probs[torch.arange(num_rows, device=device), drafts] += 0.1  # q(d) > 0
    return target, drafts, draft_probs


def seconds_per_call(fn: Callable[[], object], device: torch.device, min_time: float) -> float:
    """Fastest of repeated calls after one warm-up call (the least disturbed by other load)."""

    def timed() -> float:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed()
    times = [timed()]
    while sum(times) < min_time and len(times) < 50:
        times.append(timed())
    return min(times)


def drawn_inputs(args_: tuple, greedy: torch.Tensor, k: int) -> RejectionInputs:
    """The public call's inputs with randomness drawn as it would draw it."""
    drafts, num_draft, draft_probs, target, bonus = args_
    needs = [not g for g in greedy.tolist()]
    device = target.device
    return RejectionInputs.for_chains(
        list(num_draft),
        draft_token_ids=drafts,
        target_probs=target,
        draft_probs=draft_probs,
        bonus_token_ids=bonus,
        is_greedy=greedy,
        uniforms=draw_uniforms(num_draft, needs, {}, device),
        inv_exponentials=draw_inv_exponentials(needs, {}, target.shape[1], device),
    )


def kernel_bytes(inputs: RejectionInputs, out: torch.Tensor) -> int:
    """Bytes the Triton kernel must touch: per draft its id, p(d), q(d) and u; per rejected
    random request one row of p (and q) and of 1/E; the output."""
    per_draft = 8 + 4 + 8 + (0 if inputs.draft_probs is None else 4)
    rejected = int(((out != -1).sum(dim=1) <= inputs.num_draft_tokens).sum())
    per_row = inputs.vocab_size * (8 if inputs.draft_probs is None else 12)
    return inputs.num_tokens * per_draft + rejected * per_row + out.numel() * 8


def main() -> None:
    opts = parse_args()
    torch.set_num_threads(opts.threads)
    device = torch.device(opts.device)
    cuda = device.type == "cuda"
    if cuda:
        from cluster.kernels.rejection_triton import rejection_sample_triton
    header = ["vocab", "batch", "k", "loop tok/s", "torch tok/s", "torch/loop", "public tok/s"]
    if cuda:
        header += ["triton tok/s", "kernels tok/s", "kernels GB/s"]
    drafts = "with q" if opts.draft_probs else "delta"
    print(f"device: {device}; torch threads: {opts.threads}; drafts: {drafts}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for vocab in opts.vocab:
        rows = max(opts.batch) * max(opts.k)
        target_all, drafts_all, q_all = make_case(rows, vocab, opts.draft_probs, device)
        for batch in opts.batch:
            for k in opts.k:
                n = batch * k
                gen = torch.Generator(device=device).manual_seed(1)
                greedy = torch.rand(batch, device=device, generator=gen) < opts.greedy_fraction
                bonus = torch.zeros(batch, dtype=torch.int64, device=device)
                q = None if q_all is None else q_all[:n]
                args_ = (drafts_all[:n], [k] * batch, q, target_all[:n], bonus)

                def public(backend: str, a=args_, g=greedy) -> torch.Tensor:
                    return rejection_sample(*a[:4], a[4], g, None, backend)

                def loop(a=args_, g=greedy, k_=k) -> object:
                    return rejection_sample_loop(drawn_inputs(a, g, k_))

                def vectorised(a=args_, g=greedy, k_=k) -> object:
                    return rejection_sample_ref(drawn_inputs(a, g, k_))

                t_loop = seconds_per_call(loop, device, opts.min_time)
                t_torch = seconds_per_call(vectorised, device, opts.min_time)
                t_public = seconds_per_call(lambda: public("torch"), device, opts.min_time)
                cells = [vocab, batch, k, f"{n / t_loop:,.0f}", f"{n / t_torch:,.0f}"]
                cells += [f"{t_loop / t_torch:.1f}x", f"{n / t_public:,.0f}"]
                if cuda:
                    t_triton = seconds_per_call(lambda: public("triton"), device, opts.min_time)
                    inputs = drawn_inputs(args_, greedy, k)
                    kernels = lambda i=inputs: rejection_sample_triton(i)  # noqa: E731
                    t_kernels = seconds_per_call(kernels, device, opts.min_time)
                    gbps = kernel_bytes(inputs, kernels().token_ids) / t_kernels / 1e9
                    cells += [f"{n / t_triton:,.0f}", f"{n / t_kernels:,.0f}", f"{gbps:.0f}"]
                print("| " + " | ".join(map(str, cells)) + " |", flush=True)


if __name__ == "__main__":
    main()
