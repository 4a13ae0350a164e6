"""Random draws for the samplers, with per-request generators and no draws for greedy rows.

A request with a generator draws only from it, in an order that depends on nothing but its
own row count, so a seeded request gets the same numbers whatever else is in the batch.
Every other row that needs numbers shares one draw from the global torch RNG; rows that
need none (greedy requests, requests without drafts) consume nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

# An Exp(1) draw of exactly 0 would make 1 / E infinite (and 0 * inf NaN); clamping to the
# smallest normal float keeps every score finite and changes nothing of measure > 0.
_MIN_EXPONENTIAL = torch.finfo(torch.float32).tiny


def draw_uniforms(
    num_draft_tokens: Sequence[int],
    needs_draws: Sequence[bool],
    generators: Mapping[int, torch.Generator],
    device: torch.device,
) -> torch.Tensor:
    """[num_tokens] float64 in [0, 1): one per draft of each request with `needs_draws`.

    float64 because float32 uniforms hit exactly 0 often enough to accept impossible drafts.
    Entries of requests without draws are 0.
    """
    cu = list(itertools.accumulate(num_draft_tokens, initial=0))
    shared = [i for i, need in enumerate(needs_draws) if need and i not in generators]
    if sum(cu[i + 1] - cu[i] for i in shared) == cu[-1]:
        out = torch.rand(cu[-1], dtype=torch.float64, device=device)
    else:
        out = torch.zeros(cu[-1], dtype=torch.float64, device=device)
        if shared:
            index = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in shared]).to(device)
            out[index] = torch.rand(index.numel(), dtype=torch.float64, device=device)
    for i, need in enumerate(needs_draws):
        if need and i in generators:
            n = cu[i + 1] - cu[i]
            draws = torch.rand(n, dtype=torch.float64, device=device, generator=generators[i])
            out[cu[i] : cu[i + 1]] = draws
    return out


def draw_inv_exponentials(
    needs_draws: Sequence[bool],
    generators: Mapping[int, torch.Generator],
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """[rows, vocab] float32: 1 / E with E ~ Exp(1) for rows with `needs_draws`, else 1.

    `argmax(prob * (1 / E))` is an exact draw from `prob / sum(prob)` (the exponential race).
    `generators` maps a row to its request's generator. E is `-log(1 - U)`, U ~ U[0, 1):
    the same law as `Tensor.exponential_`, several times faster on CPU.
    """
    rows = len(needs_draws)
    out = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
    shared = [i for i, need in enumerate(needs_draws) if need and i not in generators]
    if len(shared) == rows:
        out.uniform_()
    elif shared:
        out[_index(shared, device)] = torch.rand(len(shared), vocab_size, device=device)
    for i, need in enumerate(needs_draws):
        if need and i in generators:
            out[i].uniform_(generator=generators[i])
    # U -> log(1 - U) = -E -> 1 / E, with E >= the smallest normal float (see above).
    out.neg_().log1p_().clamp_max_(-_MIN_EXPONENTIAL).reciprocal_().neg_()
    idle = [i for i, need in enumerate(needs_draws) if not need]
    if idle:
        out[_index(idle, device)] = 1.0
    return out


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def draft_seed(seed: int) -> int:
    """The seed of a request's draft generator, derived from its own seed but distinct
    from it: drafts and the verifier must draw independently (the same stream twice would
    correlate a draft with the uniform that judges it)."""
    return (seed * 6364136223846793005 + 1442695040888963407) % 2**64
