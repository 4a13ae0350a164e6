"""The paged KV cache tensors of one worker, and attention over them.

Per attention layer, keys and values are `[num_blocks, block_size, num_kv_heads, head_dim]`
(this rank's KV heads; a draft head's layers follow the target's and may have their own
head geometry). A pipeline stage holds only its own layers, from `first_layer_idx` on. Block ids come from the engine core's `KVBlockManager`;
`AttentionMetadata.slot_mapping` and `block_tables` say where this step's tokens go and
where each sequence's context lives.
"""

from __future__ import annotations

import torch

from cluster.kernels.backend import use_triton
from cluster.kernels.paged_attention import (
    paged_attention,
    paged_attention_ref,
    plan_paged_attention,
    write_kv,
    write_kv_ref,
)
from cluster.models.attention import AttentionMetadata

LayerShape = tuple[int, int]  # (num_kv_heads, head_dim) of one attention layer


class PagedKVCache:
    def __init__(
        self,
        layer_shapes: list[LayerShape],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        first_layer_idx: int = 0,
    ) -> None:
        self.block_size = block_size
        self.dtype = dtype
        # A later pipeline stage's first layer: layer `first_layer_idx + i` uses tensor i.
        self.first_layer_idx = first_layer_idx
        self.backend = backend
        shapes = [(num_blocks, block_size, heads, dim) for heads, dim in layer_shapes]
        self.k = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
        self.v = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
        # The kernels are chosen once: "auto" is Triton on CUDA, torch elsewhere.
        self.use_triton = use_triton(backend, torch.device(device))

    @staticmethod
    def bytes_per_block(layer_shapes: list[LayerShape], block_size: int, dtype: torch.dtype) -> int:
        return sum(2 * block_size * heads * dim * dtype.itemsize for heads, dim in layer_shapes)

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
        index = layer_idx - self.first_layer_idx
        k_cache, v_cache = self.k[index], self.v[index]
        if self.use_triton:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend="triton")
            return paged_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                scale,
                backend="triton",
            )
        plan = meta.derived.get("attention_plan")  # index tensors shared by every layer
        if plan is None:
            plan = meta.derived["attention_plan"] = plan_paged_attention(
                meta.block_tables, meta.seq_lens, meta.query_start_loc, self.block_size
            )
        write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_ref(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, plan
        )
