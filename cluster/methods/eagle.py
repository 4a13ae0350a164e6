"""EAGLE-1: a one-layer head over [embedding of the next token, the target's final hidden
state] (`fc`), or the normalised-fusion variant (`eh_proj` over two normed inputs). A
checkpoint with `fc` is EAGLE-1 whatever its `architectures` says (the public EAGLE-1
heads say `LlamaForCausalLM`)."""

from __future__ import annotations

from typing import Any, ClassVar

from cluster.methods.heads import DraftHeadMethod, check_hidden_size, check_same_vocabulary
from cluster.models.draft_base import DraftModel
from cluster.models.eagle import EagleLlama, EagleNormFusionLlama
from cluster.train.inputs import TrainInputs, chain_head_arguments


class Eagle(DraftHeadMethod):
    name = "eagle"
    head_classes: ClassVar[dict[str, type[DraftModel]]] = {
        "eagle": EagleLlama,
        "eagle_norm_fusion": EagleNormFusionLlama,
    }
    kinds = tuple(head_classes)

    def detect(self, tensor_names: set[str], architectures: str) -> str | None:
        if "eh_proj.weight" in tensor_names:
            return "eagle_norm_fusion"
        if "fc.weight" in tensor_names or "Eagle" in architectures:
            return "eagle"
        return None

    def check_target(self, kind: str, draft_config: dict[str, Any], target_config: Any) -> None:
        check_hidden_size(draft_config, target_config)
        check_same_vocabulary(draft_config, target_config)

    def train(self, data: TrainInputs) -> dict[str, Any]:
        from cluster.train.eagle_mtp_trainer import train_chain_head

        return train_chain_head("eagle", *chain_head_arguments(data))
