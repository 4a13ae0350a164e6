"""Fused mixture-of-experts: the (token, expert) pairs sorted by expert, then one grouped
GEMM for every expert's gate and up projections (SiLU-gated in the same pass) and one for
the down projections, each pair's output scaled by its routing weight, then summed over a
token's experts.

`cluster.kernels.moe_layout` lays the pairs out expert by expert for the kernels, so one
kernel program owns `block_m` rows of a single expert. `fused_moe_ref` is the torch
reference and the CPU path: the pairs in expert order, one product per expert that has
any, over its contiguous rows. FP8 experts (`FP8Experts`: float8 weights with block
scales) compute as `cluster.kernels.fp8_linear` does. `fused_moe` picks the Triton kernels
(`fused_moe_triton.py`) or the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cluster.kernels.backend import use_triton
from cluster.kernels.fp8_format import FP8Experts
from cluster.kernels.fp8_linear import (
    fp8_compute_supported,
    fp8_linear_ref,
    fp8_matmul_ref,
    quantize_activations_ref,
)


def _expert_mlp(
    rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, expert: int, fp8: FP8Experts | None
) -> torch.Tensor:
    """One expert's SiLU-gated MLP over `rows` ([n, hidden] -> [n, hidden])."""
    if fp8 is None:
        gate, up = F.linear(rows, w13[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2[expert])
    # gate and up stay float32 until SiLU(gate) * up is rounded once, as in the kernels
    inter = w13.shape[1] // 2
    gate_blocks = fp8.w13_scale.shape[1] // 2
    w, s = w13[expert], fp8.w13_scale[expert]
    x_q, x_scale = quantize_activations_ref(rows, fp8.block[1])
    f32 = torch.float32
    gate = fp8_matmul_ref(x_q, x_scale, w[:inter], s[:gate_blocks], None, fp8.block, f32)
    up = fp8_matmul_ref(x_q, x_scale, w[inter:], s[gate_blocks:], None, fp8.block, f32)
    hidden = (F.silu(gate) * up).to(rows.dtype)
    return fp8_linear_ref(hidden, w2[expert], fp8.w2_scale[expert], None, fp8.block)


def fused_moe_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    top_ids: torch.Tensor,  # [num_tokens, top_k] int64
    top_weights: torch.Tensor,  # [num_tokens, top_k]
    fp8: FP8Experts | None = None,
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
            out[start:end] = _expert_mlp(rows[start:end], w13, w2, expert, fp8)
            start = end
    out = out * top_weights.reshape(-1)[order, None]
    by_pair = torch.empty_like(out).index_copy_(0, order, out)
    return by_pair.view(num_tokens, top_k, w2.shape[1]).sum(dim=1)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_ids: torch.Tensor,
    top_weights: torch.Tensor,
    fp8: FP8Experts | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """`fused_moe_ref`'s result ([num_tokens, hidden]) from the backend's kernels (FP8
    experts on CUDA only where the device computes in FP8)."""
    if top_ids.numel() == 0:  # (an expert-parallel rank that received no rows)
        return x.new_zeros(x.shape[0], w2.shape[1])
    triton = use_triton(backend, x.device)
    if fp8 is not None and x.is_cuda:
        triton = triton and fp8_compute_supported(x.device, fp8.block)
    if triton:
        from cluster.kernels.fused_moe_triton import fused_moe_triton

        return fused_moe_triton(x, w13, w2, top_ids, top_weights, fp8)
    return fused_moe_ref(x, w13, w2, top_ids, top_weights, fp8)
