"""What the EAGLE family's methods share: a draft head loaded beside the target on the
last pipeline stage, sharing its embedding and LM head, keeping KV in the target's paged
cache (its layers are numbered after the target's), and proposing with `EagleProposer`."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from cluster.config import ModelConfig
from cluster.config.draft_registry import DraftKV, DraftMethod
from cluster.config.speculative import SpeculativeConfig
from cluster.models.attention import KVCache
from cluster.models.compiled import CompileOptions
from cluster.models.draft_base import DraftModel
from cluster.models.loader import load_draft_head
from cluster.parallel import ParallelState
from cluster.spec_decode.eagle import EagleProposer
from cluster.spec_decode.tree_drafting import TreeShape


class DraftHeadMethod(DraftMethod):
    kv_cache: ClassVar[DraftKV] = "target"
    # checkpoint kind -> the head class that loads it (the keys are the method's kinds)
    head_classes: ClassVar[dict[str, type[DraftModel]]] = {}

    def load_draft(
        self,
        spec: SpeculativeConfig,
        model_config: ModelConfig,
        target: nn.Module,
        state: ParallelState,
    ) -> DraftModel:
        path = spec.draft_path(model_config.path)
        assert path is not None
        cls = self.head_classes[spec.draft_kind_for(model_config.path)]
        return load_draft_head(cls, path, model_config, target, state)

    def make_proposer(
        self,
        spec: SpeculativeConfig,
        draft: DraftModel,
        kv_cache: KVCache,
        block_size: int,
        compile_options: CompileOptions | None,
    ) -> EagleProposer:
        return EagleProposer(
            draft, kv_cache, block_size, spec.num_speculative_tokens,
            spec.draft_sampling == "sample", compile_options, TreeShape.of(spec),
            spec.min_draft_confidence,
        )  # fmt: skip


def check_hidden_size(draft_config: dict[str, Any], target_config: Any) -> None:
    """A head reading the target's hidden states has the target's hidden size."""
    hidden = int(target_config.hidden_size)
    if int(draft_config["hidden_size"]) != hidden:
        raise ValueError(
            f"the draft's hidden_size={draft_config['hidden_size']} differs from the target's "
            f"hidden_size={hidden}"
        )
    if int(draft_config.get("target_hidden_size") or hidden) != hidden:
        raise ValueError(
            f"the draft expects target_hidden_size={draft_config['target_hidden_size']}, the "
            f"target has {hidden}"
        )


def check_same_vocabulary(draft_config: dict[str, Any], target_config: Any) -> None:
    """A draft emitting target token ids has the target's vocabulary."""
    vocab = int(target_config.vocab_size)
    if int(draft_config["vocab_size"]) != vocab:
        raise ValueError(
            f"the draft's vocab_size={draft_config['vocab_size']} differs from the target's "
            f"vocab_size={vocab} (the draft must share the target's tokenizer)"
        )
