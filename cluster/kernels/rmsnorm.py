"""`rms_norm`: RMSNorm with an optional fused residual add, as Triton or torch."""

from __future__ import annotations

import torch

from cluster.kernels.backend import use_triton
from cluster.kernels.rmsnorm_ref import rms_norm_ref


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`out`, or `(out, residual)` with a residual (see `rmsnorm_ref.py`)."""
    if use_triton(backend, x.device):
        from cluster.kernels.rmsnorm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
