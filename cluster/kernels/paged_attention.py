"""`write_kv` and `paged_attention`: the paged KV cache's two operations, as Triton or
torch (layout and semantics in `paged_attention_ref.py`)."""

from __future__ import annotations

import torch

from cluster.kernels.backend import use_triton
from cluster.kernels.paged_attention_ref import AttentionPlan, paged_attention_ref, write_kv_ref


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Store this step's keys and values in their slots ("auto": Triton on CUDA)."""
    if use_triton(backend, k.device):
        from cluster.kernels.paged_attention_triton import write_kv_triton

        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    scale: float,
    backend: str = "auto",
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """[num_tokens, heads, head_dim] attention over the paged cache ("auto": Triton on CUDA).
    `plan`: the torch path's per-step index tensors, shared across layers."""
    if use_triton(backend, q.device):
        from cluster.kernels.paged_attention_triton import paged_attention_triton

        device = q.device
        query_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(seq_lens))]
        return paged_attention_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            torch.tensor(seq_lens, dtype=torch.int32, device=device),
            torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            scale,
            max(query_lens, default=0),
        )
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, plan
    )
