"""`dtype="auto"` resolved as vLLM resolves it (`cluster.config.dtypes`), per CPU kind and device."""

import logging
from types import SimpleNamespace

import pytest
import torch

import cluster.config.dtypes as dtypes
from cluster.config import ModelConfig


@pytest.fixture
def cpu_flags(monkeypatch):
    """Set this CPU's flags for the test (the check is cached per process: cleared here)."""

    def set_flags(flags: set[str]) -> None:
        monkeypatch.setattr(dtypes, "_cpu_flags", lambda: flags)
        dtypes.cpu_has_bf16_matmul.cache_clear()

    yield set_flags
    dtypes.cpu_has_bf16_matmul.cache_clear()


def saved_as(dtype: str | None) -> SimpleNamespace:
    return SimpleNamespace(dtype=dtype)


@pytest.mark.parametrize("flags", [{"avx512f", "avx512_bf16"}, {"amx_bf16", "amx_tile"}])
@pytest.mark.parametrize("saved", ["float32", "float16", "bfloat16", None])
def test_cpus_with_bfloat16_units_run_bfloat16(cpu_flags, flags, saved):
    cpu_flags(flags)
    assert dtypes.resolve_dtype("auto", saved_as(saved), "cpu") == torch.bfloat16


def test_cpus_without_them_run_float32_and_say_so_once(cpu_flags, caplog):
    cpu_flags({"avx2", "avx512f"})
    with caplog.at_level(logging.WARNING, logger="cluster.config.dtypes"):
        assert dtypes.resolve_dtype("auto", saved_as("bfloat16"), "cpu") == torch.float32
        assert dtypes.resolve_dtype("auto", saved_as("float32"), "cpu") == torch.float32
    assert len([r for r in caplog.records if "no bfloat16" in r.message]) == 1


@pytest.mark.parametrize(
    ("saved", "want"),
    [
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("float32", torch.bfloat16),
        (None, torch.bfloat16),
        ("torch.float16", torch.float16),
    ],
)
def test_cuda_keeps_a_16_bit_checkpoint_and_casts_float32_to_bfloat16(saved, want):
    assert dtypes.resolve_dtype("auto", saved_as(saved), "cuda") == want


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_taken_as_given(cpu_flags, name):
    cpu_flags(set())
    assert dtypes.resolve_dtype(name, saved_as("bfloat16"), "cpu") == dtypes.DTYPES[name]


def test_the_model_config_uses_the_rule(cpu_flags, smollm2_path):
    cpu_flags({"avx512_bf16"})
    assert ModelConfig(path=smollm2_path, device="cpu").torch_dtype == torch.bfloat16
    assert ModelConfig(path=smollm2_path, dtype="float32").torch_dtype == torch.float32
    cpu_flags(set())
    assert ModelConfig(path=smollm2_path, device="cpu").torch_dtype == torch.float32
