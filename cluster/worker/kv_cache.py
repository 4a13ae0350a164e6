"""The paged KV cache tensors of one worker, and attention over them.

Per layer, keys and values are `[num_blocks, block_size, num_kv_heads, head_dim]`
(this rank's KV heads). Block ids come from the engine core's `KVBlockManager`;
`AttentionMetadata.slot_mapping` and `block_tables` say where this step's tokens go
and where each sequence's context lives.
"""

from __future__ import annotations

import torch

from cluster.kernels.paged_attention import paged_attention, write_kv
from cluster.models.attention import AttentionMetadata


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        backend: str = "auto",
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.backend = backend
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [num_tokens, heads, head_dim]
        k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if meta.slot_mapping is None or meta.block_tables is None:
            raise ValueError("PagedKVCache needs AttentionMetadata.slot_mapping and block_tables")
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=self.backend)
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            backend=self.backend,
        )
