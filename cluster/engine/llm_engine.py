"""The engine core in this process behind the shared `FrontEnd`.

`InProcessEngine` is where requests enter: `add_request` admits one (its `n` sequences,
or `ValueError` before anything reaches the core) and hands its engine requests on;
`abort_request` frees them. Its two forms differ only in who steps the core:
`LLMEngine` steps it in the caller's thread (the offline `LLM` drives it to completion),
`AsyncLLM` (`async_llm.py`) in a background `EngineLoop`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

from cluster.engine.core import EngineCore
from cluster.engine.frontend import FrontEnd, Prompt, UserRequest
from cluster.engine.request import Request
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams


class InProcessEngine:
    def __init__(self, core: EngineCore, tokenizer: Any) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.frontend = FrontEnd(tokenizer, core.config.model)
        # Guards the front end where a loop thread applies outputs while callers add.
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, stream: bool = False
    ) -> asyncio.Queue | None:
        """Admit the request (its `n` sequences) and hand it to the core. With `stream`
        (called from an event loop), returns the queue its outputs will arrive on."""
        with self._lock:
            requests = self.frontend.admit(request_id, prompt, params)
            queue = self.frontend.open_stream(request_id, params) if stream else None
        try:
            self._submit(requests)
        except BaseException:
            self.abort_request(request_id)
            raise
        return queue

    def abort_request(self, request_id: str) -> None:
        """Forget the request (its stream, if open, gets its final output) and free it."""
        with self._lock:
            sequence_ids = self.frontend.abort(request_id)
        self._abort(sequence_ids)

    def _submit(self, requests: list[Request]) -> None:
        raise NotImplementedError

    def _abort(self, sequence_ids: list[str]) -> None:
        raise NotImplementedError


class LLMEngine(InProcessEngine):
    """Steps the core in the caller's thread."""

    def _submit(self, requests: list[Request]) -> None:
        for request in requests:
            self.core.add_request(request)

    def _abort(self, sequence_ids: list[str]) -> None:
        self.core.abort_requests(sequence_ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests it advanced or finished (also
        delivered to their streams, if any)."""
        return [request.output() for request in self.advance()]

    def advance(self) -> list[UserRequest]:
        """One engine step; the requests it advanced or finished (`.output()` builds
        one's output, so a caller waiting for the finished ones builds only those)."""
        updated, stopped = self.frontend.process(self.core.step())
        for request_id, stop in stopped:
            self.core.finish_by_stop_string(request_id, stop)
        return updated

    def shutdown(self) -> None:
        self.core.shutdown()
