"""The executor between the engine core and its workers, written once over a `RankChannel`.

The core calls `Executor`'s methods only. The step protocol (ask every rank, take the
smallest KV block count, send each step's msgpack bytes to every rank, decode the one
reporting rank's reply) is `Executor`'s own; where the ranks run is a `RankChannel`'s
business, one per placement: `LocalRank` (this process), `ProcessRanks` (spawned local
processes), `RayRanks` (Ray actors, with compiled-graph, socket or task steps). A channel
fails fast: the first rank that dies or raises ends the call with an error naming it.
`submit_model` lets pipeline stages work on several steps at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from cluster.engine.messages import ModelRunnerOutput, SchedulerOutput

# The result of a step submitted with `submit_model`: call it to wait for the output.
PendingOutput = Callable[[], ModelRunnerOutput]
# Every rank's reply to one call, by rank: call it to wait (it raises a rank's error).
PendingReplies = Callable[[], list[Any]]


class RankChannel(ABC):
    """How calls reach the `Worker`s of one engine's ranks. Calls reach every rank in
    the order they were sent; each rank answers them in that order."""

    # The rank whose reply is a step's output (TP rank 0 of the last pipeline stage).
    output_rank: int = 0

    @abstractmethod
    def call(self, method: str, *args: Any) -> PendingReplies:
        """Send `Worker.method(*args)` to every rank."""

    def step(self, payload: bytes) -> Callable[[], bytes]:
        """Send one step's scheduler output to every rank; wait for the output rank's
        reply. Channels with a faster path for steps than `call` override this."""
        pending = self.call("execute_model", payload)
        return lambda: pending()[self.output_rank]

    def ready(self) -> None:  # noqa: B027 (most channels have nothing to open)
        """The KV caches exist: open whatever carries steps from now on."""

    def check_health(self) -> None:  # noqa: B027 (healthy unless a channel can tell)
        """Raise when a rank is dead or unresponsive."""

    @abstractmethod
    def close(self) -> None: ...


class Executor:
    """The engine core's view of its ranks, over `channel`."""

    def __init__(self, channel: RankChannel) -> None:
        self.channel = channel

    def available_kv_blocks(self) -> int:
        """KV blocks that fit on every rank (the minimum over ranks)."""
        return min(self.channel.call("available_kv_blocks")())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.channel.call("initialize_kv_cache", num_blocks)()
        self.channel.ready()

    def submit_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Start a step and return at once; pending steps finish in submission order (a
        channel whose ranks run elsewhere overlaps them: pipeline micro-batches)."""
        wait = self.channel.step(scheduler_output.encode())
        return lambda: ModelRunnerOutput.decode(wait())

    def stage_timings(self) -> list[dict[str, Any]]:
        """Per rank: cumulative step and wait-for-previous-stage seconds."""
        return self.channel.call("stage_timings")()

    def check_health(self) -> None:
        self.channel.check_health()

    def shutdown(self) -> None:
        self.channel.close()
