"""Block-scaled FP8 linear as Triton kernels (`fp8_linear.py` holds the same maths in torch):
a per-token-group activation quantiser, and a matmul that takes one native float8 `tl.dot`
per column group and scales it into a float32 accumulator.

Rounding to float8: on CUDA the native conversion (round to nearest even, as torch). The
Triton interpreter's float32 -> float8 conversion does not round to nearest even, so there
(`ROUND_IN_FP32`) the value is first rounded onto the e4m3 grid in float32 and then
converted exactly. Divisions use `div_rn` (IEEE), as torch does, so both paths quantise
bit for bit like the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.kernels.fp8_format import FP8_MAX, MIN_AMAX, triton_takes_group

# One tile shape whatever the token count, so a token's output never depends on how many
# tokens share the call (batch invariance: a tile-size choice by M would change the tensor
# cores' accumulation). On an H200 (N=7168, K=2048, CUDA graphs) this costs ~3 us at one
# token against 16x64 tiles and is the fastest tile from ~256 tokens on.
BLOCK_M = 64
BLOCK_N = 128


@triton.jit
def _round_to_e4m3(y):
    """float32 values within +-448 rounded to nearest even on the float8_e4m3fn grid."""
    exponent = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF
    exponent = tl.maximum(exponent, 121)  # below 2**-6 the grid spacing is 2**-9
    spacing = ((exponent - 3) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    magic = spacing * 12582912.0  # 1.5 * 2**23: adding it rounds to a multiple of spacing
    return (y + magic) - magic


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_x,
    num_groups,
    M,
    FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)  # [BLOCK_ROWS, GROUP]
    fp8_max = tl.full([BLOCK_ROWS, 1], FP8_MAX, tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1, keep_dims=True), MIN_AMAX)
    scale = tl.math.div_rn(amax, fp8_max)  # [BLOCK_ROWS, 1]
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
    if ROUND_IN_FP32:
        y = _round_to_e4m3(y)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], y.to(tl.float8e4nv), mask=mask)
    scale_ptrs = scale_ptr + rows[:, None] * num_groups + group
    tl.store(scale_ptrs, scale, mask=rows[:, None] < M)


@triton.jit
def _fp8_matmul_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    num_groups,
    stride_ws,
    HAS_BIAS: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, num_groups):
        k = g * BLOCK_K + offs_k
        a = tl.load(
            xq_ptr + offs_m[:, None] * K + k[None, :],
            mask=mask_m[:, None] & (k[None, :] < K),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K] float8
        b = tl.load(
            w_ptr + offs_n[None, :] * K + k[:, None],
            mask=mask_n[None, :] & (k[:, None] < K),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N] float8, K-major
        x_scale = tl.load(xs_ptr + offs_m * num_groups + g, mask=mask_m, other=0.0)
        w_scale = tl.load(ws_ptr + (offs_n // SCALE_ROWS) * stride_ws + g, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _check_group(group: int, device: torch.device) -> None:
    if not triton_takes_group(group, device):
        raise ValueError(
            f"the FP8 Triton kernels need a power-of-two column block (>= 32 on CUDA), got {group}"
        )


def quantize_activations_triton(
    x: torch.Tensor,  # [M, K] float
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `quantize_activations_ref` (one program per 16 tokens and group)."""
    _check_group(group, x.device)
    x = x.contiguous()
    m, k = x.shape
    groups = triton.cdiv(k, group)
    x_q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _quantize_kernel[(triton.cdiv(m, 16), groups)](
            x,
            x_q,
            scale,
            k,
            x.stride(0),
            groups,
            m,
            FP8_MAX=FP8_MAX,
            MIN_AMAX=MIN_AMAX,
            GROUP=group,
            BLOCK_ROWS=16,
            ROUND_IN_FP32=x.device.type != "cuda",
        )
    return x_q, scale


def fp8_linear_triton(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale_inv: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    bias: torch.Tensor | None,  # [N]
    block: tuple[int, int],
) -> torch.Tensor:
    """[..., N] in x's dtype: Triton version of `fp8_linear_ref`."""
    bn, bk = block
    n, k = weight.shape
    if weight_scale_inv.shape != (triton.cdiv(n, bn), triton.cdiv(k, bk)):
        raise ValueError(
            f"weight_scale_inv has shape {tuple(weight_scale_inv.shape)}; a [{n}, {k}] weight "
            f"in {bn}x{bk} blocks needs ({triton.cdiv(n, bn)}, {triton.cdiv(k, bk)})"
        )
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    x_q, x_scale = quantize_activations_triton(flat, bk)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        weight = weight.contiguous()
        weight_scale_inv = weight_scale_inv.float().contiguous()
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _fp8_matmul_kernel[grid](
            x_q,
            x_scale,
            weight,
            weight_scale_inv,
            bias if bias is not None else x_scale,
            out,
            m,
            n,
            k,
            x_scale.shape[1],
            weight_scale_inv.stride(0),
            HAS_BIAS=bias is not None,
            SCALE_ROWS=bn,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=bk,
            num_warps=4,
            num_stages=3,
        )
    return out.view(*x.shape[:-1], n)
