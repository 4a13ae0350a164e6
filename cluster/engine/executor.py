"""The executor interface between the engine core and its workers.

The core calls these methods only; where the workers run (this process, spawned
processes, Ray actors) is the implementation's business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from cluster.engine.messages import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    @abstractmethod
    def available_kv_blocks(self) -> int:
        """KV blocks that fit on every worker (the minimum over ranks)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_health(self) -> None:  # noqa: B027 (healthy unless an executor can tell)
        """Raise when a worker is dead or unresponsive."""

    @abstractmethod
    def shutdown(self) -> None: ...
