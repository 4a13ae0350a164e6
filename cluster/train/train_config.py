"""`TrainConfig`: a draft head's training settings (frozen), where it trains, in what
precision, and which settings a resumed run may change."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any

import torch

from cluster.config.dtypes import cpu_has_bf16_matmul


@dataclass(frozen=True)
class TrainConfig:
    draft_vocab_size: int = 4096  # EAGLE-3 only
    ttt_steps: int = 3
    epochs: int = 2
    lr: float = 1e-3
    batch_tokens: int = 4096
    seed: int = 0
    step_weight: float = 0.8
    freeze_lm_head: bool = False  # EAGLE-3: keep the target's LM head rows as they are
    compile: bool = False  # EAGLE-3: the step's forward under torch.compile (dynamic shapes)
    eval_every_tokens: int = 0  # > 0: also measure held-out accuracy every this many
    # trained answer tokens (the curve of accuracy against data in the history)
    regression_weight: float = 1.0  # EAGLE-1: smooth-L1 feature regression
    token_weight: float = 0.1  # EAGLE-1: token cross-entropy
    device: str = "auto"  # "auto": CUDA when available, else the CPU
    precision: str = "auto"  # "bfloat16" autocast, "float32", or "auto": bfloat16 where
    # the device computes it in hardware (CUDA; CPUs with AVX-512 BF16, AMX or Arm BF16)
    checkpoint_every: int = 200  # optimiser steps between checkpoints (and every epoch end)

    # settings a resumed run may change: they do not change what is computed
    RESUMABLE_CHANGES = ("eval_every_tokens", "checkpoint_every", "device")

    def __post_init__(self) -> None:
        if self.precision not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"precision must be auto, bfloat16 or float32, not {self.precision!r}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def autocast_bf16(self) -> bool:
        if self.precision != "auto":
            return self.precision == "bfloat16"
        if self.torch_device.type == "cuda":
            return torch.cuda.is_bf16_supported()
        return cpu_has_bf16_matmul()

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's precision context (bfloat16 autocast, or nothing)."""
        if not self.autocast_bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.torch_device.type, dtype=torch.bfloat16)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed under this config."""
        return {k: v for k, v in asdict(self).items() if k not in self.RESUMABLE_CHANGES}
