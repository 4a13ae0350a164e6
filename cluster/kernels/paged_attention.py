"""Attention over a paged KV cache for a batch mixing prefill chunks and decode tokens.

Layout:
- `k_cache`, `v_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`, one pair per layer;
- `slot_mapping[t] = block * block_size + offset`: where new token t's key/value go;
- `block_tables[i, j]`: the j-th block of sequence i (padded with 0 past its last block);
- `seq_lens[i]`: sequence i's context length after this step (cached + new tokens);
- `query_start_loc[i]`: where sequence i's new tokens start in the flattened batch.
New token j of sequence i sits at position `seq_lens[i] - q_len_i + j` and attends to every
key at or before it. Grouped-query heads: query head h reads KV head `h // (H // KVH)`.

`write_kv` + `paged_attention` here are the torch implementations (the CPU path and the
tests' oracle); the Triton kernels in `paged_attention_triton.py` implement the same two
functions, and `backend` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def write_kv_ref(
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int
) -> None:
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0  # a negative slot means "do not store this token"
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, kv_heads, head_dim] of one sequence, gathered from its blocks."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:seq_len]


@dataclass
class AttentionPlan:
    """What `paged_attention_ref` derives from the step's metadata alone, computed once per
    step and shared by every layer (the layers differ only in their caches)."""

    multi: list[int]  # sequences with several new tokens (prefill chunks, verification)
    rows: torch.Tensor | None  # [n] the query row of each single-token (decode) sequence
    tables: torch.Tensor | None  # [n, max_blocks] their block tables
    invalid: torch.Tensor | None  # [n, max_len, 1, 1] slots past each context
    mask: torch.Tensor | None  # [n, 1, 1, max_len] keys each query may see


def plan_paged_attention(
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    block_size: int,
) -> AttentionPlan:
    device = block_tables.device
    num_seqs = len(seq_lens)
    query_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(num_seqs)]
    single = [i for i in range(num_seqs) if query_lens[i] == 1]
    multi = [i for i in range(num_seqs) if query_lens[i] > 1]
    if not single:
        return AttentionPlan(multi, None, None, None, None)
    rows = torch.tensor([query_start_loc[i] for i in single], device=device)
    lens = torch.tensor([seq_lens[i] for i in single], device=device)
    max_blocks = -(-max(seq_lens[i] for i in single) // block_size)
    tables = block_tables[single, :max_blocks]
    positions = torch.arange(max_blocks * block_size, device=device)
    valid = positions[None, :] < lens[:, None]  # [n, max_len]
    return AttentionPlan(multi, rows, tables, ~valid[:, :, None, None], valid[:, None, None, :])


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    seq_lens: list[int],
    query_start_loc: list[int],
    scale: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Returns [num_tokens, heads, head_dim].

    Sequences whose new tokens are all decode tokens (one query each) are batched into one
    padded SDPA call; the others (prefill chunks, verification of draft tokens) go one by one.
    `plan` (from `plan_paged_attention`) saves recomputing the index tensors per layer.
    """
    if plan is None:
        plan = plan_paged_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    out = torch.empty_like(q)
    if plan.rows is not None:
        # [n, max_blocks * block_size, kv_heads, head_dim]: every context, padded
        keys = k_cache[plan.tables].flatten(1, 2)
        values = v_cache[plan.tables].flatten(1, 2)
        # Slots past a context may hold anything (even NaN): zero them, then mask them out.
        keys = keys.masked_fill(plan.invalid, 0)
        values = values.masked_fill(plan.invalid, 0)
        o = F.scaled_dot_product_attention(
            q[plan.rows][:, :, None],  # [n, heads, 1, head_dim]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=plan.mask,
            scale=scale,
            enable_gqa=True,
        )
        out[plan.rows] = o[:, :, 0]
    for i in plan.multi:
        start, end = query_start_loc[i], query_start_loc[i + 1]
        seq_k = _gather_context(k_cache, block_tables[i], seq_lens[i])
        seq_v = _gather_context(v_cache, block_tables[i], seq_lens[i])
        out[start:end] = causal_attention(q[start:end], seq_k, seq_v, scale)
    return out


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence: q [n_q, heads, d] are the last n_q positions of k, v [n_k, kv_heads, d]."""
    n_q, n_k = q.shape[0], k.shape[0]
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, n, d]
    if n_q == n_k:  # the whole sequence is new: plain causal attention
        mask, causal = None, True
    else:  # query j sits at context position n_k - n_q + j and sees keys up to it
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
        causal = False
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )
    return o[0].transpose(0, 1)


def use_triton(backend: str, x: torch.Tensor) -> bool:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    return backend == "triton" or (backend == "auto" and x.is_cuda)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Store this step's keys and values in their slots ("auto": Triton on CUDA)."""
    if use_triton(backend, k):
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
    if use_triton(backend, q):
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
