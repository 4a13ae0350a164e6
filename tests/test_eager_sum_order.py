"""The compiled RMSNorm sums its squares in ATen's order (`cluster.kernels.eager_sum_order`):
the emulated row sum equals `torch.sum` bit for bit, eagerly and compiled, and a compiled
bfloat16 norm equals the eager one on rows with one dominant value (a late SmolLM2 layer's
shape), where inductor's own reduction order does not."""

import pytest
import torch

from cluster.kernels.eager_sum_order import aten_row_sum, cpu_sum_width
from cluster.kernels.rmsnorm import rms_norm_ref


def _squares(rows: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=gen)
    x[:, d // 3] *= 4000.0
    return x * x


def test_this_torch_build_has_a_sum_width():
    assert cpu_sum_width() in (4, 8, 16, 32)


@pytest.mark.parametrize("d", [8, 20, 64, 576, 960, 1000, 2048, 4103, 8192])
def test_emulated_row_sum_is_torch_sum_bit_for_bit(d):
    width = cpu_sum_width()
    for rows in (1, 3, 64):
        x = _squares(rows, d, seed=d + rows)
        assert torch.equal(aten_row_sum(x, width), x.sum(-1)), (rows, d)


def test_compiled_emulated_row_sum_keeps_the_order():
    width = cpu_sum_width()
    compiled = torch.compile(lambda x: aten_row_sum(x, width), dynamic=True, fullgraph=True)
    for rows in (2, 37):
        x = _squares(rows, 576, seed=rows)
        assert torch.equal(compiled(x), x.sum(-1))


def test_compiled_bfloat16_norm_equals_eager_where_inductors_order_differs():
    gen = torch.Generator().manual_seed(0)
    rows, d = 256, 576
    x = (torch.randn(rows, d, generator=gen) * 40).bfloat16()
    residual = torch.randn(rows, d, generator=gen).bfloat16() * 20
    residual[:, 7] = 24000.0  # the massive activation late layers carry
    weight = (torch.rand(d, generator=gen) + 0.5).bfloat16()
    want = rms_norm_ref(x, weight, 1e-5, residual)

    def norm(width):
        fn = lambda x, w, r: rms_norm_ref(x, w, 1e-5, r, sum_width=width)  # noqa: E731
        with torch._inductor.config.patch(emulate_precision_casts=True):
            return torch.compile(fn, dynamic=True, fullgraph=True)(x, weight, residual)

    got = norm(cpu_sum_width())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # inductor's own reduction order rounds some of these rows differently: the data
    # exercises what the emulation fixes
    plain = norm(None)
    assert not torch.equal(plain[0], want[0])
