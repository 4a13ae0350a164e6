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

from dataclasses import dataclass, field

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
# whatever else shares its step. CPU kernels sum a softmax row over vector lanes with a
# scalar tail, so the rounding of a row depends on its key count modulo the vector width;
# with aligned key counts, masked keys only add exact zeros, and a row's output is the same
# alone, in a batch padded to a longer context, in a prefill chunk or in a whole prompt.
KEY_ALIGN = 16


def aligned(num_keys: int) -> int:
    return -(-num_keys // KEY_ALIGN) * KEY_ALIGN


# Queries are attended in pieces of at most this many consecutive new tokens of one
# sequence: decode and verification steps are one piece per sequence; a prefill chunk is
# cut into pieces, each over the context up to its last token. Every row thus runs the
# same code whatever the step holds (a token's result in a prompt equals its result in a
# later step after a prefix-cache hit).
PIECE_LEN = 16
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


# Pieces whose padded contexts hold more keys than this are split into groups of similar
# context length (each at most twice its shortest), so short ones are not padded to the
# longest one (decode attention on a CPU is bound by the keys it gathers); and no group
# gathers more keys than MAX_GROUP_KEYS at once (a long prompt's pieces).
SINGLE_GROUP_KEYS = 32768
MAX_GROUP_KEYS = 1 << 17


@dataclass(frozen=True)
class Piece:
    """Consecutive new tokens of one sequence, attended together."""

    seq: int  # which sequence (its row of the block tables)
    start: int  # its first token's row in the step
    num_queries: int
    context_len: int  # keys up to and including its last token
    tree_start: int  # the first key that tree bits describe


@dataclass
class BatchedGroup:
    """Pieces that share one padded attention call: their queries padded to `max_q` rows
    and their contexts to `max_len` keys."""

    query_rows: torch.Tensor  # [n, max_q] token row of each query (padding: row 0)
    out_rows: torch.Tensor  # [n * max_q] where each result goes (padding: num_tokens)
    key_slots: torch.Tensor  # [n * max_len] cache slot of each key (padding: a real one)
    mask: torch.Tensor  # [n, 1, max_q, max_len] keys each query may see
    # The mask as float32 scores to add (0 or -inf) for `group_size` query heads per KV head,
    # [n, 1, max_q * group_size, max_len], made by the first layer that asks (`score_bias`).
    bias: dict[int, torch.Tensor] = field(default_factory=dict)

    def score_bias(self, group_size: int) -> torch.Tensor:
        if group_size not in self.bias:
            n, _, max_q, max_len = self.mask.shape
            visible = self.mask.view(n, 1, max_q, 1, max_len).expand(-1, -1, -1, group_size, -1)
            bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
            bias.masked_fill_(~visible, -torch.inf)
            self.bias[group_size] = bias.view(n, 1, max_q * group_size, max_len)
        return self.bias[group_size]


@dataclass
class AttentionPlan:
    """What `paged_attention_ref` derives from the step's metadata alone, computed once per
    step and shared by every layer (the layers differ only in their caches)."""

    groups: list[BatchedGroup]
    # One group, every sequence has one new token, in batch order: rows need no gathering
    # or scattering.
    one_token_each: bool = False


def _pieces(
    seq_lens: list[int], query_start_loc: list[int], tree_starts: list[int] | None
) -> list[Piece]:
    """Each sequence's new tokens in pieces of at most PIECE_LEN. A draft tree may be cut
    too: its nodes come after their ancestors, so each row's mask is all it needs."""
    pieces = []
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        first_pos = seq_len - (end - start)
        tree_start = first_pos if tree_starts is None else tree_starts[i]
        for lo in range(start, end, PIECE_LEN):
            hi = min(lo + PIECE_LEN, end)
            pieces.append(Piece(i, lo, hi - lo, first_pos + hi - start, tree_start))
    return pieces


def _length_groups(pieces: list[Piece]) -> list[list[Piece]]:
    """`pieces` split into groups of similar context length (longest first), or one group
    when padding them all to the longest is cheap anyway; at most MAX_GROUP_KEYS each."""
    by_length = sorted(pieces, key=lambda p: -p.context_len)
    if len(pieces) * aligned(by_length[0].context_len) <= SINGLE_GROUP_KEYS:
        return [pieces]
    groups: list[list[Piece]] = [[]]
    for p in by_length:
        group = groups[-1]
        if group and (
            2 * p.context_len < group[0].context_len
            or (len(group) + 1) * aligned(group[0].context_len) > MAX_GROUP_KEYS
        ):
            groups.append([])
        groups[-1].append(p)
    return groups


def plan_paged_attention(
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    block_size: int,
    tree_bits: torch.Tensor | None = None,  # [num_tokens] int64, see the module docstring
    tree_starts: list[int] | None = None,  # [num_seqs], default: each first new token
) -> AttentionPlan:
    pieces = _pieces(seq_lens, query_start_loc, tree_starts)
    if not pieces:
        return AttentionPlan([])
    num_tokens = query_start_loc[-1]
    groups = [
        _plan_group(group, block_tables, block_size, num_tokens, tree_bits)
        for group in _length_groups(pieces)
    ]
    one_token_each = (
        len(groups) == 1 and groups[0].query_rows.shape[1] == 1 and len(pieces) == num_tokens
    )
    return AttentionPlan(groups, one_token_each)


def _plan_group(
    pieces: list[Piece],
    block_tables: torch.Tensor,
    block_size: int,
    num_tokens: int,
    tree_bits: torch.Tensor | None,
) -> BatchedGroup:
    device = block_tables.device
    max_q = max(p.num_queries for p in pieces)
    max_blocks = -(-max(p.context_len for p in pieces) // block_size)
    max_len = aligned(max(p.context_len for p in pieces))

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    starts = ints([p.start for p in pieces])
    q_lens = ints([p.num_queries for p in pieces])
    lens = ints([p.context_len for p in pieces])
    j = torch.arange(max_q, device=device)
    is_query = j[None, :] < q_lens[:, None]  # [n, max_q]
    query_rows = torch.where(is_query, starts[:, None] + j[None, :], 0)
    out_rows = torch.where(is_query, starts[:, None] + j[None, :], num_tokens).flatten()
    pos = torch.arange(max_len, device=device)  # [max_len]
    tables = block_tables[[p.seq for p in pieces], :max_blocks].long()
    block = (pos // block_size).clamp(max=max_blocks - 1)  # past the last block: masked keys
    slots = tables[:, block] * block_size + pos % block_size  # [n, max_len]
    in_context = pos[None, :] < lens[:, None]
    key_slots = torch.where(in_context, slots, slots[:, :1])  # never read a stale slot
    query_pos = lens[:, None] - q_lens[:, None] + j[None, :]  # [n, max_q]
    mask = (pos[None, None, :] <= query_pos[:, :, None]) & in_context[:, None, :]
    if tree_bits is not None:
        bits = torch.where(is_query, tree_bits[query_rows], -1)  # [n, max_q]
        first = ints([p.tree_start for p in pieces])
        mask &= tree_visible(bits, pos[None, :] - first[:, None])
    return BatchedGroup(query_rows, out_rows, key_slots.flatten(), mask[:, None])


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

    Two batched products and a float32 softmax, the query heads that share a KV head
    stacked as rows of one product (no KV head is repeated). On a CPU this is several
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
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    values = values.view(n, max_len, kv_heads, head_dim).transpose(1, 2)  # [n, kvh, len, d]
    out = torch.matmul(probs, values)  # [n, kv_heads, max_q * G, head_dim]
    out = out.view(n, kv_heads, max_q, group_size, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(n, max_q, heads, head_dim)


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
