"""How one step's attention is laid out, from its metadata alone (shared by every layer).

Every sequence's new tokens are cut into pieces of at most `PIECE_LEN` queries, each over
its context padded to a multiple of `KEY_ALIGN` keys, and pieces of similar context
length are batched into groups (`plan_paged_attention`). A row's result then does not
depend on what else shares its step (batch invariance). `paged_attention.py` runs a plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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


def cut_pieces(
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
    pieces = cut_pieces(seq_lens, query_start_loc, tree_starts)
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
