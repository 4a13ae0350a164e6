"""The (token, expert) pairs of a step laid out expert by expert for the fused MoE kernels.

Each expert's run is padded to a whole number of `block_m` rows, so one kernel program
owns `block_m` rows of a single expert. The layout has a fixed size for a given number of
pairs (no host sync: CUDA-graph safe), and its unused blocks name no expert.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ExpertLayout(NamedTuple):
    """The pairs in expert order. Pair p is (token p // top_k, its (p % top_k)-th expert)."""

    sorted_pairs: torch.Tensor  # [num_slots] int64 pair ids by expert; num_pairs: padding
    block_experts: torch.Tensor  # [num_slots // block_m] int64 expert of each block; -1: none
    counts: torch.Tensor  # [num_experts] pairs per expert


def max_slots(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Slots for any routing of `num_pairs` pairs: every expert that has pairs (at most
    min(num_experts, num_pairs) of them) pads its run by fewer than `block_m` rows."""
    slots = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-slots // block_m) * block_m


def align_by_expert(top_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """`top_ids` [num_tokens, top_k] -> the pairs sorted by expert, each expert's run
    starting on a multiple of `block_m` (device ops only, no sync)."""
    flat = top_ids.reshape(-1)  # [num_pairs]
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.bincount(flat, minlength=num_experts)  # [num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = flat.argsort(stable=True)  # pair ids by expert
    expert_of_sorted = flat[order]
    first_of_expert = counts.cumsum(0) - counts  # where each expert's run starts, unpadded
    rank = torch.arange(num_pairs, device=device) - first_of_expert[expert_of_sorted]
    slot = (padded_ends - padded)[expert_of_sorted] + rank
    num_slots = max_slots(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((num_slots,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[slot] = order
    block_starts = torch.arange(0, num_slots, block_m, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return ExpertLayout(sorted_pairs, block_experts, counts)
