"""`TrainInputs`: what `cluster train-draft` hands a draft method's trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cluster.train.train_config import TrainConfig


@dataclass(frozen=True)
class TrainInputs:
    target_config: Any  # the target's transformers config
    embed_weight: torch.Tensor  # [vocab, hidden] the target's embedding
    head_weight: torch.Tensor  # [vocab, hidden] the target's LM head (= embedding when tied)
    final_norm_weight: torch.Tensor  # [hidden] the target's final norm
    train_dirs: list[str]  # feature folders (`feature_store`)
    eval_dirs: list[str]
    out_dir: str  # where the head is exported
    config: TrainConfig
    checkpoint_dir: str  # this head's training checkpoints
    resume: bool


def chain_head_arguments(data: TrainInputs) -> tuple[Any, ...]:
    """`data` as `train_chain_head`'s arguments after the method."""
    return (
        data.target_config, data.embed_weight, data.head_weight, data.final_norm_weight,
        data.train_dirs, data.eval_dirs, data.out_dir, data.config, data.checkpoint_dir,
        data.resume,
    )  # fmt: skip
