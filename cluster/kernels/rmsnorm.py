"""RMSNorm with an optional fused residual add: the torch reference (also the CPU path) and
`rms_norm`, which runs it or the Triton kernel in `rmsnorm_triton.py`.

With a residual: `residual = x + residual; out = rmsnorm(residual) * weight`, returning
`(out, residual)`; that is the pre-norm step between decoder layers. Statistics are
computed in float32 and the normalised value is cast back before the weight multiply,
as transformers' LlamaRMSNorm does, so results match it bit for bit in float32.

Under torch.compile on CPU the mean of squares is one opaque op (`mean_square`), which
runs ATen's eager `mean`: inductor's own reduction adds in another order, and where one
activation dwarfs the rest (late layers of SmolLM2 carry values near 25,000) the two
sums differ in their last bit, which moves the bfloat16 rounding of a few normalised
values; by the last layer a compiled forward's logits differed from eager's by up to 0.8
and greedy output diverged at the first near-tie. With the op, a compiled norm equals
the eager one, and transformers', bit for bit in bfloat16 as well. (Emulating ATen's
order in traced adds gave the same bits but tripled the cold compile: 67 -> 174 s.)
"""

from __future__ import annotations

import torch

from cluster.kernels.backend import use_triton
from cluster.kernels.library import define_op


def _mean_square(h: torch.Tensor) -> torch.Tensor:
    """[..., d] float32 -> [..., 1]: `h.pow(2).mean(-1, keepdim=True)` run by ATen (opaque
    to inductor, so a compiled graph sums in eager's order)."""
    return h.pow(2).mean(-1, keepdim=True)


def _mean_square_fake(h: torch.Tensor) -> torch.Tensor:
    return h.new_empty((*h.shape[:-1], 1))


mean_square = define_op("mean_square(Tensor h) -> Tensor", _mean_square, _mean_square_fake)


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
    if h.device.type == "cpu" and torch.compiler.is_compiling():
        mean = mean_square(h)
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`out`, or `(out, residual)` with a residual (see `rms_norm_ref`)."""
    if use_triton(backend, x.device):
        from cluster.kernels.rmsnorm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
