"""What the FP8 kernels and their references share: float8_e4m3fn's range, the floor of a
quantisation group's scale, the group sizes the kernels take, and FP8 experts' scales."""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_MAX = 448.0  # the largest float8_e4m3fn value
MIN_AMAX = 1e-10  # floor of a group's max |x| (an all-zero group gets a tiny, finite scale)


def triton_takes_group(group: int, device: torch.device) -> bool:
    """Whether the Triton kernels take `group` columns per scale: a power of two, >= 32
    for CUDA's float8 dot (>= 16 in the interpreter)."""
    return group >= (32 if device.type == "cuda" else 16) and not group & (group - 1)


class FP8Experts(NamedTuple):
    """Block scales of FP8 experts (DeepSeek-V3's checkpoints): `w13` / `w2` are then
    float8_e4m3fn and each product runs as `cluster.kernels.fp8_linear` does (activations
    quantised per row and `block[1]` columns)."""

    w13_scale: torch.Tensor  # [num_experts, 2 * ceil(inter / bn), ceil(hidden / bk)]: gate's, up's
    w2_scale: torch.Tensor  # [num_experts, ceil(hidden / bn), ceil(inter / bk)]
    block: tuple[int, int]  # (bn, bk)
