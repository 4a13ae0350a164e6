"""RMSNorm with an optional fused residual add: the torch reference (also the CPU path) and
`rms_norm`, which runs it or the Triton kernel in `rmsnorm_triton.py`.

With a residual: `residual = x + residual; out = rmsnorm(residual) * weight`, returning
`(out, residual)`; that is the pre-norm step between decoder layers. Statistics are
computed in float32 and the normalised value is cast back before the weight multiply,
as transformers' LlamaRMSNorm does, so results match it bit for bit in float32.
"""

from __future__ import annotations

import torch

from cluster.kernels.backend import use_triton


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (and the CPU path). x, residual: [num_tokens, hidden]; weight: [hidden]."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`out`, or `(out, residual)` with a residual (see `rms_norm_ref`)."""
    if use_triton(backend, x.device):
        from cluster.kernels.rmsnorm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
