"""The C attention kernel for CPUs (`cluster.kernels.cpu_attention`) against the torch
reference, and its batch invariance.

Batches are `test_paged_attention_kernel.make_batch`'s (shuffled blocks, strided q and
block tables, NaN in every slot that holds no key; decodes, a verification, prefill chunks
longer than one 16-token piece). Float32 tolerance atol = rtol = 1e-5 against the float32
reference; bfloat16 inputs against the float32 reference on the same (rounded) inputs:
atol = rtol = 1e-2 (the output's own bfloat16 rounding is ~4e-3). Invariance is bitwise:
every row equals itself attended alone, and a draft-tree node equals the same keys laid
out as a chain.
"""

from __future__ import annotations

import re
from itertools import pairwise

import pytest
import torch
from test_paged_attention_kernel import (
    SEQUENCES,
    _dense_tree_attention,
    _tree_bits,
    as_float32,
    make_batch,
)

from cluster.draft_tree import DraftTree
from cluster.kernels import cpu_attention
from cluster.kernels.attention_plan import PIECE_LEN
from cluster.kernels.paged_attention import paged_attention_ref
from cluster.models.attention import AttentionMetadata
from cluster.worker.kv_cache import PagedKVCache

CPU = torch.device("cpu")
ATOL = RTOL = 1e-5
TOL_BF16 = 1e-2
LONG_SEQUENCES = [*SEQUENCES, (40, 37), (0, 33)]  # prefill chunks of 3 pieces

needs_kernel = pytest.mark.skipif(
    cpu_attention.load() is None, reason="the C kernel did not build here"
)


def run_kernel(batch: dict, tree_bits=None, tree_starts=None) -> torch.Tensor:
    plan = cpu_attention.plan_pieces(
        batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], tree_bits, tree_starts
    )
    with torch.inference_mode():
        return cpu_attention.paged_attention_cpu(
            batch["q"], batch["k_cache"], batch["v_cache"], plan, batch["scale"]
        )


@needs_kernel
@pytest.mark.parametrize("queries_per_kv", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_batch_matches_the_reference(block_size, queries_per_kv):
    gen = torch.Generator().manual_seed(block_size * 10 + queries_per_kv)
    batch = make_batch(gen, LONG_SEQUENCES, 2 * queries_per_kv, 2, 64, block_size, device=CPU)
    torch.testing.assert_close(
        run_kernel(batch), paged_attention_ref(**batch), atol=ATOL, rtol=RTOL
    )


@needs_kernel
@pytest.mark.parametrize("head_dim", [16, 128])
def test_bfloat16_matches_the_float32_reference(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    batch = make_batch(gen, LONG_SEQUENCES, 9, 3, head_dim, 16, torch.bfloat16, CPU)
    got = run_kernel(batch)
    assert got.dtype == torch.bfloat16
    want = paged_attention_ref(**as_float32(batch))
    torch.testing.assert_close(got.float(), want, atol=TOL_BF16, rtol=TOL_BF16)


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 16])
def test_tree_masks_match_a_dense_oracle(block_size):
    trees = {
        8: DraftTree((5, 6, 7, 8, 9, 10, 11), (-1, -1, 0, 0, 1, 3, -1)),
        4: DraftTree((1, 2, 3), (-1, -1, 1)),
    }
    gen = torch.Generator().manual_seed(3 + block_size)
    batch = make_batch(gen, [*SEQUENCES, (9, 8), (30, 4)], 4, 2, 16, block_size, device=CPU)
    bits = _tree_bits(batch, trees)
    want = _dense_tree_attention(batch, bits)
    torch.testing.assert_close(run_kernel(batch, bits), want, atol=ATOL, rtol=RTOL)


@needs_kernel
def test_tree_masks_can_start_before_the_new_tokens():
    gen = torch.Generator().manual_seed(5)
    batch = make_batch(gen, [(12, 3), (5, 1), (20, 2)], 4, 4, 16, 4, device=CPU)
    q_lens = [b - a for a, b in pairwise(batch["query_start_loc"])]
    starts = [seq - n - 4 for seq, n in zip(batch["seq_lens"], q_lens, strict=True)]
    rows = []
    for n in q_lens:  # over [4 earlier keys, then the new tokens]
        rows += [(0b1001, 0b0110)[j % 2] | 1 << (4 + j) for j in range(n)]
    bits = torch.tensor(rows, dtype=torch.int64)
    want = _dense_tree_attention(batch, bits, starts)
    torch.testing.assert_close(run_kernel(batch, bits, starts), want, atol=ATOL, rtol=RTOL)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_is_the_same_bits_attended_alone(dtype):
    """Each token of a mixed step (prefill pieces, a verification, decodes) equals the
    token attended as the only query of its step (a decode at its position)."""
    gen = torch.Generator().manual_seed(17)
    batch = make_batch(gen, LONG_SEQUENCES, 9, 3, 64, 4, dtype, CPU)
    together = run_kernel(batch)
    for i, (start, end) in enumerate(pairwise(batch["query_start_loc"])):
        for j in range(end - start):
            seq_len = batch["seq_lens"][i] - (end - start) + j + 1
            alone = {
                **batch,
                "q": batch["q"][start + j : start + j + 1],
                "block_tables": batch["block_tables"][i : i + 1],
                "seq_lens": [seq_len],
                "query_start_loc": [0, 1],
            }
            assert torch.equal(run_kernel(alone)[0], together[start + j]), (i, j)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_the_same_bits_however_work_items_cut_them(dtype, monkeypatch):
    """A work item's row count (1 row, the default cuts, the largest) moves no bit."""
    gen = torch.Generator().manual_seed(31)
    batch = make_batch(gen, LONG_SEQUENCES, 9, 3, 64, 16, dtype, CPU)
    want = run_kernel(batch)
    for rows in (1, 5, cpu_attention.MAX_ROW_CHUNK):
        monkeypatch.setattr(cpu_attention, "rows_per_item", lambda *_, rows=rows: rows)
        assert torch.equal(run_kernel(batch), want), rows


def test_work_items_spread_a_lone_verification_over_the_threads():
    # one 16-token piece, 3 KV heads of 3 query heads each (48 rows a head), 2 threads:
    # two items a head, 6 in all, 3 a thread
    assert cpu_attention.rows_per_item(48, 3, 2) == 24
    assert cpu_attention.rows_per_item(12, 3, 2) == 6  # a 4-token verification
    assert cpu_attention.rows_per_item(3, 3, 2) == 3  # a decode row is not cut
    assert cpu_attention.rows_per_item(12, 48, 2) == 12  # many pieces: whole units
    assert cpu_attention.rows_per_item(64, 8, 2) == 24  # capped at MAX_ROW_CHUNK
    assert cpu_attention.rows_per_item(48, 3, 1) == 24


@needs_kernel
def test_a_tree_node_equals_its_ancestors_laid_out_as_a_chain():
    """A node sees the context and its ancestors, with masked siblings between them; the
    same keys side by side (a chain, plain causal) give the same bits."""
    tree = DraftTree((5, 6, 7, 8, 9, 10), (-1, -1, 0, 1, 2, 0))
    gen = torch.Generator().manual_seed(23)
    context, new = 29, 7  # root + 6 nodes
    batch = make_batch(gen, [(context, new)], 9, 3, 64, 16, torch.bfloat16, CPU)
    bits = _tree_bits(batch, {new: tree})
    got = run_kernel(batch, bits)
    mask = tree.ancestor_mask()  # [7, 7]: which tree tokens each one sees
    k_flat = batch["k_cache"].flatten(0, 1)
    v_flat = batch["v_cache"].flatten(0, 1)
    table = batch["block_tables"][0].long()
    slots = table[torch.arange(context + new) // 16] * 16 + torch.arange(context + new) % 16
    for node in range(new):
        seen = [*range(context), *(context + m for m in range(new) if mask[node, m])]
        chain = {**batch, "seq_lens": [len(seen)], "query_start_loc": [0, 1]}
        chain["k_cache"] = torch.zeros_like(batch["k_cache"])
        chain["v_cache"] = torch.zeros_like(batch["v_cache"])
        chain["k_cache"].flatten(0, 1)[slots[: len(seen)]] = k_flat[slots[seen]]
        chain["v_cache"].flatten(0, 1)[slots[: len(seen)]] = v_flat[slots[seen]]
        chain["q"] = batch["q"][node : node + 1]
        assert torch.equal(run_kernel(chain)[0], got[node]), node
    assert not torch.equal(got, run_kernel(batch))  # the masks did change the rows


@needs_kernel
def test_the_engine_cache_runs_the_kernel_and_the_torch_backend_the_reference(monkeypatch):
    calls = []
    real = cpu_attention.paged_attention_cpu
    monkeypatch.setattr(
        cpu_attention, "paged_attention_cpu", lambda *a: calls.append(1) or real(*a)
    )
    gen = torch.Generator().manual_seed(29)
    q, k, v = (torch.randn(7, h, 64, generator=gen) for h in (6, 2, 2))
    results = {}
    for backend in ("auto", "torch"):
        cache = PagedKVCache([(2, 64)], 16, 4, torch.float32, CPU, backend)
        meta = AttentionMetadata(
            [0, 5, 7], [5, 2], torch.tensor([0, 1, 2, 3, 4, 0, 1]),
            slot_mapping=torch.tensor([0, 1, 2, 3, 4, 8, 9]),
            block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        )  # fmt: skip
        calls.clear()
        with torch.inference_mode():
            results[backend] = cache.attend(0, q, k, v, meta, 0.125)
        assert (len(calls) == 1) == (backend == "auto"), backend
    torch.testing.assert_close(results["auto"], results["torch"], atol=ATOL, rtol=RTOL)


def test_a_failed_build_leaves_the_torch_path(failing_c_compiler):
    assert cpu_attention.load() is None
    q, k_cache = torch.zeros(1, 2, 16), torch.zeros(1, 4, 2, 16)
    with torch.inference_mode():
        assert not cpu_attention.supports(q, k_cache)


def test_the_kernels_constants_match_the_python_side():
    with open(cpu_attention.__file__.replace(".py", ".c")) as f:
        source = f.read()

    def define(name: str) -> int:
        return int(re.search(rf"#define {name} (\d+)", source).group(1))

    # the kernel's work items cover a piece's queries only up to its PIECE_LEN_MAX
    assert define("PIECE_LEN_MAX") == PIECE_LEN
    assert define("KEY_BLOCK") == cpu_attention.KEY_BLOCK


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_what_the_reference_stores(dtype):
    from cluster.kernels.paged_attention import write_kv_ref

    gen = torch.Generator().manual_seed(11)
    # k and v as the model hands them over: views into one projection's output
    qkv = torch.randn(5, 3 * 2 * 16, generator=gen).to(dtype)
    k, v = qkv[:, 32:64].view(5, 2, 16), qkv[:, 64:].view(5, 2, 16)
    slots = torch.tensor([9, 0, 17, 3, 30], dtype=torch.int32)
    caches = [torch.zeros(4, 8, 2, 16, dtype=dtype) for _ in range(4)]
    assert cpu_attention.write_kv(k, v, caches[0], caches[1], slots)
    write_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(IndexError, match="slot"):
        cpu_attention.write_kv(k, v, caches[0], caches[1], torch.tensor([0, 1, 2, 3, 32]))
    assert torch.equal(caches[0], caches[2])  # nothing written
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert not cpu_attention.write_kv(k.to(other), v.to(other), caches[0], caches[1], slots)
