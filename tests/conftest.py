"""Shared test set-up: Triton kernels run in the interpreter on machines without CUDA,
and engines run eagerly unless a test compiles on purpose.

TRITON_INTERPRET must be set before any kernel module is imported, hence here.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines run eagerly unless a test asks for compile="on" (compiling is tested on purpose,
# once per module, not as a side effect of every SmolLM2 engine).
os.environ.setdefault("CLUSTER_COMPILE", "off")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The converted default model (converted once into the cache directory)."""
    from cluster.models.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture
def failing_c_compiler(monkeypatch, tmp_path):
    """Every C kernel build fails (a "compiler" that always fails, an empty kernel cache);
    the kernels' cached `load()` results are cleared before and after."""
    from cluster.kernels import cpu_attention, cpu_linear

    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("CLUSTER_KERNEL_CACHE_DIR", str(tmp_path))
    loads = (cpu_attention.load, cpu_linear.load)
    for load in loads:
        load.cache_clear()
    yield
    for load in loads:
        load.cache_clear()
