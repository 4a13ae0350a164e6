"""RMSNorm with an optional fused residual add: the torch reference (also the CPU path) and
`rms_norm`, which runs it or the Triton kernel in `rmsnorm_triton.py`.

With a residual: `residual = x + residual; out = rmsnorm(residual) * weight`, returning
`(out, residual)`; that is the pre-norm step between decoder layers. Statistics are
computed in float32 and the normalised value is cast back before the weight multiply,
as transformers' LlamaRMSNorm does, so results match it bit for bit in float32.

Under torch.compile on CPU (`sum_width` given), the mean of squares is summed in
ATen's order (`cluster.kernels.eager_sum_order`), so a compiled norm equals the eager
one, and transformers', bit for bit in bfloat16 as well.
"""

from __future__ import annotations

import torch

from cluster.kernels.backend import use_triton
from cluster.kernels.eager_sum_order import aten_row_sum


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    sum_width: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (and the CPU path). x, residual: [num_tokens, hidden]; weight: [hidden].
    `sum_width`: compiling for CPU, sum the squares in ATen's order at that vector width."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    if sum_width is not None and h.device.type == "cpu" and torch.compiler.is_compiling():
        squares = (h * h).reshape(-1, h.shape[-1])
        mean = (aten_row_sum(squares, sum_width) / h.shape[-1]).reshape(*h.shape[:-1], 1)
    else:
        mean = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(mean + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
    backend: str = "auto",
    sum_width: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`out`, or `(out, residual)` with a residual (see `rms_norm_ref`)."""
    if use_triton(backend, x.device):
        from cluster.kernels.rmsnorm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual, sum_width)
