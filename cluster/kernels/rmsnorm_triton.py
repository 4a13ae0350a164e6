"""RMSNorm with an optional fused residual add as a Triton kernel (`rmsnorm.py` holds
the same maths in torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    offsets = row * hidden_size + cols
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + offsets, mask=mask, other=0.0)
        tl.store(residual_out_ptr + offsets, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / hidden_size
    h = h * tl.math.rsqrt(variance + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, w * h.to(x.dtype), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `rms_norm_ref` (one program per token row)."""
    x = x.contiguous()
    hidden = x.shape[-1]
    num_rows = x.numel() // hidden
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else out
    _rms_norm_kernel[(num_rows,)](
        x,
        residual.contiguous() if residual is not None else x,
        weight,
        out,
        residual_out,
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(hidden),
    )
    return out if residual is None else (out, residual_out)
