"""The paged-KV Triton kernels equal the torch oracle in `cluster/kernels/paged_attention.py`.

On CPU the kernels run under the Triton interpreter (tests/conftest.py switches it on), so
the shapes here are tiny. Every attention batch mixes, in random order: a prefill chunk
with cached context before it (spanning two query tiles), a fresh prefill, two decodes, a
3-token verification and a sequence with no new token this step. Blocks are handed out
from a shuffled pool (so no sequence's blocks are contiguous or ordered), the block table is
a strided view, q is a strided view of a fused QKV tensor, and every cache slot that holds
no key is NaN, so a kernel reading past a sequence's end (or its last partial block) fails.
Float32 tolerance: atol = rtol = 1e-5.
"""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch

from cluster.draft_tree import DraftTree
from cluster.kernels.paged_attention import paged_attention_ref, write_kv_ref
from cluster.kernels.paged_attention_triton import paged_attention_triton, write_kv_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ATOL = RTOL = 1e-5  # float32
TOL16 = 5e-3  # float16 kernel against the float32 reference

# (cached tokens before this step, new tokens) per sequence. Total lengths 80, 16, 33, 24,
# 5, 7: for block size 16, 80 and 16 are exact multiples and the rest are not; for block
# size 4, 80, 16 and 24 are; for block size 1, all are.
SEQUENCES = [(13, 67), (15, 1), (32, 1), (21, 3), (0, 5), (7, 0)]


def make_batch(
    gen: torch.Generator,
    sequences: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device = DEVICE,
) -> dict:
    """A random batch in the paged layout, with the sequences in a random order."""
    order = torch.randperm(len(sequences), generator=gen).tolist()
    sequences = [sequences[i] for i in order]
    seq_lens = [ctx + new for ctx, new in sequences]
    q_lens = [new for _, new in sequences]
    query_start_loc = [0]
    for n in q_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    num_tokens = query_start_loc[-1]

    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks no sequence owns
    pool = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq)
    wide = torch.zeros(len(sequences), max_blocks + 3, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(blocks_per_seq):
        wide[i, :n] = pool[taken : taken + n]
        taken += n
    block_tables = wide.to(device)[:, : max_blocks + 1]  # padded with 0, and strided

    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
    for i, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots = wide[i, pos // block_size].long() * block_size + pos % block_size
        keys = torch.randn(n, kv_heads, head_dim, generator=gen).to(device, dtype)
        values = torch.randn(n, kv_heads, head_dim, generator=gen).to(device, dtype)
        write_kv_ref(keys, values, k_cache, v_cache, slots.to(device))

    fused = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=gen)
    q = fused.to(device, dtype)[:, :heads]  # [num_tokens, heads, head_dim], strided like QKV
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
        "query_start_loc": query_start_loc,
        "scale": 1.0 / math.sqrt(head_dim),
    }


def run_triton(batch: dict, tree_bits=None, tree_starts=None) -> torch.Tensor:
    """The Triton kernel on a `make_batch` batch (lists become int32 tensors)."""
    device = batch["q"].device
    if tree_starts is not None:
        tree_starts = torch.tensor(tree_starts, dtype=torch.int32, device=device)
    return paged_attention_triton(
        batch["q"],
        batch["k_cache"],
        batch["v_cache"],
        batch["block_tables"],
        torch.tensor(batch["seq_lens"], dtype=torch.int32, device=device),
        torch.tensor(batch["query_start_loc"], dtype=torch.int32, device=device),
        batch["scale"],
        max_query_len=max(b - a for a, b in pairwise(batch["query_start_loc"])),
        tree_bits=tree_bits,
        tree_starts=tree_starts,
    )


def run_both(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(Triton output, reference output) for the batch."""
    return run_triton(batch), paged_attention_ref(**batch)


def as_float32(batch: dict) -> dict:
    return {**batch, **{name: batch[name].float() for name in ("q", "k_cache", "v_cache")}}


@pytest.mark.parametrize("queries_per_kv", [1, 2, 4])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_attention_mixed_batch_matches_reference(block_size, queries_per_kv):
    gen = torch.Generator().manual_seed(100 * block_size + queries_per_kv)
    batch = make_batch(gen, SEQUENCES, 4, 4 // queries_per_kv, 16, block_size)
    got, want = run_both(batch)
    assert got.shape == want.shape == batch["q"].shape and got.dtype == torch.float32
    assert torch.isfinite(got).all()  # no NaN slot was read
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("head_dim", [8, 24, 128])
def test_attention_head_dims(head_dim):
    """Head dims below 16, not a power of two, and the usual 128."""
    gen = torch.Generator().manual_seed(head_dim)
    batch = make_batch(gen, [(6, 19), (9, 1), (4, 3)], 4, 2, head_dim, 4)
    got, want = run_both(batch)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_attention_heads_read_their_own_kv_head():
    """Zeroing one KV head's values changes exactly the query heads of its group."""
    gen = torch.Generator().manual_seed(7)
    batch = make_batch(gen, [(5, 3), (11, 1)], 6, 2, 16, 4)
    before, _ = run_both(batch)
    batch["v_cache"] = batch["v_cache"].clone()
    batch["v_cache"][:, :, 1] = 0.0  # KV head 1 serves query heads 3, 4, 5
    after, want = run_both(batch)
    torch.testing.assert_close(after, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(after[:, :3], before[:, :3], atol=0, rtol=0)
    assert (after[:, 3:] == 0).all() and (before[:, 3:] != 0).all()


def test_attention_float16():
    """The 16-bit path (probabilities cast to the value dtype before P @ V), checked against
    float32. bfloat16 runs on CUDA only: the interpreter's bfloat16 `tl.dot` is wrong."""
    gen = torch.Generator().manual_seed(16)
    batch = make_batch(gen, SEQUENCES, 4, 2, 32, 16, torch.float16)
    got = run_triton(batch)
    want = paged_attention_ref(**as_float32(batch))
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=TOL16, rtol=TOL16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the guard is for the interpreter")
def test_bfloat16_refused_under_interpreter():
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(gen, [(3, 1)], 2, 1, 16, 4, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="bfloat16"):
        run_triton(batch)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_write_kv_skips_negative_slots(block_size, slot_dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_tokens, kv_heads, head_dim = 9, 2, 24
    num_blocks = 16 // block_size + 2  # 18 to 48 slots for 9 tokens
    fused = torch.randn(num_tokens, 4 + 2 * kv_heads, head_dim, generator=gen).to(DEVICE)
    k = fused[:, 4 : 4 + kv_heads]  # [num_tokens, kv_heads, head_dim], strided views
    v = fused[:, 4 + kv_heads :]
    skipped = torch.tensor([0, 4, num_tokens - 1])
    kept = torch.ones(num_tokens, dtype=torch.bool)
    kept[skipped] = False
    kept = kept.to(DEVICE)
    num_slots, num_kept = num_blocks * block_size, num_tokens - len(skipped)
    edges = torch.tensor([0, num_slots - 1])  # the cache's first and last slots are written
    inner = torch.randperm(num_slots - 2, generator=gen)[: num_kept - 2] + 1
    slots = torch.full((num_tokens,), -1)
    slots[kept.cpu()] = torch.cat([edges, inner])[torch.randperm(num_kept, generator=gen)]
    slot_mapping = slots.to(DEVICE, slot_dtype)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(DEVICE)
    v_cache = torch.randn(cache_shape, generator=gen).to(DEVICE)

    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(k[kept], v[kept], want_k, want_v, slot_mapping[kept])
    write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache, want_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0)
    # The kept tokens really landed (the oracle and the kernel could both be no-ops).
    written = k_cache.flatten(0, 1)[slot_mapping[kept].long()]  # [kept, kv_heads, head_dim]
    torch.testing.assert_close(written, k[kept], atol=0, rtol=0)
    # A skipped token's key is nowhere in the cache (`write_kv_ref` would wrap -1 around).
    for t in skipped.tolist():
        assert not (k_cache == k[t]).all(dim=-1).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_realistic_sizes():
    """32 heads over 8 KV heads, head_dim 128, block 16, bf16; checked against float32."""
    gen = torch.Generator().manual_seed(0)
    sequences = [(1000, 512), (0, 300), (1024, 1), (776, 1), (2000, 4), (130, 1)]
    batch = make_batch(gen, sequences, 32, 8, 128, 16, torch.bfloat16, torch.device("cuda"))
    got, want_bf16 = run_both(batch)
    want = paged_attention_ref(**as_float32(batch))
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    # And no worse than the torch path in bf16, up to bf16 rounding of the output.
    err = (got.float() - want).abs().max().item()
    ref_err = (want_bf16.float() - want).abs().max().item()
    assert err <= 2 * ref_err + 1e-2, (err, ref_err)


def _tree_bits(batch: dict, trees: dict[int, DraftTree]) -> torch.Tensor:
    """[num_tokens] int64: -1 (causal) except for the sequences holding a draft tree (by
    their number of new tokens), whose rows get the tree's ancestor masks."""
    bits = torch.full((batch["query_start_loc"][-1],), -1, dtype=torch.int64)
    for start, end in pairwise(batch["query_start_loc"]):
        tree = trees.get(end - start)
        if tree is not None:
            mask = tree.ancestor_mask()  # [n + 1, n + 1]
            weights = 2 ** torch.arange(mask.shape[1], dtype=torch.int64)
            bits[start:end] = (mask.long() * weights).sum(dim=1)
    return bits.to(batch["q"].device)


def _dense_tree_attention(batch: dict, bits: torch.Tensor, starts=None) -> torch.Tensor:
    """Every query over exactly the keys it may see, one by one (the test's own oracle)."""
    q, out = batch["q"], torch.empty_like(batch["q"])
    block_size, kv_heads = batch["k_cache"].shape[1], batch["k_cache"].shape[2]
    group = q.shape[1] // kv_heads
    for i, (start, end) in enumerate(pairwise(batch["query_start_loc"])):
        seq_len, context = batch["seq_lens"][i], batch["seq_lens"][i] - (end - start)
        first = context if starts is None else starts[i]
        pos = torch.arange(seq_len)
        slots = batch["block_tables"][i, pos // block_size].long().cpu() * block_size
        slots = (slots + pos % block_size).to(q.device)
        keys = batch["k_cache"].flatten(0, 1)[slots].repeat_interleave(group, dim=1)
        values = batch["v_cache"].flatten(0, 1)[slots].repeat_interleave(group, dim=1)
        for j in range(end - start):
            b = int(bits[start + j])
            seen = [p for p in range(context + j + 1) if p < first or (b >> (p - first)) & 1]
            scores = torch.einsum("hd,khd->hk", q[start + j], keys[seen]) * batch["scale"]
            out[start + j] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[seen])
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_tree_masks_match_a_dense_oracle(block_size):
    """Two trees (8 and 4 new tokens: root + nodes) verified beside a long prefill chunk,
    decodes and a 3-token chain; every query sees the context and its ancestors only."""
    trees = {
        8: DraftTree((5, 6, 7, 8, 9, 10, 11), (-1, -1, 0, 0, 1, 3, -1)),
        4: DraftTree((1, 2, 3), (-1, -1, 1)),
    }
    gen = torch.Generator().manual_seed(7 + block_size)
    sequences = [*SEQUENCES, (9, 8), (30, 4)]
    batch = make_batch(gen, sequences, 4, 2, 16, block_size)
    bits = _tree_bits(batch, trees)
    want = _dense_tree_attention(batch, bits)
    ref = paged_attention_ref(**batch, tree_bits=bits)
    got = run_triton(batch, bits)
    torch.testing.assert_close(ref, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # the trees changed something: plain causal attention differs on their rows
    causal = paged_attention_ref(**batch)
    assert not torch.allclose(causal, want, atol=1e-3)


@pytest.mark.parametrize("block_size", [1, 4])
def test_tree_masks_can_start_before_the_new_tokens(block_size):
    """A draft's tree pass: the new tokens are the frontier, and the bits also cover
    earlier nodes (from `tree_starts`), some of which a query must not see."""
    gen = torch.Generator().manual_seed(11)
    batch = make_batch(gen, [(12, 3), (5, 1), (20, 2)], 4, 4, 16, block_size)
    q_lens = [b - a for a, b in pairwise(batch["query_start_loc"])]
    starts = [seq - n - 4 for seq, n in zip(batch["seq_lens"], q_lens, strict=True)]
    # over [4 earlier keys, then the new tokens]: skip earlier keys 1 and 2 (or 0 and 3)
    patterns = [0b1001, 0b0110]
    rows = []
    for n in q_lens:
        rows += [patterns[j % 2] | 1 << (4 + j) for j in range(n)]
    bits = torch.tensor(rows, dtype=torch.int64, device=batch["q"].device)
    want = _dense_tree_attention(batch, bits, starts)
    ref = paged_attention_ref(**batch, tree_bits=bits, tree_starts=starts)
    got = run_triton(batch, bits, starts)
    torch.testing.assert_close(ref, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_split_into_length_groups_equals_one_padded_group(block_size, monkeypatch):
    """A large decode batch is split into groups of similar context length (so short
    sequences are not padded to the longest); the result must not change, trees included."""
    import cluster.kernels.attention_plan as plan_module

    gen = torch.Generator().manual_seed(7 + block_size)
    lengths = [(3, 1), (90, 1), (40, 3), (11, 1), (200, 2), (6, 4)]  # (cached, new)
    batch = make_batch(gen, [*lengths, *SEQUENCES], 4, 2, 16, block_size)
    q_lens = [b - a for a, b in pairwise(batch["query_start_loc"])]
    bits = torch.full((len(batch["q"]),), -1, dtype=torch.int64, device=batch["q"].device)
    first = batch["query_start_loc"][q_lens.index(4)]  # a 4-token tree: root, two children
    bits[first : first + 4] = torch.tensor([0b0001, 0b0011, 0b0101, 0b0111])
    one_group = [paged_attention_ref(**batch), paged_attention_ref(**batch, tree_bits=bits)]
    monkeypatch.setattr(plan_module, "SINGLE_GROUP_KEYS", 0)
    plan = plan_module.plan_paged_attention(
        batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], block_size
    )
    assert len(plan.groups) >= 4
    grouped = [paged_attention_ref(**batch), paged_attention_ref(**batch, tree_bits=bits)]
    for got, want in zip(grouped, one_group, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
