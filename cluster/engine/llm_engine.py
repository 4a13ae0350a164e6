"""`LLMEngine`: the engine core behind the shared `FrontEnd`, stepping in the caller's
thread.

The offline `LLM` drives it to completion; `AsyncLLM` drives it from a background
thread. Bad requests raise at `add_request` and never reach the core.
"""

from __future__ import annotations

import itertools
from typing import Any

from cluster.engine.core import EngineCore
from cluster.engine.frontend import FrontEnd, Prompt
from cluster.engine.output_processor import RequestState
from cluster.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, core: EngineCore, tokenizer: Any) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.frontend = FrontEnd(tokenizer, core.config.model)
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        request = self.frontend.admit(request_id, prompt, params)
        try:
            self.core.add_request(request)
        except BaseException:
            self.frontend.abort(request_id)
            raise

    def abort_request(self, request_id: str) -> RequestState | None:
        self.core.abort_requests([request_id])
        return self.frontend.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestState]:
        """One engine step; the states of the requests it advanced or finished (also
        delivered to their streams, if any)."""
        updated, stopped = self.frontend.process(self.core.step())
        for request_id, stop in stopped:
            self.core.finish_by_stop_string(request_id, stop)
        return updated

    def shutdown(self) -> None:
        self.core.shutdown()
