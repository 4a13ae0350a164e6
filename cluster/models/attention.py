"""Attention over flattened sequences, with a small KV-cache interface.

A batch is the concatenation of several sequences' new tokens (no padding).
`AttentionMetadata.query_start_loc` marks where each sequence's tokens start and
`seq_lens` gives each sequence's full context length after this step. The KV
cache is behind `KVCache` (write this step's keys/values, read a sequence's
context); `ContiguousKVCache` keeps one contiguous row per sequence slot. The
engine's paged cache implements the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class KVCache(Protocol):
    def write(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None: ...

    def read(
        self, layer_idx: int, seq_idx: int, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]  # [num_seqs + 1] prefix sums of new tokens per sequence
    seq_lens: list[int]  # [num_seqs] context length (cached + new) per sequence
    positions: torch.Tensor  # [num_tokens] position of every new token
    kv_cache: KVCache | None = None
    cache_slots: list[int] | None = None  # [num_seqs] cache row of each sequence (contiguous cache)

    @staticmethod
    def for_prefill(seq_lens: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for whole sequences computed from scratch (no cache)."""
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        positions = torch.cat([torch.arange(n) for n in seq_lens]).to(device)
        return AttentionMetadata(starts, list(seq_lens), positions)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class ContiguousKVCache:
    """Per layer, keys and values as `[num_slots, max_len, kv_heads, head_dim]`."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_slots, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def _token_slots(self, meta: AttentionMetadata) -> torch.Tensor:
        if meta.cache_slots is None:
            raise ValueError("ContiguousKVCache needs AttentionMetadata.cache_slots")
        counts = torch.tensor(
            [meta.query_start_loc[i + 1] - meta.query_start_loc[i] for i in range(meta.num_seqs)]
        )
        return torch.repeat_interleave(torch.tensor(meta.cache_slots), counts).to(
            meta.positions.device
        )

    def write(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        slots = self._token_slots(meta)
        self.k[layer_idx][slots, meta.positions] = k
        self.v[layer_idx][slots, meta.positions] = v

    def read(
        self, layer_idx: int, seq_idx: int, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert meta.cache_slots is not None
        slot, length = meta.cache_slots[seq_idx], meta.seq_lens[seq_idx]
        return self.k[layer_idx][slot, :length], self.v[layer_idx][slot, :length]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context.

    q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim] (this step's);
    returns [num_tokens, heads * head_dim].
    """
    if meta.kv_cache is not None:
        meta.kv_cache.write(layer_idx, k, v, meta)
    out = torch.empty_like(q)
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if end == start:
            continue
        if meta.kv_cache is not None:
            seq_k, seq_v = meta.kv_cache.read(layer_idx, i, meta)
        else:
            seq_k, seq_v = k[start:end], v[start:end]
        # [1, heads, n, head_dim]; grouped-query heads are matched inside SDPA (enable_gqa).
        seq_q, seq_k, seq_v = (t.transpose(0, 1)[None] for t in (q[start:end], seq_k, seq_v))
        n_q, n_k = end - start, seq_k.shape[2]
        if n_q == n_k:  # the whole sequence is new: plain causal attention
            mask, causal = None, True
        else:  # query j sits at context position n_k - n_q + j and sees keys up to it
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
            causal = False
        o = F.scaled_dot_product_attention(
            seq_q, seq_k, seq_v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        out[start:end] = o[0].transpose(0, 1)
    return out.reshape(q.shape[0], -1)
