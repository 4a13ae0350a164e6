"""Fused mixture-of-experts: the (token, expert) pairs sorted by expert, then one grouped
GEMM for every expert's gate and up projections (SiLU-gated in the same pass) and one for
the down projections, each pair's output scaled by its routing weight, then summed over a
token's experts.

`align_by_expert` lays the pairs out expert by expert, each expert's run padded to a whole
number of `block_m` rows, so one kernel program owns `block_m` rows of a single expert; the
layout has a fixed size for a given number of pairs (no host sync, CUDA-graph safe), and
its unused blocks name no expert. `fused_moe_ref` is the torch reference and the CPU path:
the same sorted layout, one matmul per expert that has tokens over its contiguous rows.
`fused_moe` picks the Triton kernels (`fused_moe_triton.py`) or the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from cluster.kernels.backend import use_triton


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


def fused_moe_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    top_ids: torch.Tensor,  # [num_tokens, top_k] int64
    top_weights: torch.Tensor,  # [num_tokens, top_k]
) -> torch.Tensor:
    """[num_tokens, hidden]: each expert once, over its pairs' rows gathered contiguously
    in expert order; the pairs' outputs weighted, then summed per token."""
    num_tokens, top_k = top_ids.shape
    flat = top_ids.reshape(-1)
    order = flat.argsort(stable=True)  # [num_pairs] pair ids by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    rows = x[order // top_k]  # [num_pairs, hidden] in expert order
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            gate, up = F.linear(rows[start:end], w13[expert]).chunk(2, dim=-1)
            out[start:end] = F.linear(F.silu(gate) * up, w2[expert])
            start = end
    out = out * top_weights.reshape(-1)[order, None]
    by_pair = torch.empty_like(out).index_copy_(0, order, out)
    return by_pair.view(num_tokens, top_k, -1).sum(dim=1)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_ids: torch.Tensor,
    top_weights: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """`fused_moe_ref`'s result ([num_tokens, hidden]) from the backend's kernels."""
    if use_triton(backend, x.device):
        from cluster.kernels.fused_moe_triton import fused_moe_triton

        return fused_moe_triton(x, w13, w2, top_ids, top_weights)
    return fused_moe_ref(x, w13, w2, top_ids, top_weights)
