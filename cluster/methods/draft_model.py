"""A separate small LM with the target's tokenizer: whole on the last pipeline stage
(sharded only by tensor parallelism), with a KV cache of its own that follows the
target's block table. Any checkpoint no other method recognises is a draft model."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from torch import nn

from cluster.config import ModelConfig
from cluster.config.architectures import RECURRENT_ARCHITECTURES
from cluster.config.draft_registry import DraftKV, DraftMethod
from cluster.config.speculative import SpeculativeConfig
from cluster.methods.heads import check_same_vocabulary
from cluster.models.attention import KVCache
from cluster.models.compiled import CompileOptions
from cluster.models.loader import load_model
from cluster.parallel import ParallelState
from cluster.spec_decode.draft_model import DraftModelProposer
from cluster.spec_decode.tree_drafting import TreeShape


class DraftModelMethod(DraftMethod):
    name = "draft_model"
    kv_cache: ClassVar[DraftKV] = "own"
    kinds = ("draft_model",)
    detect_last = True

    def detect(self, tensor_names: set[str], architectures: str) -> str | None:
        return "draft_model"

    def check_target(self, kind: str, draft_config: dict[str, Any], target_config: Any) -> None:
        recurrent = set(draft_config.get("architectures") or []) & set(RECURRENT_ARCHITECTURES)
        if recurrent:
            raise ValueError(
                f"the draft model is a {sorted(recurrent)[0]}, which has recurrent layers; a "
                "draft LM must be attention-only (its states are not kept per verified token)"
            )
        check_same_vocabulary(draft_config, target_config)

    def load_draft(
        self,
        spec: SpeculativeConfig,
        model_config: ModelConfig,
        target: nn.Module,
        state: ParallelState,
    ) -> nn.Module:
        assert spec.model is not None
        config = ModelConfig(path=spec.model, dtype=model_config.dtype, device=model_config.device)
        whole = dataclasses.replace(state, pp_rank=0, pp_size=1, pp_layer_partition=None)
        return load_model(config, whole, show_progress=False)

    def make_proposer(
        self,
        spec: SpeculativeConfig,
        draft: nn.Module,
        kv_cache: KVCache,
        block_size: int,
        compile_options: CompileOptions | None,
    ) -> DraftModelProposer:
        return DraftModelProposer(
            draft, kv_cache, block_size, spec.num_speculative_tokens,
            spec.draft_sampling == "sample", TreeShape.of(spec), spec.min_draft_confidence,
        )  # fmt: skip
