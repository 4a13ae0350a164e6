"""Tensor-parallel layers at TP=2 (two gloo processes) equal the unsharded maths."""

import pytest
import torch
import torch.nn.functional as F
from tp_workers import layer_outputs, spawn_ranks

from cluster.parallel import (
    ColumnParallelLinear,
    ParallelState,
    QKVParallelLinear,
    VocabParallelEmbedding,
)


@pytest.fixture(scope="module")
def full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return dict(
        x=r(5, 16),
        w=r(12, 16),
        b=r(12),
        w_row=r(16, 12),
        b_row=r(16),
        x_row=r(5, 12),
        gate=r(8, 16),
        up=r(8, 16),
        q=r(8, 16),
        k=r(2, 16),
        v=r(2, 16),
        emb=r(11, 16),
        ids=torch.tensor([0, 3, 5, 6, 10, 7]),
    )


@pytest.fixture(scope="module")
def tp2_outputs(full_weights):
    return spawn_ranks(layer_outputs, 2, args=(2, full_weights))


def test_linear_layers_match_unsharded(tp2_outputs, full_weights):
    fw = full_weights
    x = fw["x"]
    for rank_out in tp2_outputs:
        torch.testing.assert_close(rank_out["replicated"], F.linear(x, fw["w"], fw["b"]))
        torch.testing.assert_close(rank_out["column"], F.linear(x, fw["w"], fw["b"]))
        # The bias is added exactly once across the reduction.
        torch.testing.assert_close(rank_out["row"], F.linear(fw["x_row"], fw["w_row"], fw["b_row"]))
        torch.testing.assert_close(rank_out["gate"], x @ fw["gate"].T)
        torch.testing.assert_close(rank_out["up"], x @ fw["up"].T)
        torch.testing.assert_close(rank_out["q"], x @ fw["q"].T)
        # One KV head, replicated on both ranks.
        torch.testing.assert_close(rank_out["k"], x @ fw["k"].T)
        torch.testing.assert_close(rank_out["v"], x @ fw["v"].T)


def test_vocab_parallel_embedding_and_head(tp2_outputs, full_weights):
    fw = full_weights
    for rank_out in tp2_outputs:
        # vocab 11 is padded to 12 across two ranks; the padding never shows.
        torch.testing.assert_close(rank_out["embedding"], F.embedding(fw["ids"], fw["emb"]))
        assert rank_out["logits"].shape == (5, 11)
        torch.testing.assert_close(rank_out["logits"], fw["x"] @ fw["emb"].T)


def test_collectives(tp2_outputs, full_weights):
    x = full_weights["x"]
    torch.testing.assert_close(tp2_outputs[0]["gather"], torch.cat([x, 2 * x], dim=0))
    assert tp2_outputs[1]["gather"].numel() == 0
    torch.testing.assert_close(tp2_outputs[1]["recv"], x)


def test_single_rank_layers_and_errors():
    state = ParallelState.single()
    col = ColumnParallelLinear(4, 6, state)
    with pytest.raises(
        ValueError, match=r"checkpoint shape \(5, 4\) has 5 in dim 0; the model expects 6"
    ):
        col.weight.weight_loader(col.weight, torch.zeros(5, 4))
    # A larger tensor than the model's whole weight would fill rank 0's slice: refused.
    rank0 = ColumnParallelLinear(4, 6, ParallelState(0, 2, 0, 1))
    with pytest.raises(ValueError, match=r"has 10 in dim 0; the model expects 6 \(.* of 3 each"):
        rank0.weight.weight_loader(rank0.weight, torch.zeros(10, 4))
    qkv = QKVParallelLinear(8, 2, 4, 2, ParallelState(1, 2, 0, 1))
    with pytest.raises(ValueError, match="has 6 in dim 0; the model expects 4"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(6, 8), "k")
    with pytest.raises(ValueError, match="must divide num_key_value_heads=3"):
        QKVParallelLinear(8, 2, 6, 3, ParallelState(0, 2, 0, 1))
    emb = VocabParallelEmbedding(7, 3, state)
    with pytest.raises(ValueError, match="does not match vocab_size=7"):
        emb.weight.weight_loader(emb.weight, torch.zeros(8, 3))
