"""What the FP8 linear's reference and its Triton kernels share: float8_e4m3fn's range,
the floor of a quantisation group's scale, and the group sizes the kernels take."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # the largest float8_e4m3fn value
MIN_AMAX = 1e-10  # floor of a group's max |x| (an all-zero group gets a tiny, finite scale)


def triton_takes_group(group: int, device: torch.device) -> bool:
    """Whether the Triton kernels take `group` columns per scale: a power of two, >= 32
    for CUDA's float8 dot (>= 16 in the interpreter)."""
    return group >= (32 if device.type == "cuda" else 16) and not group & (group - 1)
