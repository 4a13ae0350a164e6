"""Triton kernels of `cluster.kernels.fused_moe`: two grouped GEMMs over the pairs laid out
by `align_by_expert`.

Program (m, n) owns `BLOCK_M` consecutive slots of the layout (one expert's pairs, or
padding) and `BLOCK_N` output columns. `_gate_up_kernel` gathers the slots' token rows of
x, multiplies them by the expert's gate and up rows in two float32 accumulators and
stores SiLU(gate) * up; `_down_kernel` multiplies those by the expert's down projection,
scales each pair by its routing weight and stores it at the pair's own row. A block that
names no expert stores nothing. The per-token sum over experts is left to torch, in the
reference's order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.kernels.fp8_format import FP8Experts
from cluster.kernels.fp8_linear import quantize_activations
from cluster.kernels.moe_layout import align_by_expert

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [num_tokens, K] (FP8: float8, quantised per row and BLOCK_K columns)
    w_ptr,  # [num_experts, 2 * N, K]
    out_ptr,  # [num_pairs, N]
    sorted_pairs_ptr,
    block_experts_ptr,
    xs_ptr,  # FP8: [num_tokens, num_groups] activation scales
    ws_ptr,  # FP8: [num_experts, 2 * UP_SCALE_ROW, num_groups] weight block scales
    num_pairs,
    top_k,
    N,
    K,
    num_groups,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    stride_wse,
    stride_wsn,
    FP8: tl.constexpr,
    IEEE: tl.constexpr,  # float32 operands: full-precision products (CUDA's default is TF32)
    SCALE_ROWS: tl.constexpr,  # FP8: weight rows per scale block
    UP_SCALE_ROW: tl.constexpr,  # FP8: the up projection's first scale row
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pairs_ptr + offs_m)
        valid = pair < num_pairs
        token = tl.where(valid, pair // top_k, 0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + expert * stride_we
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                x_ptr + token[:, None] * stride_xm + offs_k[None, :],
                mask=valid[:, None] & (offs_k[None, :] < K),
                other=0.0,
            )
            w_mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
            gate = tl.load(
                w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0
            )
            up = tl.load(
                w_base + (N + offs_n[None, :]) * stride_wn + offs_k[:, None],
                mask=w_mask,
                other=0.0,
            )
            if FP8:
                group = k0 // BLOCK_K
                x_scale = tl.load(xs_ptr + token * num_groups + group, mask=valid, other=0.0)
                ws = ws_ptr + expert * stride_wse + group
                rows = offs_n // SCALE_ROWS
                gate_scale = tl.load(ws + rows * stride_wsn, mask=offs_n < N, other=0.0)
                up_scale = tl.load(
                    ws + (UP_SCALE_ROW + rows) * stride_wsn, mask=offs_n < N, other=0.0
                )
                acc_gate += tl.dot(a, gate) * x_scale[:, None] * gate_scale[None, :]
                acc_up += tl.dot(a, up) * x_scale[:, None] * up_scale[None, :]
            elif IEEE:
                acc_gate += tl.dot(a, gate, input_precision="ieee")
                acc_up += tl.dot(a, up, input_precision="ieee")
            else:
                acc_gate += tl.dot(a, gate)
                acc_up += tl.dot(a, up)
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(
            out_ptr + pair[:, None] * stride_om + offs_n[None, :],
            h.to(out_ptr.dtype.element_ty),
            mask=valid[:, None] & (offs_n[None, :] < N),
        )


@triton.jit
def _down_kernel(
    h_ptr,  # [num_pairs, K] (FP8: float8, quantised per row and BLOCK_K columns)
    w_ptr,  # [num_experts, N, K]
    weights_ptr,  # [num_pairs]
    out_ptr,  # [num_pairs, N]
    sorted_pairs_ptr,
    block_experts_ptr,
    hs_ptr,  # FP8: [num_pairs, num_groups] activation scales
    ws_ptr,  # FP8: [num_experts, ceil(N / SCALE_ROWS), num_groups] weight block scales
    num_pairs,
    N,
    K,
    num_groups,
    stride_hm,
    stride_we,
    stride_wn,
    stride_om,
    stride_wse,
    stride_wsn,
    FP8: tl.constexpr,
    IEEE: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pairs_ptr + offs_m)
        valid = pair < num_pairs
        row = tl.where(valid, pair, 0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + expert * stride_we
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                h_ptr + row[:, None] * stride_hm + offs_k[None, :],
                mask=valid[:, None] & (offs_k[None, :] < K),
                other=0.0,
            )
            w = tl.load(
                w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                mask=(offs_k[:, None] < K) & (offs_n[None, :] < N),
                other=0.0,
            )
            if FP8:
                group = k0 // BLOCK_K
                h_scale = tl.load(hs_ptr + row * num_groups + group, mask=valid, other=0.0)
                w_scale = tl.load(
                    ws_ptr + expert * stride_wse + (offs_n // SCALE_ROWS) * stride_wsn + group,
                    mask=offs_n < N,
                    other=0.0,
                )
                acc += tl.dot(a, w) * h_scale[:, None] * w_scale[None, :]
            elif IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        weight = tl.load(weights_ptr + row, mask=valid, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        tl.store(
            out_ptr + pair[:, None] * stride_om + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=valid[:, None] & (offs_n[None, :] < N),
        )


def fused_moe_triton(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    top_ids: torch.Tensor,  # [num_tokens, top_k]
    top_weights: torch.Tensor,  # [num_tokens, top_k]
    fp8: FP8Experts | None = None,
) -> torch.Tensor:
    """[num_tokens, hidden]: `fused_moe_ref`'s result from the two grouped GEMMs."""
    if not x.is_cuda and torch.bfloat16 in (x.dtype, w13.dtype):
        # The interpreter multiplies bfloat16 bit patterns in tl.dot (triton-lang/triton#11584).
        raise NotImplementedError("bfloat16 under the Triton interpreter: use float16 or float32")
    num_tokens, top_k = top_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    num_pairs = num_tokens * top_k
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    layout = align_by_expert(top_ids, num_experts, BLOCK_M)
    num_blocks = layout.block_experts.numel()
    block_k, scale_rows, dummy = BLOCK_K, 1, layout.sorted_pairs
    x_in, x_scale, s13, s2 = x, dummy, dummy, dummy
    if fp8 is not None:
        scale_rows, block_k = fp8.block
        x_in, x_scale = quantize_activations(x, block_k)
        s13, s2 = fp8.w13_scale.float().contiguous(), fp8.w2_scale.float().contiguous()
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, BLOCK_N))](
        x_in,
        w13,
        h,
        layout.sorted_pairs,
        layout.block_experts,
        x_scale,
        s13,
        num_pairs,
        top_k,
        inter,
        hidden,
        triton.cdiv(hidden, block_k),
        x_in.stride(0),
        w13.stride(0),
        w13.stride(1),
        h.stride(0),
        s13.stride(0),
        s13.stride(1) if fp8 is not None else 0,
        FP8=fp8 is not None,
        IEEE=x.dtype == torch.float32,
        SCALE_ROWS=scale_rows,
        UP_SCALE_ROW=s13.shape[1] // 2 if fp8 is not None else 0,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
    )
    h_in, h_scale = (h, dummy) if fp8 is None else quantize_activations(h, block_k)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, BLOCK_N))](
        h_in,
        w2,
        top_weights.reshape(-1).contiguous(),
        out,
        layout.sorted_pairs,
        layout.block_experts,
        h_scale,
        s2,
        num_pairs,
        hidden,
        inter,
        triton.cdiv(inter, block_k),
        h_in.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        s2.stride(0),
        s2.stride(1) if fp8 is not None else 0,
        FP8=fp8 is not None,
        IEEE=x.dtype == torch.float32,
        SCALE_ROWS=scale_rows,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
    )
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
