"""`run_rejection`: one rejection-sampling step on validated `RejectionInputs`, as Triton
or torch (the maths and the glossary are in `rejection_ref.py`). The sampler that
builds the inputs is `cluster/sample/rejection.py`."""

from __future__ import annotations

import torch

from cluster.kernels.backend import use_triton
from cluster.kernels.rejection_ref import RejectionInputs, rejection_sample_ref


def run_rejection(inputs: RejectionInputs, backend: str = "auto") -> torch.Tensor:
    """[batch, max_spec_len + 1] int64 output tokens, PLACEHOLDER_TOKEN_ID after the last."""
    if use_triton(backend, inputs.target_probs.device):
        from cluster.kernels.rejection_triton import rejection_sample_triton

        return rejection_sample_triton(inputs)
    return rejection_sample_ref(inputs)
