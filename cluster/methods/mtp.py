"""Multi-token prediction: DeepSeek-V3-style (`model.layers.{L}.eh_proj`) or Qwen3-Next-
style (`mtp.*`) modules, usually inside the target's own checkpoint, which is where the
draft is read from unless `speculative.model` says otherwise."""

from __future__ import annotations

from typing import Any, ClassVar

from cluster.config.draft_registry import DraftSource
from cluster.methods.heads import DraftHeadMethod
from cluster.models.draft_base import DraftModel
from cluster.models.mtp import DeepSeekMTP, Qwen3NextMTP
from cluster.train.inputs import TrainInputs, chain_head_arguments


class MTP(DraftHeadMethod):
    name = "mtp"
    aliases = ("deepseek_mtp", "qwen3_next_mtp")  # vLLM's names
    draft_source: ClassVar[DraftSource] = "target"
    head_classes: ClassVar[dict[str, type[DraftModel]]] = {
        "mtp_deepseek": DeepSeekMTP,
        "mtp_qwen3_next": Qwen3NextMTP,
    }
    kinds = tuple(head_classes)

    def detect(self, tensor_names: set[str], architectures: str) -> str | None:
        if any(n.startswith("mtp.") for n in tensor_names):
            return "mtp_qwen3_next"
        if any(".eh_proj." in n and n.startswith("model.layers.") for n in tensor_names):
            return "mtp_deepseek"
        return None

    def train(self, data: TrainInputs) -> dict[str, Any]:
        from cluster.train.eagle_mtp_trainer import train_chain_head

        return train_chain_head("mtp", *chain_head_arguments(data))
