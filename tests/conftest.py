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
