"""The verifier's cost per step, as the engine calls it: `RejectionSampler` on draft chains
and trees (one kernel for both), against the plain `Sampler` drawing one token per request
from the same batch (the step without speculation).

Prints one table row per (drafts, batch, temperature): milliseconds per call, median of
interleaved repeats (sampler, verifier, verifier, sampler, ...), and their ratio. Logits are
random with a peaked top token, drafts follow it most of the time, so walks accept a few
drafts and then reject, as in real speculative decoding.

    python benchmarks/verifier.py                      # about 1 min on 2 CPU cores
    python benchmarks/verifier.py --batch 1 4 --vocab 151936 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from cluster.draft_tree import DraftTree
from cluster.sample import RejectionSampler, Sampler, SamplingMetadata, SpecDecodeMetadata
from cluster.sampling_params import SamplingParams

# (label, parents): a chain of 3, and a tree of 8 nodes (3 at depth 1, then 2 + 2, then 1)
SHAPES = {
    "chain k=3": (-1, 0, 1),
    "tree 8 nodes": (-1, -1, -1, 0, 0, 1, 1, 3),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--vocab", type=int, default=49_152)  # SmolLM2's
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args()


def make_step(parents: tuple[int, ...], batch: int, vocab: int, device: torch.device, seed: int):
    """(logits [batch * (n + 1), vocab], spec, plain logits [batch, vocab])."""
    gen = torch.Generator().manual_seed(seed)
    n = len(parents)
    logits = torch.randn(batch * (n + 1), vocab, generator=gen)
    top = torch.randint(0, vocab, (batch * (n + 1),), generator=gen)
    logits[torch.arange(batch * (n + 1)), top] += 6.0  # a peaked top token
    drafts = []
    for i in range(batch):
        rows = top[i * (n + 1) : (i + 1) * (n + 1)].tolist()
        tree = []
        for j, parent in enumerate(parents):
            siblings = [k for k in range(j) if parents[k] == parent]
            follows = not siblings and bool(torch.rand(1, generator=gen) < 0.7)
            tree.append(
                rows[parent + 1] if follows else int(torch.randint(0, vocab, (1,), generator=gen))
            )
        drafts.append(tree)
    tree_parents = None if DraftTree((0,) * n, parents).is_chain() else [list(parents)] * batch
    spec = SpecDecodeMetadata.from_trees(drafts, tree_parents, device)
    plain = logits[:: n + 1].contiguous()
    return logits.to(device), spec, plain.to(device)


def metadata(batch: int, temperature: float, vocab: int, device: torch.device) -> SamplingMetadata:
    params = [SamplingParams(temperature=temperature) for _ in range(batch)]
    return SamplingMetadata.from_params(
        params, vocab, device, prompt_token_ids=[[1, 2]] * batch, output_token_ids=[[3]] * batch
    )


def ms_per_call(fn, device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    opts = parse_args()
    device = torch.device(opts.device)
    verifier, sampler = RejectionSampler(), Sampler()
    print(f"device: {device}; torch threads: {torch.get_num_threads()}; vocab: {opts.vocab}")
    print("| drafts | batch | temperature | sampler ms | verifier ms | verifier / sampler |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, parents in SHAPES.items():
        for batch in opts.batch:
            for temperature in opts.temperature:
                logits, spec, plain = make_step(parents, batch, opts.vocab, device, seed=batch)
                md = metadata(batch, temperature, opts.vocab, device)
                run_verifier = partial(verifier, logits, spec, md)
                run_sampler = partial(sampler, plain, md)
                run_verifier(), run_sampler()  # warm-up
                times: dict[str, list[float]] = {"sampler": [], "verifier": []}
                for r in range(opts.repeats):  # A B B A ...
                    order = ("sampler", "verifier") if r % 2 == 0 else ("verifier", "sampler")
                    for name in order:
                        fn = run_sampler if name == "sampler" else run_verifier
                        times[name].append(ms_per_call(fn, device))
                s, v = (statistics.median(times[k]) for k in ("sampler", "verifier"))
                print(
                    f"| {label} | {batch} | {temperature} | {s:.2f} | {v:.2f} | {v / s:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
