"""Fused MoE: the expert layout is a valid sort, the torch reference equals the
per-expert loop of `cluster.models.moe`, and the Triton grouped GEMMs (the interpreter on
CPU) equal the reference."""

from __future__ import annotations

import pytest
import torch

from cluster.kernels.fused_moe import fused_moe_ref
from cluster.kernels.fused_moe_triton import fused_moe_triton
from cluster.kernels.moe_layout import align_by_expert, max_slots
from cluster.models.moe import experts_by_expert

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

    from cluster.models.moe import SparseMoeBlock
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
