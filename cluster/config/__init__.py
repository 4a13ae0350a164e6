"""Configuration: typed, validated, frozen (pydantic v2). Every invalid value is refused
at the edge with a message naming the field.

- `engine.py`: `EngineConfig` and its parts (model, parallelism, cache, scheduler,
  compilation), and the flat engine arguments `LLM(...)` takes;
- `speculative.py`: `SpeculativeConfig`; `draft_registry.py`: the draft-method interface
  and its one table (filled from `cluster/methods/`);
- `placement.py`: where a replica's ranks run on Ray;
- `architectures.py`, `checkpoints.py`, `dtypes.py`, `hub.py`: what a checkpoint must
  satisfy, which files hold its tensors, what `dtype="auto"` resolves to, where a model
  id's files are (the Hugging Face cache).
"""

from cluster.config.engine import (
    FLAT_ENGINE_ARGS,
    CacheConfig,
    CompileConfig,
    DTypeName,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    engine_config_from_args,
    stage_layer_counts,
)
from cluster.config.speculative import SpeculativeConfig

__all__ = [
    "FLAT_ENGINE_ARGS",
    "CacheConfig",
    "CompileConfig",
    "DTypeName",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "engine_config_from_args",
    "stage_layer_counts",
]
