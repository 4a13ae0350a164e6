"""The one place that decides whether a kernel runs as Triton or as its torch reference.

`backend`: "auto" (Triton for CUDA tensors when triton is installed, torch elsewhere),
"triton" (on CPU tensors:
the Triton interpreter, which must be switched on with `TRITON_INTERPRET=1` before
`triton` is first imported) or "torch".
"""

from __future__ import annotations

import importlib.util
import os
from typing import Final, Literal

import torch

Backend = Literal["auto", "torch", "triton"]
BACKENDS = ("auto", "torch", "triton")
# Read once, at import: inside a compiled graph `use_triton` then reads a constant (dynamo
# does not trace importlib, and a graph that asked would fall back to eager).
_HAS_TRITON: Final[bool] = importlib.util.find_spec("triton") is not None


def use_triton(backend: str, device: torch.device) -> bool:
    """Whether `backend` means the Triton kernels for tensors on `device`; raises
    ValueError for an unknown backend and RuntimeError for Triton where it cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return False
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "backend='triton' on CPU tensors runs the kernels under the Triton interpreter: "
            "set TRITON_INTERPRET=1 in the environment before triton is first imported"
        )
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"the Triton kernels run on CUDA or CPU, not {device.type}")
    if not _HAS_TRITON:
        if backend == "auto":  # no Triton on this platform: the torch references
            return False
        raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
    return True
