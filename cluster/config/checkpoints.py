"""A checkpoint folder's tensors, whatever files hold them: `*.safetensors` (with or
without `model.safetensors.index.json`) or `pytorch_model*.bin` (with or without its
index), read lazily: safetensors by slice, `.bin` files memory-mapped
(`torch.load(..., weights_only=True, mmap=True)`, so no code in them runs).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import torch
from safetensors import safe_open

# (name, shape, read(slices) -> tensor) for each tensor of a checkpoint
TensorEntry = tuple[str, tuple[int, ...], Callable[[tuple[slice, ...]], torch.Tensor]]

_FORMATS = (  # (index file, file pattern), in order of preference
    ("model.safetensors.index.json", "*.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
)


def checkpoint_files(path: str) -> list[str]:
    """The files holding the checkpoint's tensors (from an index when there is one)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint folder {path!r} does not exist")
    for index_name, pattern in _FORMATS:
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
            files = [os.path.join(path, n) for n in names]
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise FileNotFoundError(f"files named in {index} are missing: {missing}")
            return files
        files = sorted(glob.glob(os.path.join(path, pattern)))
        if files:
            return files
    raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin files in {path!r}")


def iterate_tensors(path: str, stack: ExitStack) -> Iterator[TensorEntry]:
    """Every tensor of the checkpoint; files stay open (or mapped) while `stack` is."""
    for file in checkpoint_files(path):
        if file.endswith(".safetensors"):
            handle = stack.enter_context(safe_open(file, framework="pt"))
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor_slice = handle.get_slice(name)

                def read(slices: tuple[slice, ...], s=tensor_slice) -> torch.Tensor:
                    return s[slices] if slices else s[:]

                yield name, tuple(tensor_slice.get_shape()), read
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            for name, tensor in state.items():

                def read(slices: tuple[slice, ...], t=tensor) -> torch.Tensor:
                    return t[slices].clone() if slices else t.clone()

                yield name, tuple(tensor.shape), read


def checkpoint_tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the checkpoint (no tensor data is read)."""
    with ExitStack() as stack:
        return {name: shape for name, shape, _ in iterate_tensors(path, stack)}
