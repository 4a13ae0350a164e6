"""Sampling: the vectorised `Sampler` and the lossless `RejectionSampler` (draft trees and
chains) in front of the rejection kernel."""

from cluster.sample.logprobs import Logprobs, compute_logprobs
from cluster.sample.metadata import LogitsRows, Penalties, SamplingMetadata
from cluster.sample.rejection import (
    RejectionSampler,
    RejectionSamplerOutput,
    rejection_sample,
)
from cluster.sample.sampler import Sampler, SamplerOutput
from cluster.sample.spec_metadata import SpecDecodeMetadata

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
