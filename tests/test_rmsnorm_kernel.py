"""Fused add+RMSNorm: the Triton kernel (interpreter on CPU) equals the torch reference."""

import pytest
import torch

from cluster.kernels.rmsnorm import rms_norm, rms_norm_ref
from cluster.kernels.rmsnorm_triton import rms_norm_triton


@pytest.mark.parametrize("hidden", [64, 100, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_equals_reference(hidden, with_residual):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(13, hidden, generator=g)
    weight = torch.randn(hidden, generator=g)
    residual = torch.randn(13, hidden, generator=g) if with_residual else None
    want = rms_norm_ref(x, weight, 1e-5, residual)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
    on = (lambda t: t.to(device)) if device == "cuda" else (lambda t: t)
    got = rms_norm_triton(on(x), on(weight), 1e-5, None if residual is None else on(residual))
    got = tuple(t.cpu() for t in got) if with_residual else got.cpu()
    if with_residual:
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the sum is exact
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_matches_transformers_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(32, eps=1e-6)
    norm.weight.data.normal_()
    x = torch.randn(5, 32)
    residual = torch.randn(5, 32)
    out, summed = rms_norm(x, norm.weight.data, 1e-6, residual)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(out, norm(x + residual), atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_on_cuda_bf16():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    got = rms_norm(x, weight, 1e-5, residual)
    want = rms_norm_ref(x, weight, 1e-5, residual)
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1], want[1])


def test_every_kernel_validates_its_backend_the_same_way(monkeypatch):
    from cluster.kernels.backend import use_triton

    cpu = torch.device("cpu")
    assert not use_triton("auto", cpu) and not use_triton("torch", cpu)
    with pytest.raises(ValueError, match="backend must be one of"):
        rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6, backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        use_triton("triton", cpu)
