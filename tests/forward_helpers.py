"""Running models as the tests' oracles do: on whole sequences computed from scratch (no
KV cache), or through the simplest KV cache; the step's metadata goes through
`attention_context`."""

from __future__ import annotations

from typing import Any

import torch

from cluster.models.attention import (
    AttentionMetadata,
    attention_context,
    attention_per_sequence,
)


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


class ContiguousKVCache:
    """Per layer, keys and values as `[num_slots, max_len, kv_heads, head_dim]`; sequence i
    of every step lives in row `cache_slots[i]` (the simplest cache, for model tests)."""

    def __init__(
        self,
        num_layers: int,
        cache_slots: list[int],
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.cache_slots = cache_slots
        shape = (max(cache_slots) + 1, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        counts = torch.tensor(meta.query_lens())
        token_slots = torch.repeat_interleave(torch.tensor(self.cache_slots), counts)
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        k_cache[token_slots.to(k.device), meta.positions] = k
        v_cache[token_slots.to(k.device), meta.positions] = v

        def context(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            slot, length = self.cache_slots[i], meta.seq_lens[i]
            return k_cache[slot, :length], v_cache[slot, :length]

        return attention_per_sequence(q, meta, scale, context)


def store_in_parts(directory: str, samples: list, part_size: int) -> str:
    """An answer store holding `samples` in parts of `part_size`; returns its folder."""
    from cluster.train.answer_store import AnswerStore, chat_key

    store = AnswerStore(directory)
    for start in range(0, len(samples), part_size):
        part = samples[start : start + part_size]
        store.append(part, [chat_key(start + i) for i in range(len(part))])
    return directory
