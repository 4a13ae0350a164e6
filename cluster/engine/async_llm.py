"""`AsyncLLM`: the engine for servers. A background thread steps the engine; callers
add requests, abort them, and iterate incremental outputs per request with asyncio.

A bad request raises from `add_request` (or the first step of `generate`) and never
reaches the engine; requests already running are not affected.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cluster.engine.input_processor import Prompt
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.output_processor import RequestState
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop died; every in-flight request fails with this."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    holdback: int  # characters held back while a stop string may be forming


class AsyncLLM:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._lock = threading.Lock()  # guards the engine between the loop and callers
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="cluster-engine-loop", daemon=True)
        self._thread.start()

    # ---- callers -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> asyncio.Queue:
        if self.error is not None:
            raise EngineDeadError(f"the engine loop died: {self.error!r}")
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop(), _holdback(params))
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in the engine")
            self.engine.add_request(request_id, prompt, params)  # raises ValueError on bad input
            self._streams[request_id] = stream
        self._wakeup.set()
        return stream.queue

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Incremental outputs (cumulative text and token ids) until the request finishes.

        Leaving the iteration early (a client disconnect) aborts the request.
        """
        request_id = request_id or self.engine.next_request_id()
        queue = self.add_request(request_id, prompt, params)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort_request(request_id)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            state = self.engine.abort_request(request_id)
        if stream is not None and state is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, state.output())

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    def check_health(self) -> None:
        if self.error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop is not running: {self.error!r}")
        self.engine.core.executor.check_health()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # ---- the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._wakeup.clear()  # before looking, so no add_request is missed
                with self._lock:
                    busy = self.engine.has_unfinished_requests()
                    updated = self.engine.step() if busy else []
                    self._deliver(updated)
                if not busy:
                    self._wakeup.wait(self.idle_wait_s)
        except BaseException as e:  # every waiter must hear about it
            self.error = e
            with self._lock:
                streams, self._streams = self._streams, {}
            dead = EngineDeadError(f"the engine loop died: {e!r}")
            for stream in streams.values():
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, dead)

    def _deliver(self, updated: list[RequestState]) -> None:
        for state in updated:
            stream = self._streams.get(state.request_id)
            if stream is None:
                continue
            if state.finish_reason is not None:
                del self._streams[state.request_id]
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, state.output(stream.holdback))


def _holdback(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop), default=1) - 1
