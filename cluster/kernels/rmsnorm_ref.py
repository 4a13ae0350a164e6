"""RMSNorm with an optional fused residual add, in torch: the reference and the CPU path.

With a residual: `residual = x + residual; out = rmsnorm(residual) * weight`, returning
`(out, residual)`; that is the pre-norm step between decoder layers. Statistics are
computed in float32 and the normalised value is cast back before the weight multiply,
as transformers' LlamaRMSNorm does, so results match it bit for bit in float32.
"""

from __future__ import annotations

import torch


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
