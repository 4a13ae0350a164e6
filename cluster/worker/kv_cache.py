"""The paged KV cache tensors of one worker, and attention over them.

Per attention layer, keys and values are `[num_blocks, block_size, num_kv_heads, head_dim]`
(this rank's KV heads; a draft head's layers follow the target's and may have their own
head geometry). A pipeline stage holds only its own layers. Block ids come from the engine
core's `KVBlockManager`; `AttentionMetadata.slot_mapping` and `block_tables` say where this
step's tokens go and where each sequence's context lives.
"""

from __future__ import annotations

import torch

from cluster.kernels import cpu_attention
from cluster.kernels.backend import use_triton
from cluster.kernels.paged_attention import (
    paged_attention,
    paged_attention_ref,
    plan_paged_attention,
    write_kv,
    write_kv_ref,
)
from cluster.models.attention import AttentionMetadata, KVShape

LayerShape = KVShape | tuple[int, int]  # (num_kv_heads, head_dim[, values_are_keys])
# Layer index -> shape; a list numbers its layers from 0.
LayerShapes = dict[int, LayerShape] | list[LayerShape]


class PagedKVCache:
    def __init__(
        self,
        layer_shapes: LayerShapes,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        backend: str = "auto",
    ) -> None:
        self.block_size = block_size
        self.dtype = dtype
        shapes = _by_layer(layer_shapes)
        # Attention layers need not be consecutive (hybrid models interleave recurrent ones).
        self.index = {layer_idx: i for i, layer_idx in enumerate(shapes)}
        self.backend = backend
        self.k, self.v = [], []
        for shape in shapes.values():
            size = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
            self.k.append(torch.zeros(size, dtype=dtype, device=device))
            # (MLA: the same tensor; a step writes the same vectors to both)
            self.v.append(self.k[-1] if shape.values_are_keys else torch.zeros_like(self.k[-1]))
        # The kernels are chosen once: "auto" is Triton on CUDA and the C kernel on a CPU
        # (`cluster.kernels.cpu_attention`, where it builds), "torch" the torch reference.
        self.use_triton = use_triton(backend, torch.device(device))
        self.use_cpu_kernel = backend == "auto" and torch.device(device).type == "cpu"

    @staticmethod
    def bytes_per_block(layer_shapes: LayerShapes, block_size: int, dtype: torch.dtype) -> int:
        return sum(
            (1 if s.values_are_keys else 2)
            * block_size
            * s.num_kv_heads
            * s.head_dim
            * dtype.itemsize
            for s in _by_layer(layer_shapes).values()
        )

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
        index = self.index[layer_idx]
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
                tree_bits=meta.tree_bits,
                tree_starts=meta.tree_starts,
            )
        if self.use_cpu_kernel and cpu_attention.supports(q, k_cache):
            pieces = meta.cached(  # per-piece metadata shared by every layer
                "cpu_attention_pieces",
                lambda: cpu_attention.plan_pieces(
                    meta.block_tables,
                    meta.seq_lens,
                    meta.query_start_loc,
                    meta.tree_bits,
                    meta.tree_starts,
                ),
            )
            if not cpu_attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping):
                write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
            return cpu_attention.paged_attention_cpu(q, k_cache, v_cache, pieces, scale)
        plan = meta.cached(  # index tensors shared by every layer
            "attention_plan",
            lambda: plan_paged_attention(
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                self.block_size,
                meta.tree_bits,
                meta.tree_starts,
            ),
        )
        write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention_ref(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, plan
        )

    def copy_slots(self, copies: list[list[int]], layer_ids: set[int]) -> None:
        """Move KV from `src` to `dst` slots ([src, dst] pairs) in the layers named; every
        source is read before any destination is written."""
        if not copies:
            return
        device = self.k[0].device
        src, dst = torch.tensor(copies, dtype=torch.int64, device=device).T
        for layer_idx, i in self.index.items():
            if layer_idx not in layer_ids:
                continue
            for cache in {id(t): t for t in (self.k[i], self.v[i])}.values():
                flat = cache.view(-1, *cache.shape[2:])
                flat.index_copy_(0, dst, flat.index_select(0, src))


def _by_layer(shapes: LayerShapes) -> dict[int, KVShape]:
    if isinstance(shapes, list):
        shapes = dict(enumerate(shapes))
    return {i: s if isinstance(s, KVShape) else KVShape(*s) for i, s in sorted(shapes.items())}
