"""N-gram prompt lookup: drafts copy what followed the latest earlier occurrence of the
context's last n tokens (no weights, no KV, no probabilities)."""

from __future__ import annotations

from typing import Any, ClassVar

from cluster.config.draft_registry import DraftKV, DraftMethod, DraftSource
from cluster.config.speculative import SpeculativeConfig
from cluster.spec_decode.ngram import NgramProposer


class Ngram(DraftMethod):
    name = "ngram"
    aliases = ("[ngram]",)  # vLLM's
    draft_source: ClassVar[DraftSource] = "none"
    kv_cache: ClassVar[DraftKV] = "none"

    def make_proposer(
        self,
        spec: SpeculativeConfig,
        draft: Any,
        kv_cache: Any,
        block_size: int,
        compile_options: Any,
    ) -> NgramProposer:
        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
