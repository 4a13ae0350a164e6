"""`AsyncLLM`: the in-process engine for asyncio programs. A background thread steps
the engine; callers add requests, abort them, and iterate incremental outputs per request
(the shared `FrontEnd` delivers them). A Serve replica uses `EngineClient` instead, with
the same front end and the same request semantics, over Ray actors.

A bad request raises from `add_request` (or the first step of `generate`) and never
reaches the engine; requests already running are not affected.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from cluster.engine.errors import EngineDeadError
from cluster.engine.frontend import Prompt, stream_outputs
from cluster.engine.llm_engine import LLMEngine
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams


class AsyncLLM:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._lock = threading.Lock()  # guards the engine between the loop and callers
        self._wakeup = threading.Event()
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="cluster-engine-loop", daemon=True)
        self._thread.start()

    # ---- callers -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> asyncio.Queue:
        if self.error is not None:
            raise EngineDeadError(f"the engine loop died: {self.error!r}")
        with self._lock:
            self.engine.add_request(request_id, prompt, params)  # raises ValueError on bad input
            queue = self.engine.frontend.open_stream(request_id, params)
        self._wakeup.set()
        return queue

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
            async for item in stream_outputs(queue):
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort_request(request_id)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort_request(request_id)

    @property
    def num_unfinished_requests(self) -> int:
        return self.engine.frontend.num_streams

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
                    if busy:
                        self.engine.step()  # its outputs reach the streams
                if not busy:
                    self._wakeup.wait(self.idle_wait_s)
        except BaseException as e:  # every waiter must hear about it
            self.error = e
            with self._lock:
                self.engine.frontend.fail_streams(EngineDeadError(f"the engine loop died: {e!r}"))
