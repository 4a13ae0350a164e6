"""Fused MoE: the expert layout is a valid sort, the torch reference equals the
per-expert loop of `cluster.models.moe`, and the Triton grouped GEMMs (the interpreter on
CPU) equal the reference."""

from __future__ import annotations

import pytest
import torch

from cluster.kernels.fused_moe import fused_moe, fused_moe_ref
from cluster.kernels.fused_moe_triton import fused_moe_triton
from cluster.kernels.moe_layout import align_by_expert, max_slots
from cluster.models.moe import SparseMoeBlock, experts_by_expert

# 16-bit: bfloat16 on CUDA; float16 under the interpreter, whose tl.dot mishandles bfloat16
HALF = torch.bfloat16 if torch.cuda.is_available() else torch.float16


def _routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator):
    ids = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    )
    return ids, torch.rand(num_tokens, top_k, generator=gen)


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, block_m", [(1, 8, 2, 4), (9, 6, 3, 4), (40, 16, 4, 16)]
)
def test_layout_holds_every_pair_once_in_expert_runs(num_tokens, num_experts, top_k, block_m):
    gen = torch.Generator().manual_seed(num_tokens)
    ids, _ = _routing(num_tokens, num_experts, top_k, gen)
    layout = align_by_expert(ids, num_experts, block_m)
    num_pairs = ids.numel()
    assert layout.sorted_pairs.numel() == max_slots(num_pairs, num_experts, block_m)
    real = layout.sorted_pairs[layout.sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair exactly once
    flat = ids.reshape(-1)
    for block, expert in enumerate(layout.block_experts.tolist()):
        slots = layout.sorted_pairs[block * block_m : (block + 1) * block_m]
        pairs = slots[slots < num_pairs]
        if expert < 0:
            assert pairs.numel() == 0
        else:  # a block holds one expert's pairs, in pair order
            assert (flat[pairs] == expert).all() and pairs.tolist() == sorted(pairs.tolist())
    assert layout.counts.tolist() == torch.bincount(flat, minlength=num_experts).tolist()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_rows_give_an_empty_output(backend):
    """(An expert-parallel rank whose share of a one-token step is empty.)"""
    x, ids = torch.zeros(0, 16), torch.zeros(0, 1, dtype=torch.int64)
    w13, w2 = torch.randn(3, 8, 16), torch.randn(3, 16, 4)
    out = fused_moe(x, w13, w2, ids, torch.zeros(0, 1), backend=backend)
    assert out.shape == (0, 16)


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_reference_equals_the_per_expert_loop(num_tokens):
    gen = torch.Generator().manual_seed(7 + num_tokens)
    e, h, inter, k = 12, 48, 40, 3
    x = torch.randn(num_tokens, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, inter, generator=gen) / inter**0.5
    ids, weights = _routing(num_tokens, e, k, gen)
    want = experts_by_expert(x, w13, w2, ids, weights)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, ids, weights), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, hidden, inter",
    [(1, 8, 2, 64, 32), (7, 6, 3, 72, 40), (24, 16, 4, 64, 96)],
)
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_triton_equals_reference(num_tokens, num_experts, top_k, hidden, inter, dtype):
    gen = torch.Generator().manual_seed(num_tokens * 31 + hidden)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    ids, weights = _routing(num_tokens, num_experts, top_k, gen)
    want = fused_moe_ref(x, w13, w2, ids, weights)  # float32 reference
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
    args = [
        t.to(device) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights.to(dtype))
    ]
    got = fused_moe_triton(*args).float().cpu()
    # float32 accumulation in both; 16-bit inputs and the stored intermediate round
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_moe_block_compiles_whole_with_the_fused_op():
    """A compiled MoE block (one graph, fullgraph) calls the fused op and gives the
    eager block's result, for token counts whose routings differ."""
    from transformers import Qwen3MoeConfig

    from cluster.parallel import ParallelState

    config = Qwen3MoeConfig(
        hidden_size=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16
    )
    block = SparseMoeBlock(config, ParallelState.single(), torch.float32)
    gen = torch.Generator().manual_seed(3)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    for n in (1, 3, 8):
        x = torch.randn(n, 32, generator=gen)
        top_ids, top_weights = block.route(x)
        want = experts_by_expert(x, block.w13, block.w2, top_ids, top_weights)
        torch.testing.assert_close(compiled(x), want, atol=1e-5, rtol=1e-5)


def _fp8_experts(w13: torch.Tensor, w2: torch.Tensor, block: int):
    """(float8 w13, float8 w2, FP8Experts, dequantised w13, dequantised w2): each expert's
    gate, up and down matrices quantised in `block` x `block` blocks as checkpoints are."""
    from tiny_models import quantize_fp8_blocks

    from cluster.kernels.fp8_format import FP8Experts

    inter = w13.shape[1] // 2
    q13, s13, q2, s2, d13, d2 = [], [], [], [], [], []
    for e in range(w13.shape[0]):
        parts = [quantize_fp8_blocks(w, block) for w in (w13[e, :inter], w13[e, inter:])]
        q13.append(torch.cat([q for q, _ in parts]))
        s13.append(torch.cat([s for _, s in parts]))
        q, s = quantize_fp8_blocks(w2[e], block)
        q2.append(q)
        s2.append(s)
        for out, (qq, ss) in ((d13, parts[0]), (d13, parts[1]), (d2, (q, s))):
            rows = torch.arange(qq.shape[0])[:, None] // block
            cols = torch.arange(qq.shape[1])[None, :] // block
            out.append(qq.float() * ss[rows, cols])
    d13 = [torch.cat(d13[2 * e : 2 * e + 2]) for e in range(w13.shape[0])]
    fp8 = FP8Experts(torch.stack(s13), torch.stack(s2), (block, block))
    return torch.stack(q13), torch.stack(q2), fp8, torch.stack(d13), torch.stack(d2)


def _fake_quantised(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as FP8 compute sees it: quantised per row and `group` columns, dequantised."""
    from cluster.kernels.fp8_linear import quantize_activations_ref

    x_q, scale = quantize_activations_ref(x, group)
    return x_q.float() * scale.repeat_interleave(group, dim=1)[:, : x.shape[1]]


def test_fp8_experts_reference_is_fake_quantised_activations_on_dequantised_weights():
    """FP8 experts (weights float8 + block scales, activations quantised per row and 16
    columns before each projection) equal, to float32 rounding, the per-expert loop on the
    dequantised weights with the same activation rounding written out; and stay within
    the quantisation's error of the unquantised experts."""
    gen = torch.Generator().manual_seed(11)
    e, h, inter, k, block = 6, 48, 32, 2, 16  # hidden not a multiple of the block
    x = torch.randn(9, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, inter, generator=gen) / inter**0.5
    ids, weights = _routing(9, e, k, gen)
    q13, q2, fp8, d13, d2 = _fp8_experts(w13, w2, block)
    got = fused_moe_ref(x, q13, q2, ids, weights, fp8)
    want = torch.zeros_like(x)
    for t in range(9):
        for j, expert in enumerate(ids[t].tolist()):
            row = _fake_quantised(x[t : t + 1], block)
            gate, up = (row @ d13[expert].T).chunk(2, dim=-1)
            hidden = _fake_quantised(torch.nn.functional.silu(gate) * up, block)
            want[t] += weights[t, j] * (hidden @ d2[expert].T)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    plain = fused_moe_ref(x, w13, w2, ids, weights)
    assert (got - plain).norm() / plain.norm() < 0.1  # e4m3's 3 mantissa bits, twice


@pytest.mark.parametrize("num_tokens, hidden, inter", [(1, 64, 32), (13, 96, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_fp8_experts_triton_equals_reference(num_tokens, hidden, inter, dtype):
    gen = torch.Generator().manual_seed(num_tokens + hidden)
    e, k, block = 8, 3, 32
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(e, hidden, inter, generator=gen) / inter**0.5
    ids, weights = _routing(num_tokens, e, k, gen)
    q13, q2, fp8, _, _ = _fp8_experts(w13, w2, block)
    weights = weights.to(dtype)
    want = fused_moe_ref(x, q13, q2, ids, weights, fp8).float()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    on = [t.to(device) for t in (x, q13, q2, ids, weights)]
    fp8_on = type(fp8)(fp8.w13_scale.to(device), fp8.w2_scale.to(device), fp8.block)
    got = fused_moe_triton(*on, fp8_on).float().cpu()
    # both sum float32 products of the same quantised operands; 16-bit outputs round, and
    # CUDA's FP8 tensor cores add each block's products at reduced precision
    tol = 1e-4 if dtype == torch.float32 and device == "cpu" else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def _fp8_block(config, tp: int, rank: int):
    from cluster.parallel import ParallelState

    state = ParallelState(rank, tp, 0, 1, None, torch.device("cpu"))
    return SparseMoeBlock(config, state, torch.float32)


def test_fp8_experts_shard_with_their_scales_over_tensor_parallel_ranks():
    """TP=2 without processes: each rank loads its slice of every expert's float8 weights
    and of their block scales; the ranks' partial sums add up to the unsharded block's
    output. A slice that is not whole blocks is refused by name."""
    from tiny_models import quantize_fp8_blocks
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64
    )
    gen = torch.Generator().manual_seed(5)
    full = {}
    for e in range(4):
        for name, shape in (("gate", (64, 32)), ("up", (64, 32)), ("down", (32, 64))):
            full[e, name] = quantize_fp8_blocks(torch.randn(shape, generator=gen) * 0.2, 16)
    blocks = [_fp8_block(config, 1, 0)] + [_fp8_block(config, 2, r) for r in (0, 1)]
    for block in blocks:
        block.use_fp8_experts((16, 16))
        block.gate.weight.data.copy_(torch.randn(4, 32, generator=torch.Generator().manual_seed(1)))
        for e in range(4):
            for part, name in enumerate(("gate", "up")):
                w, s = full[e, name]
                block.w13.weight_loader(block.w13, w, (e, part))
                block.w13_scale_inv.weight_loader(block.w13_scale_inv, s, (e, part))
            w, s = full[e, "down"]
            block.w2.weight_loader(block.w2, w, e)
            block.w2_scale_inv.weight_loader(block.w2_scale_inv, s, e)
    assert blocks[1].w13.dtype == torch.float8_e4m3fn and blocks[1].w13.shape == (4, 64, 32)
    x = torch.randn(6, 32, generator=gen)
    whole = blocks[0].experts(x)
    torch.testing.assert_close(blocks[1].experts(x) + blocks[2].experts(x), whole)
    misaligned = Qwen3MoeConfig(
        hidden_size=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48
    )
    with pytest.raises(ValueError, match="24 rows per rank, not whole 16x16 FP8 blocks"):
        _fp8_block(misaligned, 2, 0).use_fp8_experts((16, 16))
