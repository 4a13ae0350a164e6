"""The executor interface between the engine core and its workers.

The core calls these methods only; where the workers run (this process, spawned
processes, Ray actors) is the implementation's business. `submit_model` lets pipeline
stages work on several steps at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from cluster.engine.messages import ModelRunnerOutput, SchedulerOutput

# The result of a step submitted with `submit_model`: call it to wait for the output.
PendingOutput = Callable[[], ModelRunnerOutput]


class Executor(ABC):
    @abstractmethod
    def available_kv_blocks(self) -> int:
        """KV blocks that fit on every worker (the minimum over ranks)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def submit_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Start a step and return at once; pending steps finish in submission order.
        Executors whose workers run elsewhere overlap steps (pipeline micro-batches);
        this default runs the step now."""
        output = self.execute_model(scheduler_output)
        return lambda: output

    def stage_timings(self) -> list[dict[str, Any]]:
        """Per rank: cumulative step and wait-for-previous-stage seconds (if known)."""
        return []

    def check_health(self) -> None:  # noqa: B027 (healthy unless an executor can tell)
        """Raise when a worker is dead or unresponsive."""

    @abstractmethod
    def shutdown(self) -> None: ...
