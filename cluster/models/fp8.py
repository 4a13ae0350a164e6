"""FP8 checkpoints with block scales (DeepSeek-V3's `quant_method: fp8`): every
`X.weight` stored as float8_e4m3fn has an `X.weight_scale_inv` holding one float32 scale
per `weight_block_size` block. `cluster` computes in the model dtype: the loader reads
such weights dequantised (weight x its block's scale), and the scales are not loaded as
tensors of their own. There is no FP8 compute path.
"""

from __future__ import annotations

from typing import Any

import torch

from cluster.parallel.weights import LazyTensor

SCALE_SUFFIX = "_scale_inv"


def block_size_of(config: Any) -> tuple[int, int] | None:
    """The checkpoint's FP8 block size, or None when its weights are not FP8."""
    quant = getattr(config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict()
    if quant.get("quant_method") != "fp8":
        return None
    rows, cols = quant.get("weight_block_size") or (128, 128)
    return int(rows), int(cols)


def dequantize_blocks(
    weight: torch.Tensor,  # [rows, cols] float8
    scale_inv: torch.Tensor,  # [ceil(rows / block_rows), ceil(cols / block_cols)] float32
    block: tuple[int, int],
) -> torch.Tensor:
    """[rows, cols] float32: each block of the weight times its scale."""
    rows, cols = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows]
    scales = scales.repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scales


def dequantizing(tensors: list[LazyTensor], block: tuple[int, int]) -> list[LazyTensor]:
    """The checkpoint's tensors with every weight that has a scale read dequantised (the
    whole weight is dequantised, then the reader's slice taken), the scales dropped."""
    scales = {
        t.name[: -len(SCALE_SUFFIX)]: t
        for t in tensors
        if t.name.endswith(".weight" + SCALE_SUFFIX)
    }
    out = []
    for tensor in tensors:
        if tensor.name.endswith(".weight" + SCALE_SUFFIX):
            continue
        scale = scales.get(tensor.name)
        if scale is not None:

            def read(slices: tuple[slice, ...], w=tensor, s=scale) -> torch.Tensor:
                full = dequantize_blocks(w.load(), s.load(), block)
                return full[slices] if slices else full

            tensor = LazyTensor(tensor.name, tensor.full_shape, read)
        out.append(tensor)
    return out
