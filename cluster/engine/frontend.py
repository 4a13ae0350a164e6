"""`FrontEnd`: text in, text out, the same for every API.

It admits requests (tokenizes or checks the prompt, validates the parameters against the
model, applies chat templates), so a bad request raises `ValueError` before the engine
sees it; it turns engine-core outputs into user outputs (incremental detokenization,
stop strings); and it keeps the streams of callers waiting for outputs, holding back
text that a stop string may still claim and handing each output to its caller's event
loop from whatever thread produced it.

The offline `LLM` (through `LLMEngine`), `AsyncLLM` and the Serve replica's
`EngineClient` all go through it, so a request means the same everywhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from math import inf
from typing import Any

from cluster.engine.input_processor import Prompt, check_params, process_prompt
from cluster.engine.messages import EngineCoreOutput
from cluster.engine.output_processor import OutputProcessor, RequestState
from cluster.engine.request import Request
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams

ChatMessages = list[dict[str, str]]


@dataclass
class _Stream:
    queue: asyncio.Queue  # RequestOutput items, or the exception that ends the stream
    loop: asyncio.AbstractEventLoop
    holdback: int  # characters held back while a stop string may be forming


class FrontEnd:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.output_processor = OutputProcessor(tokenizer)
        self._streams: dict[str, _Stream] = {}

    # ---- admission -----------------------------------------------------------------------
    def admit(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Request:
        """The engine request for `prompt`, its output state registered here; raises
        ValueError naming what is wrong (nothing is registered then)."""
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        text, ids = process_prompt(prompt, self.tokenizer, self.max_model_len, self.vocab_size)
        params = check_params(params, self.vocab_size, self.max_model_len, len(ids))
        request = Request(request_id, ids, params, eos_token_id=self.tokenizer.eos_token_id)
        self.output_processor.add_request(request_id, text, ids, params)
        return request

    def chat_prompt(
        self, messages: ChatMessages, add_generation_prompt: bool = True
    ) -> dict[str, Any]:
        """The model's chat template applied to one conversation: token ids and text."""
        template = self.tokenizer.apply_chat_template
        try:
            ids = template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
            text = template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as e:  # a template may refuse a conversation (e.g. its role order)
            raise ValueError(f"the chat template refused the messages: {e}") from e
        return {"prompt_token_ids": list(ids), "prompt": text}

    # ---- outputs -------------------------------------------------------------------------
    def process(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestState], list[tuple[str, str]]]:
        """Apply one step's outputs and deliver them to their streams. Returns the updated
        states and `(request_id, stop)` for requests a stop string ended (the caller
        tells the core to free them)."""
        updated, stopped = self.output_processor.process(outputs)
        for state in updated:
            stream = self._streams.get(state.request_id)
            if stream is None:
                continue
            if state.finish_reason is not None:
                del self._streams[state.request_id]
            _put(stream, state.output(stream.holdback))
        return updated, stopped

    def abort(self, request_id: str) -> RequestState | None:
        """Forget the request here; its stream, if still open, gets the final output."""
        stream = self._streams.pop(request_id, None)
        state = self.output_processor.abort(request_id)
        if stream is not None and state is not None:
            _put(stream, state.output())
        return state

    # ---- streams -------------------------------------------------------------------------
    def open_stream(self, request_id: str, params: SamplingParams) -> asyncio.Queue:
        """A queue of the request's outputs for the running event loop."""
        holdback = max((len(s) for s in params.stop), default=1) - 1
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop(), holdback)
        self._streams[request_id] = stream
        return stream.queue

    def fail_streams(self, error: BaseException) -> None:
        """End every open stream with `error` (the engine died)."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            _put(stream, error)

    @property
    def num_streams(self) -> int:
        return len(self._streams)


def _put(stream: _Stream, item: RequestOutput | BaseException) -> None:
    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


async def stream_outputs(queue: asyncio.Queue, interval_s: float = 0.0) -> AsyncIterator[Any]:
    """A stream's outputs (cumulative) until the finished one; an exception put in the
    queue is raised. The first output comes as soon as it exists; after that, outputs
    that arrive within `interval_s` of each other are merged (only the newest is
    yielded), so a stream costs fewer messages downstream."""
    wait_s = 0.0
    while True:
        item = await _newest(queue, wait_s)
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finished:
            return
        wait_s = interval_s


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
