"""Sampling: the vectorised `Sampler` and the lossless `RejectionSampler` in front of the kernels."""

from cluster.sample.logprobs import Logprobs, compute_logprobs
from cluster.sample.metadata import LogitsRows, Penalties, SamplingMetadata, SpecDecodeMetadata
from cluster.sample.rejection import (
    RejectionSampler,
    RejectionSamplerOutput,
    rejection_sample,
)
from cluster.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "LogitsRows",
    "Logprobs",
    "Penalties",
    "RejectionSampler",
    "RejectionSamplerOutput",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SpecDecodeMetadata",
    "compute_logprobs",
    "rejection_sample",
]
