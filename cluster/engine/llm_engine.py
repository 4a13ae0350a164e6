"""`LLMEngine`: engine core + tokenizer + output processing, stepping in the caller's thread.

The offline `LLM` drives it to completion; the async engine drives it from a background
thread. Bad requests raise at `add_request` and never reach the core.
"""

from __future__ import annotations

import itertools
from typing import Any

from cluster.engine.core import EngineCore
from cluster.engine.input_processor import Prompt, check_params, process_prompt
from cluster.engine.output_processor import OutputProcessor, RequestState
from cluster.engine.request import Request
from cluster.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, core: EngineCore, tokenizer: Any, vocab_size: int) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = core.config.model.resolved_max_model_len
        self.output_processor = OutputProcessor(tokenizer)
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        text, ids = process_prompt(prompt, self.tokenizer, self.max_model_len, self.vocab_size)
        params = check_params(params, self.vocab_size, self.max_model_len, len(ids))
        request = Request(request_id, ids, params, eos_token_id=self.tokenizer.eos_token_id)
        self.core.add_request(request)
        self.output_processor.add_request(request_id, text, ids, params)

    def abort_request(self, request_id: str) -> RequestState | None:
        self.core.abort_requests([request_id])
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestState]:
        """One engine step; the states of the requests it advanced or finished."""
        updated, stopped = self.output_processor.process(self.core.step())
        for request_id, stop in stopped:
            self.core.finish_by_stop_string(request_id, stop)
        return updated

    def shutdown(self) -> None:
        self.core.shutdown()
