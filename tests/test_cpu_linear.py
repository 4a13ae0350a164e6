"""The C bfloat16 linear kernel (`cluster.kernels.cpu_linear`) against its torch reference.

`linear_ref` emulates the kernel's order of operations in float32 adds, so the two must
agree bit for bit on every shape: output tails that are not a multiple of the 32-output
block, one K chunk, chunks of 512 and of 1024 inputs, with and without a bias. The
product must also be close to a float64 product (the emulation is not wrong too), every
row the same bits alone or in any batch and with any thread count, and, on a CPU where
`packed_linear` picks it, equal to oneDNN's product (which `test_packed_linear.py` checks
against `F.linear` at every row count).
"""

import pytest
import torch
import torch.nn.functional as F

from cluster.kernels import cpu_linear, packed_linear
from cluster.kernels.cpu_isa import cpu_has_amx

needs_kernel = pytest.mark.skipif(
    cpu_linear.load() is None, reason="no AVX-512 BF16 or AVX2 here, or the C kernel did not build"
)

# (out, in): tails of 1, 16 and 31 outputs; K in one chunk, chunks of 512, chunks of 1024
SHAPES = [(33, 64), (48, 130), (95, 576), (64, 1100), (40, 2050)]


def _data(out_features, in_features, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    return weight, bias, x


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_kernel_equals_its_torch_reference_bit_for_bit(shape):
    weight, bias, x = _data(*shape, rows=9, seed=shape[0] * shape[1])
    packed = cpu_linear.pack(weight)
    for b in (None, bias):
        got = cpu_linear.linear(x, packed, b, shape[0])
        assert got.shape == (9, shape[0]) and got.dtype == torch.bfloat16
        assert torch.equal(got, cpu_linear.linear_ref(x, weight, b)), f"bias={b is not None}"
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        torch.testing.assert_close(got.double(), exact, atol=2e-2, rtol=1e-2)


@needs_kernel
def test_a_row_is_the_same_bits_alone_in_a_batch_and_on_any_thread_count():
    weight, bias, x = _data(200, 1536, rows=37, seed=5)
    packed = cpu_linear.pack(weight)
    batch = cpu_linear.linear(x, packed, bias, 200)
    for i in (0, 3, 4, 36):
        assert torch.equal(cpu_linear.linear(x[i : i + 1], packed, bias, 200), batch[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_linear.linear(x, packed, bias, 200), batch)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_zero_rows_and_bad_inputs():
    weight, _, x = _data(64, 64, rows=2, seed=1)
    packed = cpu_linear.pack(weight)
    assert cpu_linear.linear(x[:0], packed, None, 64).shape == (0, 64)
    with pytest.raises(ValueError, match="inputs"):
        cpu_linear.linear(torch.zeros(2, 66, dtype=torch.bfloat16), packed, None, 64)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        cpu_linear.linear(x.float(), packed, None, 64)
    assert not cpu_linear.supports(torch.zeros(8, 65, dtype=torch.bfloat16))  # odd K
    assert not cpu_linear.supports(torch.zeros(8, 64))  # float32


@needs_kernel
@pytest.mark.skipif(not packed_linear.cpu_can_pack_bf16(), reason="no oneDNN bfloat16 here")
def test_packing_picks_the_kernel_only_where_it_reproduces_onednn():
    # SmolLM2's qkv and down projections
    for shape in [(960, 576), (576, 1536)]:
        weight, bias, x = _data(*shape, rows=16, seed=shape[0])
        packed = packed_linear.pack_weight(weight)
        ours = packed_linear.reproduces_onednn(*shape)
        assert packed.is_mkldnn != ours
        if not cpu_has_amx():  # AVX-512 BF16 alone: oneDNN runs the kernel's order
            assert ours, f"{shape}: the kernel no longer reproduces this oneDNN"
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, packed_linear.PACK_ROWS_HINT)
        got = packed_linear.linear(x, weight, bias, packed)
        assert torch.equal(got, packed_linear.packed_product(x, onednn, bias, shape[0]))


@needs_kernel
def test_without_onednn_bfloat16_every_bfloat16_weight_takes_the_kernel(monkeypatch):
    # as on AVX2 CPUs (AMD Zen 3): oneDNN has no bfloat16 product there
    monkeypatch.setattr(packed_linear, "cpu_can_pack_bf16", lambda: False)
    weight, bias, x = _data(100, 576, rows=5, seed=3)
    assert packed_linear.can_pack(weight)
    packed = packed_linear.pack_weight(weight)
    assert not packed.is_mkldnn
    got = packed_linear.linear(x, weight, bias, packed)
    assert torch.equal(got, cpu_linear.linear_ref(x, weight, bias))
    assert not packed_linear.can_pack(weight.float())
    with pytest.raises(ValueError, match="no oneDNN bfloat16"):
        packed_linear.pack_weight(weight, kernel="onednn")


def test_a_failed_build_packs_for_onednn(failing_c_compiler):
    assert cpu_linear.load() is None
    weight = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert not cpu_linear.supports(weight)
    if packed_linear.cpu_can_pack_bf16():
        assert packed_linear.pack_weight(weight).is_mkldnn
