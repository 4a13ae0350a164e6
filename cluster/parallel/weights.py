"""Checkpoint tensors and the shard copy every `weight_loader` ends in.

A `weight_loader(param, loaded, shard_id=None)` receives the FULL checkpoint
tensor, either a `torch.Tensor` or a `LazyTensor` that reads only the slice it
is narrowed to (so each rank reads only its shard from disk).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


class TensorLike(Protocol):
    @property
    def shape(self) -> torch.Size: ...

    def narrow(self, dim: int, start: int, length: int) -> TensorLike: ...


class LazyTensor:
    """A checkpoint tensor that is read from disk only when `load()` is called.

    `read(slices)` returns the tensor for a tuple of slices (one per dim); `narrow`
    composes slices without reading anything.
    """

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        read: Callable[[tuple[slice, ...]], torch.Tensor],
        slices: tuple[slice, ...] | None = None,
    ) -> None:
        self.name = name
        self.full_shape = tuple(shape)
        self._read = read
        self._slices = slices or tuple(slice(0, n) for n in shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(s.stop - s.start for s in self._slices)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        dim = dim % len(self._slices)
        old = self._slices[dim]
        if start < 0 or length < 0 or old.start + start + length > old.stop:
            raise ValueError(
                f"{self.name}: cannot take [{start}:{start + length}] of dim {dim} "
                f"from shape {tuple(self.shape)}"
            )
        new = slice(old.start + start, old.start + start + length)
        slices = (*self._slices[:dim], new, *self._slices[dim + 1 :])
        return LazyTensor(self.name, self.full_shape, self._read, slices)

    def load(self) -> torch.Tensor:
        return self._read(self._slices)


def materialize(x: TensorLike) -> torch.Tensor:
    return x.load() if isinstance(x, LazyTensor) else x  # type: ignore[return-value]


def tensor_name(x: TensorLike) -> str:
    return x.name if isinstance(x, LazyTensor) else "tensor"


def copy_shard(
    dst: torch.Tensor,
    loaded: TensorLike,
    dim: int | None = None,
    start: int = 0,
    length: int | None = None,
    full: int | None = None,
) -> None:
    """Copy `loaded.narrow(dim, start, length)` (or all of it) into `dst`, checking shapes:
    with `full`, the checkpoint's `dim` must be exactly that long (every rank's shards
    together), so a mismatched checkpoint cannot load a wrong slice silently."""
    full_shape = tuple(loaded.shape)
    if dim is not None and full is not None and full_shape[dim] != full:
        raise ValueError(
            f"{tensor_name(loaded)}: checkpoint shape {full_shape} has {full_shape[dim]} in "
            f"dim {dim}; the model expects {full} (tensor-parallel shards of "
            f"{dst.shape[dim]} each)"
        )
    if dim is not None:
        length = dst.shape[dim] if length is None else length
        if start + length > loaded.shape[dim] or len(loaded.shape) != dst.dim():
            raise ValueError(
                f"{tensor_name(loaded)}: checkpoint shape {full_shape} does not fit the "
                f"parameter shard of shape {tuple(dst.shape)} (rows {start}:{start + length} "
                f"of dim {dim})"
            )
        loaded = loaded.narrow(dim, start, length)
    if tuple(loaded.shape) != tuple(dst.shape):
        raise ValueError(
            f"{tensor_name(loaded)}: checkpoint shape {full_shape} does not match the "
            f"parameter shape {tuple(dst.shape)}"
        )
    dst.copy_(materialize(loaded))


@dataclass(frozen=True)
class Shard:
    """Where this rank's piece of a checkpoint tensor goes: `length` rows from `start` of
    the checkpoint's `dim` (which must be `full` long) into rows `offset:offset + length`
    of the parameter's `dim`. `dim` None: the whole tensor, same shape."""

    dim: int | None = None
    offset: int = 0
    length: int = 0
    start: int = 0
    full: int | None = None


def copy_placed(dst: torch.Tensor, loaded: TensorLike, shard: Shard) -> None:
    """Copy `loaded`'s piece described by `shard` into `dst` (checked as `copy_shard`)."""
    if shard.dim is None:
        copy_shard(dst, loaded)
        return
    piece = dst.narrow(shard.dim, shard.offset, shard.length)
    copy_shard(piece, loaded, shard.dim, shard.start, shard.length, full=shard.full)


def default_weight_loader(param: torch.Tensor, loaded: TensorLike) -> None:
    """Replicated parameters: the whole tensor, same shape."""
    copy_shard(param.data, loaded)
