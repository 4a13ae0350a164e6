"""`cluster`: a speculative-decoding LLM server for Ray Serve.

The public offline API (`LLM`, `SamplingParams`) arrives with the engine; for
now the package exposes its configuration types and the target models.
"""

__version__ = "0.1.0"
