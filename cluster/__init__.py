"""`cluster`: a speculative-decoding LLM server for Ray Serve.

Offline use follows vLLM: `LLM(model).generate(prompts, SamplingParams(...))`.
"""

import cluster._env  # (first: inductor's cache folder, before torch fixes it)
import cluster.methods  # noqa: F401  (registers the built-in draft methods)
from cluster.llm import LLM
from cluster.outputs import CompletionOutput, RequestOutput
from cluster.sampling_params import SamplingParams
from cluster.structured_outputs import StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
