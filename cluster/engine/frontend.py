"""`FrontEnd`: text in, text out, the same for every API.

It admits requests (tokenizes or checks the prompt, validates the parameters against the
model, applies chat templates), so a bad request raises `ValueError` before the engine
sees it; it turns engine-core outputs into user outputs (incremental detokenization,
stop strings); and it keeps the streams of callers waiting for outputs, holding back
text that a stop string may still claim and handing each output to its caller's event
loop from whatever thread produced it.

A request with `n` > 1 sequences is fanned out here and nowhere else: sequence j is the
engine request `"{request_id}.{j}"` (sampled with `seed + j` when seeded, as vLLM does),
and the request's outputs hold every sequence's completion so far, choice j at index j,
finished when all are. Everything past the front end sees only one-sequence requests.

The offline `LLM` (through `LLMEngine`), `AsyncLLM` and the Serve replica's
`EngineClient` all go through it, so a request means the same everywhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from math import inf
from typing import Any

from cluster.config import ModelConfig
from cluster.engine.messages import EngineCoreOutput
from cluster.engine.output_processor import OutputProcessor, RequestState
from cluster.engine.request import Request
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams, is_valid_unicode

Prompt = str | dict[str, Any]  # text, or {"prompt_token_ids": [...]} (optionally "prompt")
ChatMessages = list[dict[str, Any]]


@dataclass
class _Stream:
    queue: asyncio.Queue  # RequestOutput items, or the exception that ends the stream
    loop: asyncio.AbstractEventLoop
    holdback: int  # characters held back while a stop string may be forming
    # Only the first output (its time is the time to first token) and the final one are
    # wanted: a request that does not stream. Nothing is built or queued for the others.
    first_and_final: bool
    started: bool = False  # an output was queued


@dataclass(eq=False)  # compared and hashed by identity
class UserRequest:
    """One user request: its sequences' states, choice j at index j (one when n = 1,
    under the request's own id)."""

    request_id: str
    sequences: list[RequestState]

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def output(self, streaming_holdback: int = 0) -> RequestOutput:
        first = self.sequences[0]
        prompt_logprobs = next(
            (s.prompt_logprobs for s in self.sequences if s.prompt_logprobs is not None), None
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[s.completion(j, streaming_holdback) for j, s in enumerate(self.sequences)],
            finished=self.finished,
        )


class FrontEnd:
    def __init__(self, tokenizer: Any, model: ModelConfig) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(model.hf_config.vocab_size)
        self.max_model_len = model.resolved_max_model_len
        # End-of-sequence ids of generation_config.json besides the tokenizer's: they stop
        # a request as stop token ids do (unless `ignore_eos`), as vLLM does.
        self.extra_eos_token_ids = tuple(
            t for t in model.generation_eos_token_ids if t != tokenizer.eos_token_id
        )
        self.output_processor = OutputProcessor(tokenizer)
        self._requests: dict[str, UserRequest] = {}  # by user request id
        self._by_sequence: dict[str, UserRequest] = {}  # by engine request (sequence) id
        self._streams: dict[str, _Stream] = {}  # by user request id

    # ---- admission -----------------------------------------------------------------------
    def admit(self, request_id: str, prompt: Prompt, params: SamplingParams) -> list[Request]:
        """The engine requests for `prompt` (`params.n` of them), their output states
        registered here; raises ValueError naming what is wrong (nothing is registered
        then)."""
        text, ids = process_prompt(prompt, self.tokenizer, self.max_model_len, self.vocab_size)
        params = check_params(params, self.vocab_size, self.max_model_len, len(ids))
        extra = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
        if extra and not params.ignore_eos:
            params = params.model_copy(update={"stop_token_ids": (*params.stop_token_ids, *extra)})
        choices = params.choices()
        sequence_ids = (
            [request_id]
            if len(choices) == 1
            else [f"{request_id}.{j}" for j in range(len(choices))]
        )
        taken = [
            i for i in {request_id, *sequence_ids} if i in self._requests or i in self._by_sequence
        ]
        if taken:
            raise ValueError(f"request_id {taken[0]!r} is already in the engine")
        requests = []
        states = []
        for sequence_id, choice in zip(sequence_ids, choices, strict=True):
            eos = self.tokenizer.eos_token_id
            requests.append(Request(sequence_id, list(ids), choice, eos_token_id=eos))
            states.append(self.output_processor.track(sequence_id, text, ids, choice))
        user_request = UserRequest(request_id, states)
        self._requests[request_id] = user_request
        self._by_sequence.update((sequence_id, user_request) for sequence_id in sequence_ids)
        return requests

    def chat_prompt(
        self,
        messages: ChatMessages,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The model's chat template applied to one conversation (and the tools it may
        call, for templates that render them): token ids and text. `chat_template_kwargs`
        are extra variables for the template (e.g. `enable_thinking`), as vLLM's."""
        template = self.tokenizer.apply_chat_template
        options = {"add_generation_prompt": add_generation_prompt, "tools": tools}
        taken = sorted(set(chat_template_kwargs or {}) & {*options, "messages", "tokenize"})
        if taken:
            raise ValueError(f"chat_template_kwargs: {taken} are set by the request itself")
        options.update(chat_template_kwargs or {})
        try:
            ids = template(messages, tokenize=True, return_dict=False, **options)
            text = template(messages, tokenize=False, **options)
        except Exception as e:  # a template may refuse a conversation (e.g. its role order)
            raise ValueError(f"the chat template refused the messages: {e}") from e
        return {"prompt_token_ids": list(ids), "prompt": text}

    # ---- outputs -------------------------------------------------------------------------
    def process(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[UserRequest], list[tuple[str, str]]]:
        """Apply one step's outputs and deliver them to their streams. Returns the requests
        this step advanced (`.output()` builds one's output), and `(engine request id,
        stop)` for sequences a stop string ended (the caller tells the core to free them)."""
        updated, stopped = self.output_processor.process(outputs)
        advanced = dict.fromkeys(
            self._by_sequence[s.request_id] for s in updated if s.request_id in self._by_sequence
        )
        for user_request in advanced:
            finished = user_request.finished
            if finished:
                self._forget(user_request)
            stream = self._streams.get(user_request.request_id)
            if stream is None:
                continue
            if finished:
                del self._streams[user_request.request_id]
            elif stream.first_and_final and stream.started:
                continue
            stream.started = True
            _put(stream, user_request.output(stream.holdback))
        return list(advanced), stopped

    def abort(self, request_id: str) -> list[str]:
        """Forget the request here (its stream, if still open, gets the final output).
        Returns its engine request ids, for the core to free."""
        user_request = self._requests.get(request_id)
        stream = self._streams.pop(request_id, None)
        if user_request is None:
            return []
        self._forget(user_request)
        for state in user_request.sequences:
            self.output_processor.abort(state.request_id)
        if stream is not None:
            _put(stream, user_request.output())
        return [s.request_id for s in user_request.sequences]

    def _forget(self, user_request: UserRequest) -> None:
        del self._requests[user_request.request_id]
        for state in user_request.sequences:
            self._by_sequence.pop(state.request_id, None)

    # ---- streams -------------------------------------------------------------------------
    def open_stream(
        self, request_id: str, params: SamplingParams, first_and_final: bool = False
    ) -> asyncio.Queue:
        """A queue of the (admitted) request's outputs for the running event loop (with
        `first_and_final`, of its first and its final output alone)."""
        holdback = max((len(s) for s in params.stop), default=1) - 1
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop(), holdback, first_and_final)
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


def process_prompt(
    prompt: Prompt, tokenizer: Any, max_model_len: int, vocab_size: int
) -> tuple[str | None, list[int]]:
    """(prompt text or None, prompt token ids); raises ValueError naming what is wrong."""
    if isinstance(prompt, str):
        if not is_valid_unicode(prompt):
            raise ValueError("prompt is not valid Unicode (it holds a lone surrogate)")
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        if not isinstance(ids, list | tuple) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        ids = list(ids)
    else:
        raise ValueError('a prompt is a string or {"prompt_token_ids": [...]}')
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) > max_model_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens, more than max_model_len={max_model_len}"
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt_token_ids hold ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )
    return text, ids


def check_params(
    params: SamplingParams, vocab_size: int, max_model_len: int, prompt_len: int
) -> SamplingParams:
    """Checks that need the model; fills max_tokens=None with the room left. A prompt plus
    `max_tokens` beyond `max_model_len` is refused, as OpenAI and vLLM do."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    # Validated again: `model_copy(update=...)` skips pydantic's validators.
    params = SamplingParams(**params.model_dump())
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > vocab_size:
            raise ValueError(f"{name}={value} exceeds the vocabulary size {vocab_size}")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids hold ids outside the vocabulary: {bad}")
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias holds token ids outside the vocabulary: {bad[:5]}")
    if params.max_tokens is not None and prompt_len + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens={params.max_tokens} plus the prompt's {prompt_len} tokens is more "
            f"than max_model_len={max_model_len}; ask for at most "
            f"{max_model_len - prompt_len} tokens"
        )
    if params.max_tokens is None:
        params = params.model_copy(update={"max_tokens": max(1, max_model_len - prompt_len)})
    return params


def _put(stream: _Stream, item: RequestOutput | BaseException) -> None:
    """Queue `item` from any thread (at once from the stream's own loop, which is where
    a Ray engine client's pump runs; a thread of the in-process engine wakes that loop)."""
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is stream.loop:
        stream.queue.put_nowait(item)
    else:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


async def stream_outputs(
    queue: asyncio.Queue, interval_s: float | Callable[[], float] = 0.0
) -> AsyncIterator[Any]:
    """A stream's outputs (cumulative) until the finished one; an exception put in the
    queue is raised. Outputs go out at most once per `interval_s` (a number, or a function
    asked after each output): one that arrives later than that after the previous goes
    out at once, and those that arrive sooner are merged (only the newest is yielded,
    at the end of the interval), so a stream costs fewer messages downstream without
    delaying a token when outputs come slower than the interval. The first and the
    final output never wait."""
    loop = asyncio.get_running_loop()
    not_before = -inf
    while True:
        item = await _newest(queue, not_before)
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finished:
            return
        wait_s = interval_s() if callable(interval_s) else interval_s
        not_before = loop.time() + wait_s


async def _newest(queue: asyncio.Queue, not_before: float) -> Any:
    """The next item, then any newer ones that arrive until the loop's time `not_before`
    (stopping at a final one or an exception)."""
    loop = asyncio.get_running_loop()
    item = await queue.get()
    while not (isinstance(item, BaseException) or item.finished):
        if not queue.empty():
            item = queue.get_nowait()
            continue
        remaining = not_before - loop.time()
        if remaining <= 0:
            break
        try:
            item = await asyncio.wait_for(queue.get(), None if remaining == inf else remaining)
        except TimeoutError:
            break
    return item
