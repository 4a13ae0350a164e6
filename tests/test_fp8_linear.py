"""Block-scaled FP8 linear (`cluster.kernels.fp8_linear`): the Triton kernels (interpreter on
CPU, native float8 `tl.dot` on CUDA) equal the torch reference, the reference is within the
activation-quantisation error of the dequantised float32 product, and FP8 linear layers
shard weights and block scales alike at TP=2 (ranks built without processes), refusing a
shard that cuts through a block."""

import pytest
import torch
from tiny_models import quantize_fp8_blocks

from cluster.kernels.fp8_linear import (
    fp8_compute_supported,
    fp8_linear,
    fp8_linear_ref,
    quantize_activations_ref,
)
from cluster.kernels.fp8_linear_triton import fp8_linear_triton, quantize_activations_triton
from cluster.models.fp8 import dequantize_blocks
from cluster.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelState,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from cluster.parallel.weights import LazyTensor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
BLOCK = (128, 128)
SHAPES = [(256, 384), (300, 256), (130, 200)]  # (N, K): N and K off the 128 grid too


def _problem(m, n, k, seed, dtype=torch.float32):
    """x [m, k] whose column groups differ in magnitude, an FP8 weight [n, k] whose blocks'
    scales span two decades (a scale applied to the wrong block or group shows), a bias."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // 128)
    x = torch.randn(m, k, generator=g) * torch.rand(groups, generator=g).repeat_interleave(128)[:k]
    w = torch.randn(n, k, generator=g).clamp(-4, 4) * 100
    scales = 10 ** -(1 + 2 * torch.rand(-(-n // 128), groups, generator=g))
    return x.to(dtype), w.to(torch.float8_e4m3fn), scales, torch.randn(n, generator=g)


def _on(*tensors):
    return [t.to(DEVICE) for t in tensors]


def _abs_products(x, w, scales):
    """[m, n]: sum over k of |x_q * x_scale| * |w * w_scale|, which bounds how far two
    float32 summation orders (or the tensor cores' accumulation) can drift apart."""
    x_q, x_scale = quantize_activations_ref(x, 128)
    dense_x = x_q.float() * x_scale.repeat_interleave(128, dim=1)[:, : x.shape[1]]
    return dense_x.abs() @ dequantize_blocks(w, scales, BLOCK).abs().T


# |triton - ref| <= ACCUMULATION * _abs_products: float32 sums in the interpreter; on CUDA
# Hopper's FP8 tensor cores accumulate each 128-column group in reduced (~14-bit) precision
# before the float32 promotion per group (as DeepSeek-V3's and vLLM's kernels do).
ACCUMULATION = 2**-11 if DEVICE == "cuda" else 2**-20


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantiser_triton_equals_reference(m, dtype):
    """Bit for bit: same scales, same float8 values (round to nearest even)."""
    x = (torch.randn(m, 300, generator=torch.Generator().manual_seed(m)) * 50).to(dtype)
    x[0, 128:256] = 0  # an all-zero group: zeros and a tiny finite scale
    want_q, want_s = quantize_activations_ref(x, 128)
    got_q, got_s = quantize_activations_triton(*_on(x), 128)
    assert got_q.dtype == torch.float8_e4m3fn and got_s.shape == (m, 3)
    assert torch.equal(got_s.cpu(), want_s)
    assert torch.equal(got_q.cpu().float(), want_q.float())
    assert torch.equal(want_q[0, 128:256].float(), torch.zeros(128))


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("n,k", SHAPES)
def test_triton_equals_reference(m, n, k):
    """float32 out: the same products and scales, only each group's 128-term sum is
    accumulated differently (`ACCUMULATION`)."""
    x, w, scales, bias = _problem(m, n, k, seed=m * n + k)
    bound = ACCUMULATION * _abs_products(x, w, scales)
    for b in (None, bias):
        want = fp8_linear_ref(x, w, scales, b, BLOCK)
        got = fp8_linear_triton(*_on(x, w, scales), None if b is None else b.to(DEVICE), BLOCK)
        assert ((got.cpu() - want).abs() <= bound).all()


def test_a_rows_result_does_not_depend_on_the_batch():
    """Batch invariance: the same bits for a token alone, in 5 and in 33 tokens."""
    x, w, scales, bias = _problem(33, 300, 256, seed=11, dtype=torch.bfloat16)
    x, w, scales, bias = _on(x, w, scales, bias)
    full = fp8_linear_triton(x, w, scales, bias, BLOCK)
    for m in (1, 5):
        assert torch.equal(fp8_linear_triton(x[:m], w, scales, bias, BLOCK), full[:m])


def test_triton_bf16_rounds_like_reference():
    """bfloat16 out: the float32 results above, each rounded once (one bf16 ulp apart at
    most, 2**-7 of the value)."""
    x, w, scales, bias = _problem(5, 300, 256, seed=7, dtype=torch.bfloat16)
    want = fp8_linear_ref(x, w, scales, bias, BLOCK).float()
    got = fp8_linear_triton(*_on(x, w, scales, bias), BLOCK).cpu()
    assert got.dtype == torch.bfloat16
    bound = ACCUMULATION * _abs_products(x, w, scales) + 2**-7 * want.abs()
    assert ((got.float() - want).abs() <= bound).all()


@pytest.mark.parametrize("n,k", SHAPES)
def test_reference_is_within_activation_quantisation_error(n, k):
    """Against x @ dequantised(w).T in float32: each activation moves by at most 2**-4 of
    itself (e4m3's half ulp) or 2**-10 of its group's scale (subnormals), so every output
    element is within 2**-4 |x| @ |w|.T + 2**-10 s @ |w|.T (plus float32 slack); on these
    random data the error is ~2.5% of the output's norm, asserted < 5%. A scale applied to
    the wrong block, row group or column group breaks both by orders of magnitude."""
    x, w, scales, bias = _problem(33, n, k, seed=n + k)
    dense = dequantize_blocks(w, scales, BLOCK)  # [n, k] float32
    got = fp8_linear_ref(x, w, scales, bias, BLOCK)
    want = x @ dense.T + bias
    _, x_scale = quantize_activations_ref(x, 128)
    group_scale = x_scale.repeat_interleave(128, dim=1)[:, :k]  # [33, k]
    bound = (2**-4 * x.abs() + 2**-10 * group_scale) @ dense.abs().T
    assert ((got - want).abs() <= bound * (1 + 1e-4) + 1e-5).all()
    assert (got - want).norm() / want.norm() < 0.05


def test_dispatch_and_device_support():
    x, w, scales, bias = _problem(3, 130, 200, seed=1)
    want = fp8_linear_ref(x, w, scales, bias, BLOCK)
    assert torch.equal(fp8_linear(x, w, scales, bias, BLOCK, backend="torch"), want)
    assert torch.equal(fp8_linear(x, w, scales, bias, BLOCK), want)  # auto on CPU: torch
    assert fp8_linear(x[None], w, scales, bias, BLOCK).shape == (1, 3, 130)
    assert not fp8_compute_supported("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_layer_sized_problem():
    """A DeepSeek-V3-sized projection in bfloat16 (native FP8 tensor cores on >= sm_89)."""
    x, w, scales, _ = _problem(64, 1536, 7168, seed=3, dtype=torch.bfloat16)
    got = fp8_linear(*_on(x, w, scales), block=BLOCK).float().cpu()
    want = fp8_linear_ref(x, w, scales, block=BLOCK).float()
    bound = ACCUMULATION * _abs_products(x, w, scales) + 2**-7 * want.abs()
    assert ((got - want).abs() <= bound).all()


def _lazy(name, full, reads):
    """`full` as a checkpoint tensor that records the shape of every read."""

    def read(slices):
        reads.append(full[slices].shape)
        return full[slices].clone()

    return LazyTensor(name, tuple(full.shape), read)


def _fp8_pieces(rows, cols, block, seed):
    g = torch.Generator().manual_seed(seed)
    return quantize_fp8_blocks(torch.randn(rows, cols, generator=g), block)


def test_tp2_shards_weights_and_scales_alike():
    """Each rank reads only its slice of the weight and of the scales, and its FP8 output
    is its share of the unsharded FP8 layer's (column: its rows; row: a summand)."""
    block, blocks = 32, (32, 32)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    layers = {
        "column": lambda s: ColumnParallelLinear(128, 192, s),
        "row": lambda s: RowParallelLinear(128, 96, s),
        "merged": lambda s: MergedColumnParallelLinear(128, [64, 128], s),
        "qkv": lambda s: QKVParallelLinear(128, 32, 4, 2, s),
        "replicated": lambda s: ReplicatedLinear(128, 80, s),
    }
    parts = {"merged": [(0, 64), (1, 128)], "qkv": [("q", 128), ("k", 64), ("v", 64)]}
    for name, make in layers.items():
        pieces = parts.get(name, [(None, layers[name](ParallelState.single()).weight.shape[0])])
        full = [_fp8_pieces(rows, 128, block, seed=i) for i, (_, rows) in enumerate(pieces)]
        want = torch.cat([fp8_linear_ref(x, w, s, None, blocks) for w, s in full], dim=1)
        outs, reads = [], []
        for rank in range(2):
            layer = make(ParallelState(rank, 2, 0, 1))
            layer.use_fp8_weight(blocks)
            for (shard_id, _), (w, s) in zip(pieces, full, strict=True):
                for param, t in ((layer.weight, w), (layer.weight_scale_inv, s)):
                    args = () if shard_id is None else (shard_id,)
                    param.weight_loader(param, _lazy(f"{name}.w", t, reads), *args)
            assert layer.weight.dtype == torch.float8_e4m3fn
            x_local = x.chunk(2, dim=1)[rank] if name == "row" else x
            outs.append(layer.matmul(x_local, None))
        if name == "row":
            torch.testing.assert_close(outs[0] + outs[1], want, atol=1e-5, rtol=1e-5)
            assert all(tuple(r)[1] in (64, 2) for r in reads)  # half the columns, 2 blocks
        elif name == "replicated":
            assert all(torch.equal(out, want) for out in outs)
        elif name == "merged":  # [gate_r, up_r] on each rank
            for rank, out in enumerate(outs):
                gate, up = want.split([64, 128], dim=1)
                expect = torch.cat([gate.chunk(2, 1)[rank], up.chunk(2, 1)[rank]], dim=1)
                torch.testing.assert_close(out, expect, atol=1e-6, rtol=1e-6)
        elif name == "qkv":  # 2 of 4 query heads, one of 2 KV heads, on each rank
            q, k, v = want.split([128, 64, 64], dim=1)
            for rank, out in enumerate(outs):
                expect = torch.cat([t.chunk(2, 1)[rank] for t in (q, k, v)], dim=1)
                torch.testing.assert_close(out, expect, atol=1e-6, rtol=1e-6)
        else:
            torch.testing.assert_close(torch.cat(outs, dim=1), want, atol=1e-6, rtol=1e-6)


def test_misaligned_shard_is_refused():
    """96 rows / 96 columns over 2 ranks are 48 each: not whole blocks of 32."""
    w, s = _fp8_pieces(96, 64, 32, seed=1)
    column = ColumnParallelLinear(64, 96, ParallelState(1, 2, 0, 1))
    column.use_fp8_weight((32, 32))
    with pytest.raises(ValueError, match=r"q_proj.weight: .*shard of 48 rows .*blocks of 32"):
        column.weight.weight_loader(column.weight, _lazy("q_proj.weight", w, []))
    with pytest.raises(ValueError, match=r"shard of 48 rows"):
        column.weight_scale_inv.weight_loader(column.weight_scale_inv, _lazy("s", s, []))
    w, s = _fp8_pieces(64, 96, 32, seed=2)
    row = RowParallelLinear(96, 64, ParallelState(0, 2, 0, 1))
    row.use_fp8_weight((32, 32))
    with pytest.raises(ValueError, match=r"o_proj.weight: .*shard of 48 columns .*blocks of 32"):
        row.weight.weight_loader(row.weight, _lazy("o_proj.weight", w, []))
