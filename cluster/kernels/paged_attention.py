"""Attention over a paged KV cache for a batch mixing prefill chunks and decode tokens.

Layout:
- `k_cache`, `v_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`, one pair per layer;
- `slot_mapping[t] = block * block_size + offset`: where new token t's key/value go;
- `block_tables[i, j]`: the j-th block of sequence i (padded with 0 past its last block);
- `seq_lens[i]`: sequence i's context length after this step (cached + new tokens);
- `query_start_loc[i]`: where sequence i's new tokens start in the flattened batch.
New token j of sequence i sits at position `seq_lens[i] - q_len_i + j` and attends to every
key at or before it. Grouped-query heads: query head h reads KV head `h // (H // KVH)`.

Draft trees (`cluster.draft_tree`): `tree_bits[t]` (int64, one per new token) says
which keys from its sequence's `tree_starts[i]` on token t may see: bit m for the key at
`tree_starts[i] + m` (by default `tree_starts[i]` is the first new token). Keys before
that are always visible, and causality still holds, so -1 (every bit) is plain causal
attention; a tree's root and nodes carry their ancestor masks (at most 64 keys).

How a step's queries are cut into pieces and batched is `attention_plan.py`.
`write_kv_ref` + `paged_attention_ref` here are the torch implementations (the tests'
oracle, and the CPU path where the C kernel `cpu_attention.c` is not built or asked
for); the Triton kernels in `paged_attention_triton.py` implement the
same two functions, and `write_kv` / `paged_attention` pick one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cluster.kernels.attention_plan import AttentionPlan, BatchedGroup, plan_paged_attention
from cluster.kernels.backend import use_triton


def write_kv_ref(
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, every entry >= 0
) -> None:
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    seq_lens: list[int],
    query_start_loc: list[int],
    scale: float,
    plan: AttentionPlan | None = None,
    tree_bits: torch.Tensor | None = None,
    tree_starts: list[int] | None = None,
) -> torch.Tensor:
    """Returns [num_tokens, heads, head_dim].

    Every sequence's new tokens are attended in pieces of at most PIECE_LEN, pieces of
    similar context length together (`_attend_group`). `plan` (from `plan_paged_attention`)
    saves recomputing the index tensors per layer; it carries the tree masks, so
    `tree_bits` is read only when no plan is given.
    """
    if plan is None:
        plan = plan_paged_attention(
            block_tables, seq_lens, query_start_loc, k_cache.shape[1], tree_bits, tree_starts
        )
    num_tokens = q.shape[0]
    if plan.one_token_each:  # decode in batch order: no gathering or scattering
        return _attend_group(q[:, None], k_cache, v_cache, plan.groups[0], scale).reshape(q.shape)
    out = q.new_empty(num_tokens + 1, *q.shape[1:])  # the last row takes the padding
    for group in plan.groups:
        o = _attend_group(q[group.query_rows], k_cache, v_cache, group, scale)
        out.index_copy_(0, group.out_rows, o.flatten(0, 1))
    return out[:num_tokens]


def _attend_group(
    queries: torch.Tensor,  # [n, max_q, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: BatchedGroup,
    scale: float,
) -> torch.Tensor:
    """[n, max_q, heads, head_dim]: the group's queries over their padded contexts.

    Two batched products and a softmax (`_weighted_values_cpu` on CPU), the query heads
    that share a KV head stacked as rows of one product (no KV head is repeated). On a CPU this is several
    times faster than SDPA's flash kernel for a few queries per sequence (that kernel
    spends ~8 ms per layer on 16 one-token sequences over 128 keys, here ~0.6 ms), and
    each row's result is independent of the group's size and padded length."""
    n, max_q, heads, head_dim = queries.shape
    kv_heads = k_cache.shape[2]
    group_size = heads // kv_heads
    keys = k_cache.view(-1, kv_heads, head_dim).index_select(0, group.key_slots)
    values = v_cache.view(-1, kv_heads, head_dim).index_select(0, group.key_slots)
    max_len = keys.shape[0] // n
    # [n, kv_heads, max_q * group_size, head_dim]: row (j, g) is query j's head kv * G + g
    q = queries.view(n, max_q, kv_heads, group_size, head_dim).permute(0, 2, 1, 3, 4)
    q = q.reshape(n, kv_heads, max_q * group_size, head_dim)
    keys = keys.view(n, max_len, kv_heads, head_dim).permute(0, 2, 3, 1)  # [n, kvh, d, len]
    scores = torch.matmul(q, keys)  # [n, kv_heads, max_q * G, max_len]
    scores = group.score_bias(group_size).add(scores, alpha=scale)  # float32, masked: -inf
    values = values.view(n, max_len, kv_heads, head_dim).transpose(1, 2)  # [n, kvh, len, d]
    if values.device.type == "cpu":
        out = _weighted_values_cpu(scores, values)
    else:
        out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
    out = out.view(n, kv_heads, max_q, group_size, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(n, max_q, heads, head_dim)


def _weighted_values_cpu(
    scores: torch.Tensor,  # [n, kv_heads, rows, len] float32, masked keys -inf
    values: torch.Tensor,  # [n, kv_heads, len, head_dim]
) -> torch.Tensor:
    """[n, kv_heads, rows, head_dim]: softmax(scores) @ values, rounded alike whatever
    the group's shape. The BLAS's float32 product rounds a row differently with the row
    count and the padded length (MKL on the AMD EPYC: 1-3 rows against 4 and more, and
    a split of the key dimension that moves with the padding), and a draft tree's node
    sees its ancestors with masked siblings between them where a chain's token sees the
    same keys side by side. So the softmax and the weighted sum run in float64 and round
    once: a different summation order moves a float64 sum by ~1e-16 relative, which
    changes the rounded result only when it lies that close to a rounding boundary
    (~2^-40 per bfloat16 element)."""
    probs = torch.softmax(scores, dim=-1, dtype=torch.float64)
    return torch.matmul(probs, values.double()).to(values.dtype)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence without a cache: q [n_q, heads, d] are the last n_q positions of k, v
    [n_k, kv_heads, d]."""
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
    tree_bits: torch.Tensor | None = None,
    tree_starts: list[int] | None = None,
) -> torch.Tensor:
    """[num_tokens, heads, head_dim] attention over the paged cache ("auto": Triton on CUDA).
    `plan`: the torch path's per-step index tensors, shared across layers; `tree_bits`,
    `tree_starts`: draft-tree masks (module docstring)."""
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
            tree_bits,
            None
            if tree_starts is None
            else torch.tensor(tree_starts, dtype=torch.int32, device=device),
        )
    return paged_attention_ref(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        plan,
        tree_bits,
        tree_starts,
    )
