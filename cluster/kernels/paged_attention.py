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

`write_kv_ref` + `paged_attention_ref` here are the torch implementations (the CPU path
and the tests' oracle); the Triton kernels in `paged_attention_triton.py` implement the
same two functions, and `write_kv` / `paged_attention` pick one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


# Every query row attends over a key count padded (with masked keys) to a multiple of this,
# whatever else shares its step. CPU SDPA kernels sum the softmax over vector lanes with a
# scalar tail, so the rounding of a row depends on its key count modulo the vector width;
# with aligned key counts, masked keys only add exact zeros, and a row's output is the same
# alone, in a batch padded to a longer context, in a prefill chunk or in a whole prompt.
KEY_ALIGN = 16


def aligned(num_keys: int) -> int:
    return -(-num_keys // KEY_ALIGN) * KEY_ALIGN


# Sequences with at most this many new tokens share one padded attention call (decode,
# verification, short prompts); longer ones (prefill chunks) run one by one.
MAX_BATCHED_QUERY_LEN = 16
# With draft trees in the step: a tree's tokens (root and nodes) all fit in one int64 mask.
MAX_TREE_TOKENS = 64


def tree_visible(
    bits: torch.Tensor,  # [..., q] int64 per query: which new tokens it may see
    key_index: torch.Tensor,  # [..., k] key position minus the step's first new position
) -> torch.Tensor:
    """[..., q, k] bool: keys before the step, or new tokens whose bit is set."""
    shift = key_index.clamp(0, MAX_TREE_TOKENS - 1)[..., None, :]
    bit = torch.bitwise_right_shift(bits[..., :, None], shift) & 1
    return (key_index[..., None, :] < 0) | (bit == 1)


# A decode batch whose padded contexts hold more keys than this is split into groups of
# similar context length (each at most twice its shortest), so short sequences are not
# padded to the longest one: decode attention on a CPU is bound by the keys it gathers.
SINGLE_GROUP_KEYS = 32768


@dataclass
class BatchedGroup:
    """Sequences with few new tokens that share one padded SDPA call: their queries padded
    to `max_q` rows and their contexts to `max_len` keys."""

    query_rows: torch.Tensor  # [n, max_q] token row of each query (padding: row 0)
    out_rows: torch.Tensor  # [n * max_q] where each result goes (padding: num_tokens)
    key_slots: torch.Tensor  # [n * max_len] cache slot of each key (padding: a real one)
    mask: torch.Tensor  # [n, 1, max_q, max_len] keys each query may see


@dataclass
class AttentionPlan:
    """What `paged_attention_ref` derives from the step's metadata alone, computed once per
    step and shared by every layer (the layers differ only in their caches)."""

    long: list[int]  # sequences run one by one
    groups: list[BatchedGroup]
    # One group, every sequence has one new token, in batch order: rows need no gathering
    # or scattering.
    one_token_each: bool = False


def _length_groups(batched: list[int], seq_lens: list[int]) -> list[list[int]]:
    """`batched` split into groups of similar context length (longest first), or one
    group when padding them all to the longest is cheap anyway."""
    by_length = sorted(batched, key=lambda i: -seq_lens[i])
    if len(batched) * seq_lens[by_length[0]] <= SINGLE_GROUP_KEYS:
        return [batched]
    groups: list[list[int]] = [[]]
    for i in by_length:
        if groups[-1] and 2 * seq_lens[i] < seq_lens[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    return groups


def plan_paged_attention(
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    block_size: int,
    tree_bits: torch.Tensor | None = None,  # [num_tokens] int64, see the module docstring
    tree_starts: list[int] | None = None,  # [num_seqs], default: each first new token
) -> AttentionPlan:
    num_seqs = len(seq_lens)
    query_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(num_seqs)]
    limit = MAX_BATCHED_QUERY_LEN if tree_bits is None else MAX_TREE_TOKENS
    batched = [i for i in range(num_seqs) if 0 < query_lens[i] <= limit]
    long = [i for i in range(num_seqs) if query_lens[i] > limit]
    if not batched:
        return AttentionPlan(long, [])
    groups = []
    for group in _length_groups(batched, seq_lens):
        groups.append(
            _plan_group(
                group, block_tables, seq_lens, query_start_loc, block_size, tree_bits, tree_starts
            )
        )
    one_token_each = (
        len(groups) == 1
        and groups[0].query_rows.shape[1] == 1
        and len(batched) == num_seqs == query_start_loc[-1]
    )
    return AttentionPlan(long, groups, one_token_each)


def _plan_group(
    batched: list[int],
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    block_size: int,
    tree_bits: torch.Tensor | None,
    tree_starts: list[int] | None,
) -> BatchedGroup:
    device = block_tables.device
    num_tokens = query_start_loc[-1]
    query_lens = [b - a for a, b in itertools.pairwise(query_start_loc)]
    max_q = max(query_lens[i] for i in batched)
    max_blocks = -(-max(seq_lens[i] for i in batched) // block_size)
    max_len = aligned(max_blocks * block_size)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    starts, q_lens, lens = (
        ints([values[i] for i in batched]) for values in (query_start_loc, query_lens, seq_lens)
    )
    j = torch.arange(max_q, device=device)
    is_query = j[None, :] < q_lens[:, None]  # [n, max_q]
    query_rows = torch.where(is_query, starts[:, None] + j[None, :], 0)
    out_rows = torch.where(is_query, starts[:, None] + j[None, :], num_tokens).flatten()
    pos = torch.arange(max_len, device=device)  # [max_len]
    tables = block_tables[batched, :max_blocks].long()
    block = (pos // block_size).clamp(max=max_blocks - 1)  # past the last block: masked keys
    slots = tables[:, block] * block_size + pos % block_size  # [n, max_len]
    in_context = pos[None, :] < lens[:, None]
    key_slots = torch.where(in_context, slots, slots[:, :1])  # never read a stale slot
    query_pos = lens[:, None] - q_lens[:, None] + j[None, :]  # [n, max_q]
    mask = (pos[None, None, :] <= query_pos[:, :, None]) & in_context[:, None, :]
    if tree_bits is not None:
        bits = torch.where(is_query, tree_bits[query_rows], -1)  # [n, max_q]
        first = lens - q_lens if tree_starts is None else ints([tree_starts[i] for i in batched])
        mask &= tree_visible(bits, pos[None, :] - first[:, None])
    return BatchedGroup(query_rows, out_rows, key_slots.flatten(), mask[:, None])


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[aligned(seq_len), kv_heads, head_dim] of one sequence, gathered from its blocks;
    zeros past `seq_len` (callers mask them; a stale slot could hold NaN)."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    context = cache[block_table[:num_blocks]].flatten(0, 1)[:seq_len]
    return torch.cat([context, context.new_zeros(aligned(seq_len) - seq_len, *context.shape[1:])])


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

    Sequences with few new tokens (decode, verification of drafts) share one padded SDPA
    call; longer ones (prefill chunks) go one by one. `plan` (from `plan_paged_attention`)
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
    for i in plan.long:
        start, end = query_start_loc[i], query_start_loc[i + 1]
        seq_k = _gather_context(k_cache, block_tables[i], seq_lens[i])
        seq_v = _gather_context(v_cache, block_tables[i], seq_lens[i])
        out[start:end] = causal_attention(q[start:end], seq_k, seq_v, scale, seq_lens[i])
    return out[:num_tokens]


def _attend_group(
    queries: torch.Tensor,  # [n, max_q, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: BatchedGroup,
    scale: float,
) -> torch.Tensor:
    """[n, max_q, heads, head_dim]: one padded SDPA call over the group's contexts."""
    n = group.query_rows.shape[0]
    kv_shape = (n, -1, *k_cache.shape[2:])  # [n, max_len, kv_heads, head_dim]
    keys = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, group.key_slots)
    values = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, group.key_slots)
    return F.scaled_dot_product_attention(
        queries.transpose(1, 2),  # [n, heads, max_q, head_dim]
        keys.view(kv_shape).transpose(1, 2),
        values.view(kv_shape).transpose(1, 2),
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=True,
    ).transpose(1, 2)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    context_len: int | None = None,
) -> torch.Tensor:
    """One sequence: q [n_q, heads, d] are the last n_q positions of a context of
    `context_len` keys (default: all of k, v [n_k, kv_heads, d]; keys past it are masked)."""
    n_q, n_k = q.shape[0], k.shape[0]
    context_len = n_k if context_len is None else context_len
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, n, d]
    if n_q == n_k == context_len:  # the whole sequence is new: plain causal attention
        mask, causal = None, True
    else:  # query j sits at context position context_len - n_q + j and sees keys up to it
        key_pos = torch.arange(n_k, device=q.device)
        query_pos = torch.arange(context_len - n_q, context_len, device=q.device)
        mask, causal = key_pos[None, :] <= query_pos[:, None], False
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
