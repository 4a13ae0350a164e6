"""`StepGraph`: the step loop's scheduler -> workers round trip as a Ray Compiled Graph.

The graph is compiled once per engine, after the KV cache exists: the input (a step's
msgpack `SchedulerOutput`) goes to every rank's `execute_model`, and the outputs (the
reporting rank's msgpack `ModelRunnerOutput`, None from the others) come back together.
On one node the payloads travel through shared-memory channels that the worker actors
poll in a loop of their own, so a step costs tens of microseconds of Ray instead of one
task submission and one object-store reply per rank.

A compiled graph's result can be waited for once only (a timed-out wait cannot be
retried), so one I/O thread owns the graph: it submits each step and, when the caller
asks for the result, waits for it. The caller polls that wait in short slices and runs
its own liveness checks between them, which keeps failures visible within a second.
Steps are submitted and collected in order, so pipeline stages keep several in flight.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import ray
from ray.dag import InputNode, MultiOutputNode

Replies = list[bytes | None]  # one per rank


class StepGraph:
    def __init__(self, workers: list[Any], max_inflight_steps: int) -> None:
        """Compile the graph over `workers` (actor handles, in rank order); raises when
        Ray cannot compile it (the caller then falls back to tasks)."""
        with InputNode() as payload:
            dag = MultiOutputNode([w.execute_model.bind(payload) for w in workers])
        self._graph = dag.experimental_compile(_max_inflight_executions=max_inflight_steps)
        self._actor_ids = [w._actor_id.hex() for w in workers]
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cluster-step-graph")

    def submit(self, payload: bytes) -> Future[list[Any]]:
        """Send one step to every rank; the future holds the graph's result references."""
        return self._io.submit(self._graph.execute, payload)

    def wait(
        self,
        submitted: Future[list[Any]],
        timeout_s: float,
        tick_s: float,
        on_tick: Callable[[], None],
    ) -> Replies:
        """Every rank's reply to a submitted step; `on_tick` runs every `tick_s` while
        waiting (it raises to give up, and names the rank that failed)."""
        done = self._io.submit(lambda: ray.get(submitted.result(), timeout=timeout_s))
        while True:
            try:
                return done.result(timeout=tick_s)
            except FutureTimeout:
                on_tick()
            except ray.exceptions.RayActorError as e:
                rank = self._actor_ids.index(e.actor_id) if e.actor_id in self._actor_ids else "?"
                raise RuntimeError(f"worker rank {rank} is dead ({e})") from e
            except ray.exceptions.RayTaskError as e:
                on_tick()  # the graph does not say which rank raised: `on_tick` asks them
                raise RuntimeError(f"a worker's step failed: {e.cause or e}") from e

    def close(self, workers_alive: bool) -> None:
        """Stop the graph's loops on the workers. Call it before killing them when they
        are healthy; when a step failed, kill them first (a rank stuck in a collective
        would never leave its loop) and this only releases the channels."""
        with contextlib.suppress(Exception):
            if workers_alive:
                self._graph.teardown()
            else:
                _quietly(self._graph.teardown)
        self._io.shutdown(wait=False, cancel_futures=True)


def _quietly(fn: Callable[[], None]) -> None:
    """Run `fn` with Ray's compiled-graph logger muted (it logs each killed actor)."""
    ray_logger = logging.getLogger("ray.dag.compiled_dag_node")
    level = ray_logger.level
    ray_logger.setLevel(logging.CRITICAL)
    try:
        fn()
    finally:
        ray_logger.setLevel(level)
