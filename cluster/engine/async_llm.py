"""`AsyncLLM`: the in-process engine for asyncio programs. The engine core runs in an
`EngineLoop` thread; callers add requests, abort them, and iterate incremental outputs
per request (the shared `FrontEnd` delivers them). A Serve replica uses `EngineClient`
instead, with the same front end and the same request semantics, over Ray actors.

A bad request raises from `add_request` (or the first step of `generate`) and never
reaches the engine; requests already running are not affected. Adding or aborting never
waits for a step: the loop applies both before its next one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from cluster.engine.errors import EngineDeadError
from cluster.engine.frontend import Prompt, stream_outputs
from cluster.engine.llm_engine import InProcessEngine, LLMEngine
from cluster.engine.loop import EngineLoop
from cluster.engine.messages import EngineCoreOutput
from cluster.engine.request import Request
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams


class AsyncLLM(InProcessEngine):
    def __init__(self, engine: LLMEngine) -> None:
        """Takes over `engine`'s core (built by `cluster.llm.build_engine`)."""
        super().__init__(engine.core, engine.tokenizer)
        self.loop = EngineLoop(self.core, self._publish, self._fail)

    # ---- callers -----------------------------------------------------------------------
    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Incremental outputs (cumulative text and token ids of every sequence) until the
        request finishes.

        Leaving the iteration early (a client disconnect) aborts the request.
        """
        self._raise_if_dead()
        request_id = request_id or self.next_request_id()
        queue = self.add_request(request_id, prompt, params, stream=True)
        finished = False
        try:
            async for item in stream_outputs(queue):
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort_request(request_id)

    @property
    def num_unfinished_requests(self) -> int:
        return self.frontend.num_streams

    def check_health(self) -> None:
        if not self.loop.alive:
            raise EngineDeadError(f"the engine loop is not running: {self.loop.error!r}")
        self.core.executor.check_health()

    def shutdown(self) -> None:
        self.loop.stop()
        self.core.shutdown()

    def _raise_if_dead(self) -> None:
        if self.loop.error is not None:
            raise EngineDeadError(f"the engine loop died: {self.loop.error!r}")

    def _submit(self, requests: list[Request]) -> None:
        self._raise_if_dead()
        for request in requests:
            self.loop.submit(request)

    def _abort(self, sequence_ids: list[str]) -> None:
        self.loop.abort(sequence_ids)

    # ---- the loop's side ---------------------------------------------------------------
    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        with self._lock:
            _, stopped = self.frontend.process(outputs)  # outputs reach the streams
        for request_id, stop in stopped:
            self.loop.finish_by_stop_string(request_id, stop)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self.frontend.fail_streams(EngineDeadError(f"the engine loop died: {error!r}"))
