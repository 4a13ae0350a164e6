"""`EngineClient`: one engine (scheduler actor + worker actors) seen from the process
that serves it, through the same `FrontEnd` as `AsyncLLM` and the offline `LLM`.

Text stays here: prompts are tokenized and checked before anything is sent, and the
front end detokenizes and applies stop strings to what comes back. One asyncio
task (the pump) reads each step's outputs from the scheduler actor's output socket as
they are pushed and hands them to the per-request queues: no Ray call per step, no
polling interval.

If the scheduler actor or a worker dies, the pump fails every in-flight request with
`EngineDeadError` at once, and every later request is refused with it; `on_death` hears
of it first (the replica's `EngineSupervisor`, which starts a new engine).

Calls that must outlive the request that caused them (the pump, aborts, stop-
string finishes) are made outside that request's Ray task context (`detached`): Serve
cancels a replica call whose client left, Ray then cancels the call's child tasks too,
and an abort sent as such a child would be cancelled before it ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from math import inf
from typing import Any

import ray

from cluster.actors.output_socket import read_batches
from cluster.actors.placement import ACTOR_NAMESPACE, bundle_strategy
from cluster.actors.scheduler_actor import SchedulerActor
from cluster.actors.wire import OutputBatch, encode_request
from cluster.config import EngineConfig
from cluster.config.placement import PlacementConfig
from cluster.engine.errors import EngineDeadError
from cluster.engine.frontend import FrontEnd, Prompt, stream_outputs
from cluster.engine.stats import EngineStats
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams

BatchObserver = Callable[[OutputBatch], None]
logger = logging.getLogger(__name__)


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        placement: PlacementConfig,
        placement_group: Any = None,
        *,
        engine_id: str | None = None,
        stall_timeout_s: float = 60.0,
        observer: BatchObserver | None = None,
        on_death: Callable[[str], object] | None = None,
        tokenizer: Any = None,
    ) -> None:
        """Start the scheduler actor (which starts the workers) and wait until it is ready;
        a failure there raises here, with every actor it started already gone. The model's
        tokenizer is loaded unless `tokenizer` is given (a replica's, shared by its engines)."""
        from transformers import AutoTokenizer

        self.config = config
        self.engine_id = engine_id or uuid.uuid4().hex[:12]
        self.observer = observer
        self.on_death = on_death
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.model.tokenizer_path)
        self.frontend = FrontEnd(self.tokenizer, config.model)
        name = f"cluster-{self.engine_id}"
        options: dict[str, Any] = {
            "num_cpus": 0,
            "name": f"{name}-scheduler",
            "namespace": ACTOR_NAMESPACE,
        }
        if placement_group is not None:
            options["scheduling_strategy"] = bundle_strategy(placement_group, 0)
        self.scheduler = SchedulerActor.options(**options).remote(
            config.model_dump_json(), placement, placement_group, name, stall_timeout_s
        )
        try:
            self.layout: dict[str, Any] = ray.get(self.scheduler.describe.remote())
            self._outputs_at = ray.get(self.scheduler.output_socket.remote())
        except BaseException:
            ray.kill(self.scheduler, no_restart=True)
            raise
        self._pump: asyncio.Task | None = None
        self.stats = EngineStats()
        self.error: str | None = None

    # ---- requests ------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        interval_s: float | Callable[[], float] = 0.0,
    ) -> AsyncIterator[RequestOutput]:
        """Incremental outputs (cumulative text and token ids) until the request finishes,
        merged within `interval_s` (or what it returns, asked after each output) after the
        first (`frontend.stream_outputs`). A bad
        prompt or parameter raises ValueError before the engine sees the request; leaving
        the iteration early (a client disconnect) aborts it and frees its blocks.
        """
        self._raise_if_dead()
        request_id = request_id or uuid.uuid4().hex
        requests = self.frontend.admit(request_id, prompt, params)
        # Merging without end (inf) yields the first output and the final one: only
        # those are built and queued.
        queue = self.frontend.open_stream(
            request_id, requests[0].sampling_params, first_and_final=interval_s == inf
        )
        finished = False
        try:
            self._ensure_pump()
            await self.scheduler.submit.remote([encode_request(r) for r in requests])
            async for item in stream_outputs(queue, interval_s):
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Forget the request here and free it in the scheduler (fire and forget, and
        never cancelled with the call that aborts: see `detached`)."""
        sequence_ids = self.frontend.abort(request_id)
        if self.error is None and sequence_ids:
            detached(self.scheduler.abort.remote, sequence_ids)

    @property
    def num_unfinished_requests(self) -> int:
        return self.frontend.num_streams

    # ---- health --------------------------------------------------------------------------
    async def check_health(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Raises when the engine is dead, stalled or unreachable (scheduler or any worker)."""
        self._raise_if_dead()
        self._ensure_pump()
        return await asyncio.wait_for(self.scheduler.health.remote(), timeout_s)

    async def describe(self) -> dict[str, Any]:
        return await self.scheduler.describe.remote()

    async def cached_block_hashes(self, limit: int) -> list[bytes]:
        """Keys of the blocks in the engine's prefix cache (up to `limit`, newest last)."""
        return await self.scheduler.cached_block_hashes.remote(limit)

    def _raise_if_dead(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine is dead: {self.error}")

    # ---- the pump ------------------------------------------------------------------------
    def _ensure_pump(self) -> None:
        """One pump per client, on the running loop (again if a previous loop ended)."""
        if self._pump is None or self._pump.done():
            # A fresh context: the pump is nobody's child (see `detached`).
            loop = asyncio.get_running_loop()
            self._pump = loop.create_task(self._pump_outputs(), context=contextvars.Context())

    async def _pump_outputs(self) -> None:
        try:
            async for batch in read_batches(*self._outputs_at):
                self.stats = batch.stats
                if batch.error is not None:
                    raise EngineDeadError(batch.error)
                _, stopped = self.frontend.process(batch.outputs)  # delivered to the streams
                for request_id, stop in stopped:
                    self.scheduler.finish_by_stop_string.remote(request_id, stop)
                if self.observer is not None:
                    try:
                        self.observer(batch)
                    except Exception:  # metrics must never take the engine down
                        logger.exception("the output observer failed")
        except Exception as e:  # the engine is gone: nobody may wait forever
            self.fail(f"{type(e).__name__}: {e}")

    def fail(self, reason: str) -> None:
        """Declare the engine dead: `on_death` is told first, then every stream in flight
        ends with EngineDeadError (once; later calls do nothing)."""
        if self.error is not None:
            return
        self.error = reason
        if self.on_death is not None:
            self.on_death(reason)
        self.frontend.fail_streams(EngineDeadError(f"the engine died: {reason}"))

    def shutdown(self) -> None:
        if self._pump is not None:
            with contextlib.suppress(RuntimeError):  # its loop may be closed already
                self._pump.cancel()
        self.stop_actors()

    def stop_actors(self) -> None:
        """Stop the scheduler actor and, with it, the workers (blocks for up to ~10 s)."""
        with contextlib.suppress(Exception):
            ray.get(self.scheduler.shutdown.remote(), timeout=10)
        with contextlib.suppress(Exception):
            ray.kill(self.scheduler, no_restart=True)


def detached(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in an empty context, so that Ray tasks it submits are not children of
    the actor call running now (Ray finds the parent of an async actor's submissions in a
    context variable), and cancelling that call does not cancel them."""
    return contextvars.Context().run(fn, *args)
