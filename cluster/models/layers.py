"""Small modules shared by the model files: RMSNorm (fused add), SiLU-and-multiply, and
rotary position embeddings.

Rotary embeddings use the neox (rotate-half) layout with Llama's scaling types.

Supported `rope_type`s: "default", "linear", "llama3". The inverse frequencies are
computed exactly as transformers computes them, so float32 results match it.
"""

from __future__ import annotations

import math
from typing import Any

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


def rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict) from a transformers config, old (`rope_theta`/`rope_scaling`)
    or new (`rope_parameters`) style."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    merged = {**scaling, **params}
    theta = float(merged.pop("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0))
    merged.setdefault("rope_type", merged.pop("type", "default"))
    return theta, merged


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_factor = float(scaling["low_freq_factor"])
        high_factor = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_factor
        high_freq_wavelen = old_context / high_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"rope_type={rope_type!r} is not supported (allowed: 'default', 'linear', 'llama3')"
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [num_tokens, 1, head_dim]


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any]) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The step's rotation for every token, computed once and shared by every layer."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(q: torch.Tensor, k: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [num_tokens, heads, head_dim]; k: [num_tokens, kv_heads, head_dim]."""
    cos, sin = rope
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
