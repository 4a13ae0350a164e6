"""`EngineStats`: an engine's state and counters after its latest step, the one record
the server's back-pressure, the `/metrics` route, `LLM.get_metrics` and the benchmarks
read (`EngineCore.stats()` makes it; the scheduler actor ships it with each output batch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    # Cumulative prompt tokens looked up in the prefix cache at admission, and found there.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    last_step_s: float = 0.0  # the latest step's wall time (scheduling to its outputs)
    # The engine's speculative-decoding counters (`SpecDecodingStats.as_dict()`), cumulative.
    spec: dict[str, Any] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )
