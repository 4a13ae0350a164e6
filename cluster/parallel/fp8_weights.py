"""FP8 weights of a tensor-parallel linear layer (DeepSeek-V3's block-scaled `quant_method:
fp8`): `to_fp8` makes a layer hold `weight` as float8_e4m3fn `[out_local, in_local]` and
`weight_scale_inv` as float32 `[ceil(out_local / bn), ceil(in_local / bk)]`, one scale per
`(bn, bk)` block, each read from the checkpoint as its rank's slice.

The scales stay aligned with the weight because a rank's slice of the weight must start on
a block boundary (in the parameter and in the checkpoint) and cover whole blocks, except a
last block that ends both the checkpoint tensor and the parameter. A sharding that breaks
this (a tensor-parallel size that cuts through blocks) is a ValueError naming the tensor,
the shard and the block size; the scale rows `start // b` on are then this rank's.
"""

from __future__ import annotations

import torch
from torch import nn

from cluster.parallel.weights import Shard, TensorLike, copy_placed, tensor_name


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_shard(
    shard: Shard, block: tuple[int, int], local_shape: tuple[int, ...], name: str
) -> Shard:
    """The scale tensor's `Shard` for a weight placed by `shard` (weight `local_shape`
    [out_local, in_local]); ValueError if the weight's slice is not whole blocks."""
    if shard.dim is None:
        return shard
    size = block[shard.dim]
    end = shard.start + shard.length
    ends_both = end == shard.full and shard.offset + shard.length == local_shape[shard.dim]
    if shard.start % size or shard.offset % size or (shard.length % size and not ends_both):
        what = "rows" if shard.dim == 0 else "columns"
        raise ValueError(
            f"{name}: the tensor-parallel shard of {shard.length} {what} ({shard.start}:{end} "
            f"of dim {shard.dim}, placed at {shard.offset}) does not fall on FP8 blocks of "
            f"{size} (weight_block_size {list(block)}); use a tensor_parallel_size whose "
            "shards are whole blocks"
        )
    full = None if shard.full is None else _cdiv(shard.full, size)
    return Shard(
        shard.dim, shard.offset // size, _cdiv(shard.length, size), shard.start // size, full
    )


def to_fp8(linear: nn.Module, block: tuple[int, int]) -> None:
    """Replace `linear.weight` with an empty float8_e4m3fn parameter of the same shape and
    add `weight_scale_inv`, both with loaders that keep the blocks aligned (see the module).
    The forward pass then computes in FP8 (`LinearBase.matmul`)."""
    if linear.weight_block is not None:
        return
    old = linear.weight
    rows, cols = old.shape
    weight = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=old.device)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    scales = torch.empty(_cdiv(rows, block[0]), _cdiv(cols, block[1]), device=old.device)
    linear.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
    linear.weight_block = block
    linear.packed_weight = None

    def load_weight(param: nn.Parameter, loaded: TensorLike, shard_id: object = None) -> None:
        shape = tuple(param.shape)
        shard = linear.placement(shape, shard_id)
        block_shard(shard, block, shape, tensor_name(loaded))  # checks the alignment
        copy_placed(param.data, loaded, shard)

    def load_scale(param: nn.Parameter, loaded: TensorLike, shard_id: object = None) -> None:
        shape = tuple(linear.weight.shape)
        shard = block_shard(linear.placement(shape, shard_id), block, shape, tensor_name(loaded))
        copy_placed(param.data, loaded, shard)

    linear.weight.weight_loader = load_weight
    linear.weight_scale_inv.weight_loader = load_scale
