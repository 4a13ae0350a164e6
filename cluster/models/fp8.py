"""FP8 checkpoints with block scales (DeepSeek-V3's `quant_method: fp8`): every
`X.weight` stored as float8_e4m3fn has an `X.weight_scale_inv` holding one float32 scale
per `weight_block_size` block.

Two ways to load them (`cluster.models.loader.load_weights` picks one and logs which):

- FP8 compute, where the device has FP8 tensor cores (`fp8_compute_supported`: CUDA with
  compute capability >= 8.9) or when asked for (`fp8_compute=True`, e.g. CPU tests,
  which run the torch reference): the tensor-parallel linear layers keep `weight` as
  float8_e4m3fn plus their `weight_scale_inv` shard (`cluster.parallel.fp8_weights`) and
  multiply through `cluster.kernels.fp8_linear` (activations quantised per token and
  block of columns); MoE experts keep `w13` / `w2` as float8_e4m3fn with their block
  scales (`SparseMoeBlock.use_fp8_experts`) and run through the fused MoE kernels. Layers
  whose weight the model reads as a matrix (`fp8_allowed = False`, e.g. MLA's
  `kv_b_proj`, absorbed into queries and outputs) keep the dequantised path.
- Otherwise every such weight is read dequantised (weight times its block's scale) into
  the model dtype, and the scales are not loaded as tensors of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from cluster.models.moe import SparseMoeBlock
from cluster.parallel.linear import LinearBase
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


def dequantize_slice(
    weight: LazyTensor,  # [rows, cols] float8
    scale_inv: LazyTensor,  # [ceil(rows / bn), ceil(cols / bk)] float32
    slices: tuple[slice, ...],
    block: tuple[int, int],
) -> torch.Tensor:
    """`dequantize_blocks(weight, scale_inv)[slices]`, reading only the slice and the
    scales of the blocks it touches (no rank materialises a whole tensor)."""
    if len(weight.full_shape) != 2:
        full = dequantize_blocks(weight.load(), scale_inv.load(), block)
        return full[slices] if slices else full
    rows, cols = slices or (slice(0, weight.full_shape[0]), slice(0, weight.full_shape[1]))
    part, scales = weight, scale_inv
    for dim, (piece, size) in enumerate(zip((rows, cols), block, strict=True)):
        part = part.narrow(dim, piece.start, piece.stop - piece.start)
        first = piece.start // size
        scales = scales.narrow(dim, first, -(-piece.stop // size) - first)
    values = part.load().float()
    expanded = scales.load().float()
    for dim, (piece, size) in enumerate(zip((rows, cols), block, strict=True)):
        offset = piece.start % size
        expanded = expanded.repeat_interleave(size, dim).narrow(dim, offset, values.shape[dim])
    return values * expanded


def scales_by_weight(tensors: list[LazyTensor]) -> dict[str, LazyTensor]:
    """Checkpoint weight name -> its `weight_scale_inv` tensor."""
    suffix = ".weight" + SCALE_SUFFIX
    return {t.name[: -len(SCALE_SUFFIX)]: t for t in tensors if t.name.endswith(suffix)}


def split_fp8(
    tensors: list[LazyTensor], block: tuple[int, int], kept: set[str]
) -> tuple[list[LazyTensor], dict[str, LazyTensor]]:
    """(tensors to load, scale of each weight kept FP8 by weight name): the weights named
    in `kept` stay float8 (their scales are loaded with them), every other weight that has
    a scale is read dequantised (the whole weight, then the reader's slice), and the scale
    tensors themselves are left out of the list."""
    scales = scales_by_weight(tensors)
    out = []
    for tensor in tensors:
        if tensor.name.endswith(".weight" + SCALE_SUFFIX):
            continue
        scale = scales.get(tensor.name)
        if scale is not None and tensor.name not in kept:

            def read(slices: tuple[slice, ...], w=tensor, s=scale) -> torch.Tensor:
                return dequantize_slice(w, s, slices, block)

            tensor = LazyTensor(tensor.name, tensor.full_shape, read)
        out.append(tensor)
    return out, {name: scales[name] for name in kept}


def make_fp8_layers(
    model: nn.Module,
    weight_names: Iterable[str],
    resolve: Callable[[str], str | None],
    block: tuple[int, int],
) -> set[str]:
    """Switch every linear layer filled by one of `weight_names` (checkpoint weights that
    have scales; `resolve` maps each to its parameter name, None if this model skips it)
    to FP8 weights, unless it opts out (`fp8_allowed`); returns the names it switched."""
    kept = set()
    for name in weight_names:
        param = resolve(name)
        if param is None:
            continue
        path, _, leaf = param.rpartition(".")
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if leaf == "weight" and isinstance(module, LinearBase) and module.fp8_allowed:
            module.use_fp8_weight(block)
            kept.add(name)
        elif leaf in ("w13", "w2") and isinstance(module, SparseMoeBlock):
            module.use_fp8_experts(block)
            kept.add(name)
    return kept
