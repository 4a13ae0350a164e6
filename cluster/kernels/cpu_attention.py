"""Paged attention on a CPU in C: every query row in one fixed order of operations.

`cpu_attention.c` attends a step's new tokens in pieces of at most PIECE_LEN consecutive
tokens of one sequence, each row over exactly the keys it may see, in key order, with the
same arithmetic whatever else shares the piece or the step (its header says how). So a
row's result is the same bits in a decode step, a verification step, a prefill chunk or
as a draft-tree node among masked siblings: batch invariance without padding rules. It is
also one call per layer where the torch path (`paged_attention_ref`, the reference it is
tested against) runs a dozen small ops per group of pieces.

The source is compiled once per machine (`cluster.kernels.cpu_build`; it uses vector
extensions and `__builtin_shufflevector`, so gcc 12 or later, or clang). OpenMP runs the
(piece, KV head, row chunk) items on `torch.get_num_threads()` threads through the OpenMP
runtime torch already loaded. Where no compiler is found or the build fails, `load()`
returns None, logs why once, and the torch path runs instead. Supported: float32 and
bfloat16 queries and caches. `write_kv` stores a step's keys and values in their cache
slots in one call (`write_kv_ref`'s two index copies cost more than a decode row's
attention).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from cluster.kernels.attention_plan import cut_pieces
from cluster.kernels.cpu_build import load_library

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
KEY_BLOCK = 16  # keys per block of scores in the kernel
MAX_ROW_CHUNK = 24  # rows per work item in the kernel at most
MIN_ROW_CHUNK = 4  # rows per work item below which a unit is not cut to spread it


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel (built the first time on this machine), or None."""
    lib = load_library("cpu_attention")
    if lib is None:
        return None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.paged_attention_pieces.restype = None
    lib.paged_attention_pieces.argtypes = [
        ptr, i64, i64, i32,  # q, its token and head strides (bytes), dtype
        ptr, ptr, i32, ptr, i64,  # k_cache, v_cache, dtype, block_tables, table stride
        ptr, ptr, ptr, ptr, ptr,  # per piece: sequence, token, queries, first pos, tree start
        ptr, i32,  # tree_bits, number of pieces
        i32, i32, i32, i32, ctypes.c_float,  # heads, kv heads, head_dim, block size, scale
        ptr, i32, i32,  # out, dtype, rows per work item
        ptr, i64, i32,  # scratch, floats per thread, threads
    ]  # fmt: skip
    lib.write_kv_slots.restype = i32
    lib.write_kv_slots.argtypes = [
        ptr, i64, i64, ptr, i64, i64,  # k, v and their token and head strides (bytes)
        ptr, ptr, ptr, i64, i64,  # k_cache, v_cache, slots, tokens, slots in the cache
        i32, i64,  # kv heads, row bytes
    ]  # fmt: skip
    return lib


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel runs these tensors (else the torch path)."""
    return (
        q.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and q.dtype in _DTYPES
        and k_cache.dtype in _DTYPES
        and q.shape[-1] == k_cache.shape[-1]
        and q.shape[-1] % 16 == 0
        and q.shape[1] % k_cache.shape[2] == 0
        and not torch.is_grad_enabled()
        and load() is not None
    )


@dataclass(frozen=True)
class PiecePlan:
    """A step's new tokens in pieces of at most PIECE_LEN consecutive tokens of one
    sequence (one step's, shared by every layer): what the kernel reads."""

    seq: torch.Tensor  # [num_pieces] int32: the piece's sequence (its block table row)
    token: torch.Tensor  # [num_pieces] int32: its first token's row in the step
    queries: torch.Tensor  # [num_pieces] int32: its token count
    first_pos: torch.Tensor  # [num_pieces] int32: its first token's position
    tree_start: torch.Tensor  # [num_pieces] int32: the first key its tree bits describe
    tree_bits: torch.Tensor  # [num_tokens] int64: -1 where every key is visible
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, contiguous
    max_keys: int  # keys of the longest piece's context
    max_queries: int  # queries of the longest piece

    @property
    def num_pieces(self) -> int:
        return self.seq.shape[0]


def plan_pieces(
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    tree_bits: torch.Tensor | None = None,  # [num_tokens] int64
    tree_starts: list[int] | None = None,  # [num_seqs], default: each first new token
) -> PiecePlan:
    pieces = cut_pieces(seq_lens, query_start_loc, tree_starts)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    seq = ints([p.seq for p in pieces])
    token = ints([p.start for p in pieces])
    queries = ints([p.num_queries for p in pieces])
    first_pos = ints([p.context_len - p.num_queries for p in pieces])
    tree_start = ints([p.tree_start for p in pieces])
    num_tokens = query_start_loc[-1] if query_start_loc else 0
    bits = (
        torch.full((num_tokens,), -1, dtype=torch.int64)
        if tree_bits is None
        else tree_bits.to(torch.int64).contiguous()
    )
    return PiecePlan(
        seq,
        token,
        queries,
        first_pos,
        tree_start,
        bits,
        block_tables.to(torch.int32).contiguous(),
        max(seq_lens, default=1),
        max((p.num_queries for p in pieces), default=1),
    )


def write_kv(
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, every entry >= 0
) -> bool:
    """Store this step's keys and values in their slots, as `write_kv_ref` does, in one
    call; False (nothing written) where the kernel cannot (another dtype than the cache's,
    a strided head dim), and the caller writes them instead."""
    lib = load()
    if (
        lib is None
        or k.dtype != k_cache.dtype
        or v.dtype != v_cache.dtype
        or k.stride(-1) != 1
        or v.stride(-1) != 1
        or k.shape != v.shape
        or k_cache.shape[2:] != k.shape[1:]
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return False
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    item = k.element_size()
    status = lib.write_kv_slots(
        k.data_ptr(), k.stride(0) * item, k.stride(1) * item,
        v.data_ptr(), v.stride(0) * item, v.stride(1) * item,
        k_cache.data_ptr(), v_cache.data_ptr(), slots.contiguous().data_ptr(),
        k.shape[0], k_cache.shape[0] * k_cache.shape[1], k.shape[1], k.shape[2] * item,
    )  # fmt: skip
    if status != 0:
        raise IndexError(f"a slot of slot_mapping is outside the cache's {k_cache.shape[0]} blocks")
    return True


def rows_per_item(max_rows: int, units: int, threads: int) -> int:
    """Rows of a work item: a (piece, KV head) unit's `max_rows` rows in as few chunks as
    keep `threads` busy. Each item reads its keys and values once, so fewer, larger items
    cost less; a lone verification piece is cut so its items divide evenly among the
    threads. (A row's result does not depend on the chunk it is in.)"""
    chunks = 1
    while (
        (units * chunks) % threads
        and units * chunks < 4 * threads
        and max_rows >= (chunks + 1) * MIN_ROW_CHUNK
    ):
        chunks += 1
    return max(1, min(MAX_ROW_CHUNK, -(-max_rows // chunks)))


def paged_attention_cpu(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: PiecePlan,
    scale: float,
) -> torch.Tensor:
    """[num_tokens, heads, head_dim] in q's dtype; `supports(q, k_cache)` must hold."""
    lib = load()
    assert lib is not None
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_tokens, heads, head_dim = q.shape
    if plan.tree_bits.shape[0] != num_tokens:
        raise ValueError(f"q has {num_tokens} tokens, the plan {plan.tree_bits.shape[0]}")
    kv_heads = k_cache.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if plan.num_pieces == 0:
        return out
    threads = max(1, torch.get_num_threads())
    group = heads // kv_heads
    rows = rows_per_item(plan.max_queries * group, plan.num_pieces * kv_heads, threads)
    padded_keys = -(-plan.max_keys // KEY_BLOCK) * KEY_BLOCK
    # per thread: score lanes, queries, value sums, weights, totals; keys and values as float32
    scratch_floats = rows * (16 * KEY_BLOCK + 2 * head_dim + padded_keys + 1)
    scratch_floats += 2 * padded_keys * head_dim
    scratch_floats = -(-scratch_floats // 16) * 16  # each thread's share 64-byte aligned
    scratch = torch.empty(threads * scratch_floats, dtype=torch.float32)
    item = q.element_size()
    lib.paged_attention_pieces(
        q.data_ptr(), q.stride(0) * item, q.stride(1) * item, _DTYPES[q.dtype],
        k_cache.data_ptr(), v_cache.data_ptr(), _DTYPES[k_cache.dtype],
        plan.block_tables.data_ptr(), plan.block_tables.stride(0),
        plan.seq.data_ptr(), plan.token.data_ptr(), plan.queries.data_ptr(),
        plan.first_pos.data_ptr(), plan.tree_start.data_ptr(),
        plan.tree_bits.data_ptr(), plan.num_pieces,
        heads, kv_heads, head_dim, k_cache.shape[1], scale,
        out.data_ptr(), _DTYPES[out.dtype], rows,
        scratch.data_ptr(), scratch_floats, threads,
    )  # fmt: skip
    return out
