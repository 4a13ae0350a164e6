"""Prepacked bfloat16 linear layers (`cluster.kernels.packed_linear`) against `F.linear`.

Packing must change speed only: every row of a packed product equals the row of a plain
two-row product bit for bit, at every row count (batch invariance rests on it; on AMX
CPUs through row blocks), for the shapes of the
default model's layers; layers pack once and keep their outputs; training (autograd) and
other dtypes take the reference path.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from cluster.kernels.packed_linear import (
    can_pack,
    cpu_can_pack_bf16,
    linear,
    pack_weight,
    row_blocks,
)
from cluster.parallel import ParallelState
from cluster.parallel.embedding import ParallelLMHead
from cluster.parallel.linear import MergedColumnParallelLinear, RowParallelLinear, pack_linears

needs_bf16_onednn = pytest.mark.skipif(
    not cpu_can_pack_bf16(), reason="this torch has no oneDNN bfloat16 support on this CPU"
)

# SmolLM2's layers: qkv, o, gate+up, down, and the LM head (a slice of its vocabulary).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576)]
ROW_COUNTS = [1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 33, 64, 65, 128, 200]


@needs_bf16_onednn
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_packed_rows_equal_plain_rows_at_every_row_count(shape):
    gen = torch.Generator().manual_seed(shape[0] + shape[1])
    weight = torch.randn(*shape, generator=gen).bfloat16()
    bias = torch.randn(shape[0], generator=gen).bfloat16()
    packed = pack_weight(weight)
    rows_max = max(ROW_COUNTS)
    x = torch.randn(rows_max + 1, shape[1], generator=gen).bfloat16()
    # each row's reference: computed in a plain 2-row product (no matrix-vector case)
    want = torch.cat([F.linear(x[i : i + 2], weight, bias)[:1] for i in range(rows_max)])
    for rows in ROW_COUNTS:
        got = linear(x[:rows], weight, bias, packed)
        assert torch.equal(got, want[:rows]), f"{rows} rows"


def test_row_blocks_cover_the_rows_without_a_lone_row():
    for rows in [1, 2, 31, 32, 33, 64, 65, 97, 200]:
        blocks = row_blocks(rows, 32)
        assert blocks[0][0] == 0 and blocks[-1][1] == rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
        assert all(1 <= end - start <= 32 for start, end in blocks)
        assert rows == 1 or all(end - start >= 2 for start, end in blocks)


@needs_bf16_onednn
def test_layers_pack_once_and_keep_their_outputs():
    state = ParallelState.single()
    gate_up = MergedColumnParallelLinear(64, [96, 96], state, False, torch.bfloat16)
    down = RowParallelLinear(96, 64, state, True, dtype=torch.bfloat16)
    head = ParallelLMHead(500, 64, state, dtype=torch.bfloat16)
    model = torch.nn.ModuleList([gate_up, down, head])
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(5, 64, generator=gen).bfloat16()
    h = torch.randn(5, 96, generator=gen).bfloat16()
    before = [gate_up(x), down(h), head(x)]
    assert pack_linears(model) == 3
    assert all(m.packed_weight is not None for m in model)
    for a, b in zip(before, [gate_up(x), down(h), head(x)], strict=True):
        assert torch.equal(a, b)


def test_the_reference_path_serves_everything_else():
    weight = torch.randn(8, 4)
    assert not can_pack(weight)  # float32
    assert not can_pack(torch.randn(2, 8, 4).bfloat16())  # not a matrix
    x = torch.randn(3, 4, requires_grad=True)
    with torch.enable_grad():
        y = linear(x, weight, None, None)
        y.sum().backward()
    assert x.grad is not None and torch.equal(y, F.linear(x, weight))
    state = ParallelState.single()
    layer = RowParallelLinear(4, 8, state, False, dtype=torch.float32)
    assert pack_linears(layer) == 0 and layer.packed_weight is None


@needs_bf16_onednn
def test_a_compiled_graph_runs_the_row_blocks_as_one_opaque_op():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(576, 576, generator=gen).bfloat16()
    packed = pack_weight(weight)
    step = lambda x: F.silu(linear(x, weight, None, packed))  # noqa: E731
    graph = torch.compile(step, dynamic=True, fullgraph=True)  # a graph break fails
    x = torch.randn(100, 576, generator=gen).bfloat16()
    want = F.silu(torch.cat([F.linear(x[i : i + 2], weight)[:1] for i in range(100)]))
    with torch.no_grad():
        for rows in (2, 33, 100):
            assert torch.equal(graph(x[:rows]), want[:rows]), f"{rows} rows"
