"""Running models on whole sequences computed from scratch (no KV cache), as the tests'
oracles do: the step's metadata goes through `attention_context`."""

from __future__ import annotations

from typing import Any

import torch

from cluster.models.attention import AttentionMetadata, attention_context


def prefill(model: Any, ids: torch.Tensor, seq_lens: list[int], *args: Any) -> Any:
    """`model(ids, positions, *args)` for the flattened sequences of `seq_lens`."""
    meta = AttentionMetadata.for_prefill(list(seq_lens), ids.device)
    with attention_context(meta):
        return model(ids, meta.positions, *args)


def draft_prefill(draft: Any, ids: torch.Tensor, hidden: torch.Tensor, step: int) -> Any:
    """A draft head's pass `step` over one sequence `ids` ([n]) computed from scratch."""
    meta = AttentionMetadata.for_prefill([len(ids)], ids.device)
    with attention_context(meta):
        return draft(ids, hidden, meta.positions, step)
