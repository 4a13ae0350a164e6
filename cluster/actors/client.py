"""`EngineClient`: one engine (scheduler actor + worker actors) seen from the process
that serves it, with the same request semantics as `AsyncLLM`.

Text stays here: prompts are tokenized and checked before anything is sent, and the
`OutputProcessor` detokenizes and applies stop strings to what comes back. One asyncio
task (the pump) long-polls the scheduler actor for each step's outputs and hands them to
the per-request queues, so the cost is one RPC per engine step, not per token per request.

If the scheduler actor or a worker dies, the pump fails every in-flight request with
`EngineDeadError` at once, and every later request is refused with it.

Calls that must outlive the request that caused them (the pump's polls, aborts, stop-
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
from dataclasses import dataclass
from math import inf
from typing import Any

import ray

from cluster.actors.placement import ACTOR_NAMESPACE, bundle_strategy
from cluster.actors.scheduler_actor import SchedulerActor
from cluster.actors.wire import EngineStats, OutputBatch, encode_request
from cluster.config import EngineConfig
from cluster.engine.async_llm import EngineDeadError
from cluster.engine.input_processor import Prompt, check_params, process_prompt
from cluster.engine.output_processor import OutputProcessor, RequestState
from cluster.engine.request import Request
from cluster.outputs import RequestOutput
from cluster.placement_config import PlacementConfig
from cluster.sampling_params import SamplingParams

BatchObserver = Callable[[OutputBatch], None]
logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    queue: asyncio.Queue
    holdback: int  # characters held back while a stop string may be forming


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        placement: PlacementConfig,
        placement_group: Any = None,
        *,
        engine_id: str | None = None,
        stall_timeout_s: float = 60.0,
        poll_s: float = 1.0,
        observer: BatchObserver | None = None,
    ) -> None:
        """Start the scheduler actor (which starts the workers) and wait until it is ready;
        a failure there raises here, with every actor it started already gone."""
        from transformers import AutoTokenizer

        self.config = config
        self.engine_id = engine_id or uuid.uuid4().hex[:12]
        self.poll_s = poll_s
        self.observer = observer
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path)
        self.vocab_size = int(config.model.hf_config.vocab_size)
        self.max_model_len = config.model.resolved_max_model_len
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
        except BaseException:
            ray.kill(self.scheduler, no_restart=True)
            raise
        self.output_processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, _Stream] = {}
        self._pump: asyncio.Task | None = None
        self.stats = EngineStats()
        self.error: str | None = None

    # ---- requests ------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        interval_s: float = 0.0,
    ) -> AsyncIterator[RequestOutput]:
        """Incremental outputs (cumulative text and token ids) until the request finishes.

        The first output comes as soon as it exists; after that, outputs that arrive within
        `interval_s` of each other are merged (only the newest is yielded: they are
        cumulative), so a stream costs fewer messages downstream. A bad prompt or parameter
        raises ValueError before the engine sees the request; leaving the iteration early
        (a client disconnect) aborts it and frees its blocks.
        """
        self._raise_if_dead()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        text, ids = process_prompt(prompt, self.tokenizer, self.max_model_len, self.vocab_size)
        params = check_params(params, self.vocab_size, self.max_model_len, len(ids))
        request = Request(request_id, ids, params, eos_token_id=self.tokenizer.eos_token_id)
        holdback = max((len(s) for s in params.stop), default=1) - 1
        stream = _Stream(asyncio.Queue(), holdback)
        self._streams[request_id] = stream
        self.output_processor.add_request(request_id, text, ids, params)
        finished = False
        try:
            self._ensure_pump()
            await self.scheduler.add_request.remote(encode_request(request))
            wait_s = 0.0  # the first output is not held back
            while not finished:
                item = await _newest(stream.queue, wait_s)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                wait_s = interval_s
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Forget the request here and free it in the scheduler (fire and forget, and
        never cancelled with the call that aborts: see `detached`)."""
        self._streams.pop(request_id, None)
        self.output_processor.abort(request_id)
        if self.error is None:
            detached(self.scheduler.abort.remote, [request_id])

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    # ---- health --------------------------------------------------------------------------
    async def check_health(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Raises when the engine is dead, stalled or unreachable (scheduler or any worker)."""
        self._raise_if_dead()
        self._ensure_pump()
        return await asyncio.wait_for(self.scheduler.health.remote(), timeout_s)

    async def describe(self) -> dict[str, Any]:
        return await self.scheduler.describe.remote()

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
            while True:
                batch = OutputBatch.decode(await self.scheduler.get_outputs.remote(self.poll_s))
                self.stats = batch.stats
                if batch.error is not None:
                    raise EngineDeadError(batch.error)
                updated, stopped = self.output_processor.process(batch.outputs)
                for request_id, stop in stopped:
                    self.scheduler.finish_by_stop_string.remote(request_id, stop)
                self._deliver(updated)
                if self.observer is not None:
                    try:
                        self.observer(batch)
                    except Exception:  # metrics must never take the engine down
                        logger.exception("the output observer failed")
        except Exception as e:  # the engine is gone: nobody may wait forever
            self.error = f"{type(e).__name__}: {e}"
            dead = EngineDeadError(f"the engine died: {self.error}")
            streams, self._streams = self._streams, {}
            for stream in streams.values():
                stream.queue.put_nowait(dead)

    def _deliver(self, updated: list[RequestState]) -> None:
        for state in updated:
            stream = self._streams.get(state.request_id)
            if stream is None:
                continue
            if state.finish_reason is not None:
                del self._streams[state.request_id]
            stream.queue.put_nowait(state.output(stream.holdback))

    def shutdown(self) -> None:
        if self._pump is not None:
            with contextlib.suppress(RuntimeError):  # its loop may be closed already
                self._pump.cancel()
        with contextlib.suppress(Exception):
            ray.get(self.scheduler.shutdown.remote(), timeout=10)
        with contextlib.suppress(Exception):
            ray.kill(self.scheduler, no_restart=True)


def detached(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in an empty context, so that Ray tasks it submits are not children of
    the actor call running now (Ray finds the parent of an async actor's submissions in a
    context variable), and cancelling that call does not cancel them."""
    return contextvars.Context().run(fn, *args)


async def _newest(queue: asyncio.Queue, wait_s: float) -> Any:
    """The next item, then for up to `wait_s` any newer ones (stopping at a final one)."""
    loop = asyncio.get_running_loop()
    item = await queue.get()
    deadline = loop.time() + wait_s
    while not (isinstance(item, BaseException) or item.finished):
        if not queue.empty():
            item = queue.get_nowait()
            continue
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        try:
            item = await asyncio.wait_for(queue.get(), None if remaining == inf else remaining)
        except TimeoutError:
            break
    return item
