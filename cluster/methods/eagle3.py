"""EAGLE-3: a head over three of the target's residual streams (low, middle, high layers:
captured by the model runner), with a draft vocabulary of its own mapped to target ids."""

from __future__ import annotations

from typing import Any, ClassVar

from cluster.methods.heads import DraftHeadMethod, check_hidden_size
from cluster.models.draft_base import DraftModel
from cluster.models.eagle3 import Eagle3Llama, eagle3_aux_layers
from cluster.train.inputs import TrainInputs


class Eagle3(DraftHeadMethod):
    name = "eagle3"
    head_classes: ClassVar[dict[str, type[DraftModel]]] = {"eagle3": Eagle3Llama}
    kinds = tuple(head_classes)

    def detect(self, tensor_names: set[str], architectures: str) -> str | None:
        if "Eagle3" in architectures or any(n.startswith("midlayer.") for n in tensor_names):
            return "eagle3"
        return None

    def check_target(self, kind: str, draft_config: dict[str, Any], target_config: Any) -> None:
        check_hidden_size(draft_config, target_config)
        vocab = int(target_config.vocab_size)
        if int(draft_config.get("draft_vocab_size") or vocab) > vocab:
            raise ValueError("the draft vocabulary is larger than the target's")

    def target_layers(self, target_config: Any) -> tuple[int, ...]:
        return eagle3_aux_layers(int(target_config.num_hidden_layers))

    def train(self, data: TrainInputs) -> dict[str, Any]:
        from cluster.train.trainer import train_eagle3

        return train_eagle3(
            data.target_config, data.embed_weight, data.head_weight, data.train_dirs,
            data.eval_dirs, data.out_dir, data.config, data.checkpoint_dir, data.resume,
        )  # fmt: skip
