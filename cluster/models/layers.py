"""Small modules shared by the model files: RMSNorm (fused add) and SiLU-and-multiply."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.kernels.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    """`forward(x)` -> normed; `forward(x, residual)` -> (normed(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * d] (gate then up) -> [num_tokens, d]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
