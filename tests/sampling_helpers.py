"""Generators for the sampler tests, as the model runner makes them for a batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cluster.sampling_params import SamplingParams


def make_generators(
    params: Sequence[SamplingParams], device: torch.device | str = "cpu"
) -> dict[int, torch.Generator]:
    """A fresh generator, seeded from `seed`, for every seeded request, as at its first
    step. Greedy ones get one too (the model runner gives them none), so tests can check
    that greedy rows never draw from it."""
    return {
        i: torch.Generator(device=device).manual_seed(p.seed)
        for i, p in enumerate(params)
        if p.seed is not None
    }
