"""Triton kernels for the paged KV cache: `write_kv_triton` and `paged_attention_triton`.

Same layout and semantics as the torch oracle in `paged_attention.py` (read its module
docstring): caches are `[num_blocks, block_size, kv_heads, head_dim]`, a sequence's keys live
in the blocks its row of `block_tables` lists, and new token j of sequence i sits at
position `seq_lens[i] - q_len_i + j` and attends causally to every key at or before it.

- `_write_kv_kernel`, one program per new token: copies its keys and values (all KV heads)
  into slot `slot_mapping[t]`; a negative slot means "skip this token" (padding).
- `_paged_attention_kernel`, one program per (sequence, query head, tile of BLOCK_M new
  tokens): flash-attention style online softmax in float32 over the sequence's KV blocks,
  walked in order through its block table.

Any head_dim works (tiles are padded to a power of two and masked), as does any block size
(keys are gathered through the block table one by one, so a tile may span several small
blocks or part of a large one). On CPU tensors the kernels run under the Triton interpreter,
which needs `TRITON_INTERPRET=1` before `triton` is first imported.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [num_tokens, kv_heads, head_dim]
    v_ptr,  # [num_tokens, kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int32 or int64
    num_kv_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # next_power_of_2(kv_heads)
    BLOCK_D: tl.constexpr,  # next_power_of_2(head_dim)
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]

    k = tl.load(
        k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
    )
    v = tl.load(
        v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
    )
    k_dst = (
        k_cache_ptr
        + block * stride_kcb
        + offset * stride_kcs
        + offs_h[:, None] * stride_kch
        + offs_d[None, :] * stride_kcd
    )
    v_dst = (
        v_cache_ptr
        + block * stride_vcb
        + offset * stride_vcs
        + offs_h[:, None] * stride_vch
        + offs_d[None, :] * stride_vcd
    )
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32 or int64
) -> None:
    """Store this step's keys and values in place: token t goes to slot `slot_mapping[t]`.

    Slot `s` is block `s // block_size`, offset `s % block_size`. Entries < 0 mean "skip this
    token" (e.g. padding of a captured batch): its program returns without writing, so
    neither cache changes there. (The torch `write_kv_ref` has no such rule: it would wrap a
    negative slot around to the last block.) `k`/`v` may be strided views, e.g. slices of a
    fused QKV projection; they are cast to the cache dtype.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, (k.shape, v.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == k.shape[1:], (
        k_cache.shape,
        k.shape,
    )
    assert slot_mapping.shape == (num_tokens,), slot_mapping.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        head_dim,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    out_ptr,  # [num_tokens, heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    tree_bits_ptr,  # [num_tokens] int64 draft-tree masks (read when HAS_TREE)
    tree_starts_ptr,  # [num_seqs] int32 first key the bits describe (read when TREE_STARTS)
    scale_log2,  # softmax scale * log2(e): scores are exponentiated with exp2
    head_dim,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bts,
    stride_btb,
    QUERIES_PER_KV: tl.constexpr,  # heads // kv_heads
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,  # new tokens (query rows) per program
    BLOCK_N: tl.constexpr,  # keys per loop iteration
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two (>= 16)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no TF32 rounding), else "tf32"
    HAS_TREE: tl.constexpr,  # whether tree_bits restricts which new tokens a query sees
    TREE_STARTS: tl.constexpr,  # whether tree_starts is given (else: the first new token)
):
    """One (sequence, query head, tile of BLOCK_M of the sequence's new tokens) per program.

    The tile's queries sit at positions `context_len + offs_m` (context_len = cached tokens
    before this step). The loop walks the sequence's keys from position 0 in tiles of
    BLOCK_N consecutive positions: position p lives in physical block
    `block_tables[seq, p // BLOCK_SIZE]` at offset `p % BLOCK_SIZE`, so when
    BLOCK_N == BLOCK_SIZE each iteration reads exactly one cache block, in block-table order.
    It stops after the tile's last query position (later keys are all causally masked).
    Per iteration, in float32: scores `S = q @ k^T` (scaled, masked to `key pos <= query
    pos`), running row max `m`, running denominator `l` and accumulator `acc`, both
    rescaled by `exp2(m_old - m_new)` when the max grows (online softmax). The output
    `acc / l` is stored in q's dtype. With HAS_TREE, a key among the step's new tokens is
    also masked unless its bit is set in the query's `tree_bits` (draft trees).
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:  # the grid is sized for the longest query run
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    kv_head = head // QUERIES_PER_KV

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] index among new tokens
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    q_pos = context_len + offs_m  # [BLOCK_M] context position of each query
    rows = (q_start + offs_m).to(tl.int64)  # [BLOCK_M] rows of q / out

    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if HAS_TREE:
        bits = tl.load(tree_bits_ptr + rows, mask=m_mask, other=-1)  # [BLOCK_M] int64
        tree_start = context_len
        if TREE_STARTS:
            tree_start = tl.load(tree_starts_ptr + seq)

    # Finite start for the running max: exp2(m_i - m_new) never sees (-inf) - (-inf).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    kv_end = tl.minimum(seq_len, context_len + (m_block + 1) * BLOCK_M)  # past the last query
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for start in range(0, kv_end, BLOCK_N):
        k_pos = start + offs_n  # [BLOCK_N]
        n_mask = k_pos < kv_end
        block = tl.load(table + (k_pos // BLOCK_SIZE) * stride_btb, mask=n_mask, other=0)
        block = block.to(tl.int64)  # [BLOCK_N] physical block of each key
        slot = k_pos % BLOCK_SIZE  # [BLOCK_N]

        k = tl.load(
            k_cache_ptr
            + block[None, :] * stride_kb
            + slot[None, :] * stride_ks
            + kv_head * stride_kh
            + offs_d[:, None] * stride_kd,
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        s = s * scale_log2
        visible = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_TREE:
            new_index = k_pos - tree_start  # [BLOCK_N] index from the tree's first key
            shift = tl.minimum(tl.maximum(new_index, 0), 63).to(tl.int64)
            bit = (bits[:, None] >> shift[None, :]) & 1
            visible = visible & ((new_index[None, :] < 0) | (bit == 1))
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_M] rescales what was summed so far
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vb
            + slot[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :] * stride_vd,
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]  # [BLOCK_M, BLOCK_D]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_attention_triton(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, on q's device
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, on q's device
    scale: float,
    max_query_len: int,
    tree_bits: torch.Tensor | None = None,  # [num_tokens] int64 draft-tree masks
    tree_starts: torch.Tensor | None = None,  # [num_seqs] int32 (default: first new token)
) -> torch.Tensor:
    """Triton version of `paged_attention_ref`; returns [num_tokens, heads, head_dim] in q's dtype.

    One launch serves a batch mixing prefill chunks (with cached context before them),
    multi-token verification and decode. `max_query_len` must be >= every sequence's number
    of new tokens (`query_start_loc[i + 1] - query_start_loc[i]`); it sizes the grid
    `(num_seqs, heads, cdiv(max_query_len, BLOCK_M))` without a device-to-host sync. Rows of
    `out` that belong to no sequence (past `query_start_loc[-1]`) are left uninitialised, as
    in the reference.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert v_cache.shape == k_cache.shape and k_cache.shape[3] == head_dim, (
        q.shape,
        k_cache.shape,
        v_cache.shape,
    )
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_seqs + 1,), (query_start_loc.shape, num_seqs)
    assert block_tables.shape[0] == num_seqs, (block_tables.shape, num_seqs)
    if not q.is_cuda and torch.bfloat16 in (q.dtype, k_cache.dtype):
        # The interpreter multiplies bfloat16 bit patterns in tl.dot (triton-lang/triton#11584).
        raise NotImplementedError("bfloat16 under the Triton interpreter: use float16 or float32")
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out

    block_m = 16 if max_query_len <= 16 else 64  # tl.dot needs >= 16 rows; decode wastes the rest
    block_n = min(max(triton.next_power_of_2(block_size), 16), 128)
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        tree_bits if tree_bits is not None else seq_lens,  # (not read without a tree)
        tree_starts if tree_starts is not None else seq_lens,
        scale * math.log2(math.e),
        head_dim,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_tables.stride(),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_TREE=tree_bits is not None,
        TREE_STARTS=tree_starts is not None,
    )
    return out
