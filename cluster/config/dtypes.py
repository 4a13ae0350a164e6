"""What `dtype="auto"` means, resolved as vLLM resolves it.

- A checkpoint saved in a 16-bit type runs in that type; one saved in float32 runs in
  bfloat16 (the common practice: the weights lose nothing a user would notice, and every
  matrix product runs on the 16-bit units).
- On a CPU, float16 becomes bfloat16 (CPUs compute float16 products slowly), and
  bfloat16 needs the CPU's bfloat16 matrix instructions (x86 AVX-512 BF16 or AMX tiles,
  Arm's BF16 extension); a CPU without them runs float32, with one log line.

An explicit `dtype` ("float32", "bfloat16", "float16") is always taken as given.
"""

from __future__ import annotations

import functools
import logging
import platform
from typing import Any

import torch

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# /proc/cpuinfo flags that mean bfloat16 matrix instructions.
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU computes bfloat16 matrix products in hardware (checked once, and
    logged once, per process)."""
    flags = _cpu_flags()
    found = sorted(flags.intersection(_BF16_CPU_FLAGS))
    if not flags and platform.system() == "Darwin":
        found = ["apple"] if platform.machine() == "arm64" else []
    if found:
        logger.info("CPU has bfloat16 matrix instructions (%s): dtype=auto is bfloat16", found)
    else:
        logger.warning(
            "this CPU has no bfloat16 matrix instructions: dtype=auto runs float32 here "
            "(dtype=bfloat16 runs our AVX2 bfloat16 kernel where the CPU has AVX2)"
        )
    return bool(found)


def checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    """The dtype a transformers config says its weights were saved in, if it says."""
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = DTYPES.get(saved.removeprefix("torch."))
    return saved if isinstance(saved, torch.dtype) else None


def resolve_dtype(name: str, hf_config: Any, device: str) -> torch.dtype:
    """The compute dtype for `name` ("auto" or an explicit dtype) on `device`."""
    if name != "auto":
        return DTYPES[name]
    saved = checkpoint_dtype(hf_config)
    if device == "cpu":
        return torch.bfloat16 if cpu_has_bf16_matmul() else torch.float32
    return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16
