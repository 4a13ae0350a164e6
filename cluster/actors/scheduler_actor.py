"""`SchedulerActor`: one engine's core (scheduler, KV block accounting, request state).

It owns an `EngineCore` whose executor is a `RayExecutor`, so creating it creates the
workers (they fate-share with it, and it with the Serve replica that created it). The
core runs in an `EngineLoop` (the same loop as `AsyncLLM`'s): apply queued commands,
`core.step()` (which sends the msgpack scheduler output to every worker and takes the
reporting rank's result), publish the per-request outputs. Callers never touch the core
directly: `submit`, `abort` and `finish_by_stop_string` only queue commands, and
what the loop publishes is
pushed to the replica over the output socket (`output_socket`, `OutputSender`) as soon
as it exists: one message per step carries every request's tokens, with no Ray call.

`health` answers from another thread even while a step runs: it fails when the loop has
died, when one step has run longer than `stall_timeout_s`, or when a worker does not
answer its ping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import ray

from cluster.actors.output_socket import OutputSender
from cluster.actors.ray_executor import RayExecutor
from cluster.actors.wire import OutputBatch, decode_request
from cluster.config import EngineConfig
from cluster.config.placement import PlacementConfig
from cluster.engine.core import EngineCore
from cluster.engine.loop import EngineLoop
from cluster.engine.messages import EngineCoreOutput
from cluster.engine.stats import EngineStats

# How many aborts of not-yet-added request ids the scheduler remembers.
_MAX_REMEMBERED_ABORTS = 4096

logger = logging.getLogger(__name__)


@ray.remote(max_concurrency=8)
class SchedulerActor:
    def __init__(
        self,
        config_json: str,
        placement: PlacementConfig,
        placement_group: Any = None,
        name_prefix: str | None = None,
        stall_timeout_s: float = 60.0,
    ) -> None:
        config = EngineConfig.model_validate_json(config_json)
        self.stall_timeout_s = stall_timeout_s
        self.executor = RayExecutor(config, placement, placement_group, name_prefix)
        try:
            self.core = EngineCore(config, self.executor)
        except BaseException:
            self.executor.shutdown()
            raise
        self._cv = threading.Condition()  # guards what the loop publishes
        self._live: set[str] = set()  # request ids added and not yet finished
        # Aborts of ids not live: calls may run out of order here, so an abort can come
        # before its own add (a client that left at once); that add is then dropped.
        self._aborted_unknown: OrderedDict[str, None] = OrderedDict()
        self._outbox: list[EngineCoreOutput] = []
        self._stats = EngineStats()
        self._error: str | None = None
        self._sender: OutputSender | None = None
        self.loop = EngineLoop(self.core, self._publish, self._fail, name="cluster-step-loop")

    # ---- commands (any thread) -----------------------------------------------------------
    def submit(self, payloads: list[bytes]) -> None:
        """Add the encoded requests (one user request's sequences), all or none."""
        requests = [decode_request(payload) for payload in payloads]
        with self._cv:
            self._raise_if_dead()
            for request in requests:
                if request.request_id in self._live:
                    raise ValueError(f"request_id {request.request_id!r} is already in the engine")
            wanted = []
            for request in requests:
                if request.request_id in self._aborted_unknown:
                    del self._aborted_unknown[request.request_id]
                    continue  # its client already left
                self._live.add(request.request_id)
                wanted.append(request)
        for request in wanted:
            self.loop.submit(request)

    def abort(self, request_ids: list[str]) -> None:
        with self._cv:
            for request_id in request_ids:
                if request_id not in self._live:
                    self._aborted_unknown[request_id] = None
                    while len(self._aborted_unknown) > _MAX_REMEMBERED_ABORTS:
                        self._aborted_unknown.popitem(last=False)
        self.loop.abort(request_ids)

    def finish_by_stop_string(self, request_id: str, stop: str) -> None:
        with self._cv:
            self._live.discard(request_id)
        self.loop.finish_by_stop_string(request_id, stop)

    def output_socket(self) -> tuple[tuple[str, int], bytes]:
        """Where the replica reads this engine's outputs, and the secret it must send
        first (`output_socket.read_batches`)."""
        with self._cv:
            if self._sender is None:
                host = ray.util.get_node_ip_address()
                self._sender = OutputSender(host, self._take_outputs)
            return self._sender.address, self._sender.secret

    def _take_outputs(self, timeout_s: float) -> OutputBatch | None:
        """Outputs published since the last call (waits up to `timeout_s` for some)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._outbox or self._error, timeout=timeout_s):
                return None
            outputs, self._outbox = self._outbox, []
            return OutputBatch(outputs, self._stats, self._error)

    # ---- health and introspection ---------------------------------------------------------
    def health(self) -> dict[str, Any]:
        with self._cv:
            self._raise_if_dead()
            started = self.loop.step_started
        if started is not None and time.monotonic() - started > self.stall_timeout_s:
            raise RuntimeError(
                f"the step loop is stalled: one step has run for "
                f"{time.monotonic() - started:.1f} s (stall_timeout_s={self.stall_timeout_s})"
            )
        self.executor.check_health()
        return {"num_live_requests": len(self._live), "num_steps": self._stats.num_steps}

    def cached_block_hashes(self, limit: int) -> list[bytes]:
        """Keys of the prefix cache's blocks (up to `limit`, newest last)."""
        return self.core.block_manager.cached_block_hashes(limit)

    def describe(self) -> dict[str, Any]:
        blocks = self.core.block_manager
        return {
            "workers": self.executor.describe(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "num_kv_blocks": blocks.num_blocks,
            "num_free_kv_blocks": blocks.num_free_blocks,
            "num_live_requests": len(self._live),
            "prefix_cache_queried_tokens": blocks.prefix_stats.num_queried_tokens,
            "prefix_cache_hit_tokens": blocks.prefix_stats.num_hit_tokens,
        }

    def timings(self) -> dict[str, Any]:
        """Cumulative step time here (scheduling, the round trips to every worker, applying
        the result) and each worker's own (`benchmarks/ray_step_cost.py`)."""
        return {
            "steps": self.core.num_steps,
            "step_s": self.loop.step_s_total,
            "workers": self.executor.stage_timings(),
        }

    def shutdown(self) -> None:
        self.loop.stop(timeout_s=5)
        if self._sender is not None:
            self._sender.close()
        self.executor.shutdown()

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine's step loop died: {self._error}")

    # ---- the loop's side --------------------------------------------------------------------
    def _fail(self, error: BaseException) -> None:
        with self._cv:
            self._error = f"{type(error).__name__}: {error}"
            self._cv.notify_all()

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        """Hand outputs, and the engine's stats after them, to the output socket."""
        with self._cv:
            for out in outputs:
                if out.finished:
                    self._live.discard(out.req_id)
            self._outbox += outputs
            self._stats = self.core.stats()
            self._cv.notify_all()
