"""Small modules shared by the model files: RMSNorm (fused add), SiLU-and-multiply, and
rotary position embeddings.

Rotary embeddings use the neox (rotate-half) layout with Llama's scaling types.

Supported `rope_type`s: "default", "linear", "llama3", "yarn" (`ROPE_TYPES`). The inverse
frequencies (and YaRN's attention factor on cos / sin) are computed exactly as
transformers computes them, so float32 results match it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cluster.config.architectures import ROPE_TYPES
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
    or new (`rope_parameters`) style. Raises ValueError for a rope type not supported."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    merged = {**scaling, **params}
    theta = float(merged.pop("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0))
    merged.setdefault("rope_type", merged.pop("type", "default"))
    if merged["rope_type"] not in ROPE_TYPES:
        raise ValueError(
            f"rope_type={merged['rope_type']!r} is not supported (supported: {list(ROPE_TYPES)})"
        )
    if merged["rope_type"] == "yarn":
        merged.setdefault("max_position_embeddings", hf_config.max_position_embeddings)
    return theta, merged


def _yarn_factor(scaling: dict[str, Any]) -> float:
    factor = scaling.get("factor")
    if factor is None:  # (DeepSeek's configs) the ratio of the two context lengths
        original = scaling["original_max_position_embeddings"]
        return float(scaling["max_position_embeddings"] / original)
    return float(factor)


def attention_factor(scaling: dict[str, Any]) -> float:
    """The factor on cos / sin: YaRN's (from `factor`, `mscale`, `mscale_all_dim`), else 1."""
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def _yarn_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """NTK-by-parts: extrapolated frequencies for fast dimensions, interpolated (divided
    by the factor) for slow ones, a linear ramp between (transformers' formula)."""
    factor = _yarn_factor(scaling)
    original = scaling.get("original_max_position_embeddings")
    original = float(original or scaling["max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling)
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
    raise ValueError(f"rope_type={rope_type!r} is not supported (supported: {list(ROPE_TYPES)})")


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
        self.attention_factor = attention_factor(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The step's rotation for every token, computed once and shared by every layer."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope(q: torch.Tensor, k: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [num_tokens, heads, head_dim]; k: [num_tokens, kv_heads, head_dim]. A rotation
    narrower than the heads (partial rotary) turns their first dimensions only."""
    cos, sin = rope
    dim = cos.shape[-1]
    if dim < q.shape[-1]:
        q_rot, k_rot = apply_rope(q[..., :dim], k[..., :dim], rope)
        return torch.cat([q_rot, q[..., dim:]], -1), torch.cat([k_rot, k[..., dim:]], -1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
