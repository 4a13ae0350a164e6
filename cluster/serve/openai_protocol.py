"""OpenAI request models (pydantic) and the response / stream-chunk bodies built from
`GenerateOutput`s, for `/v1/completions` and `/v1/chat/completions`.

`logprobs` (completions: how many top tokens; chat: `logprobs` + `top_logprobs`) are the
target's log-softmax of the raw logits at each output position, as vLLM returns by
default, and the same with speculation on or off. Other sampling fields map one to one
onto `SamplingParams` (vLLM's extensions `top_k`,
`min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids` are accepted too, and
OpenAI's `logit_bias`); every
bad value becomes a 400 naming the field. Unknown fields are ignored, as OpenAI clients
send some this server has no use for; fields it cannot honour are refused.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.sampling_params import SamplingParams
from cluster.serve.protocol import ChatMessage, GenerateOutput, TokenLogprob

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        values = {f: getattr(self, f) for f in _SAMPLING_FIELDS if getattr(self, f) is not None}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **values)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16
    echo: bool = False
    # The log-probabilities of this many most likely tokens at each position (and of the
    # chosen one), as OpenAI's legacy completions do.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise ValueError("echo is not supported by this server")
        return self._sampling(self.max_tokens, self.logprobs)

    def prompt_fields(self) -> dict[str, Any]:
        prompt = self.prompt
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ValueError("prompt: send one prompt per request")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return {"prompt": prompt}
        return {"prompt_token_ids": prompt}


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def sampling_params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(self.max_completion_tokens or self.max_tokens, logprobs)


def _chat_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _usage(out: GenerateOutput) -> dict[str, int]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
    }


class ResponseFormatter:
    """Builds one request's response body or stream chunks (completion or chat)."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model = model
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._sent_role = False
        self._text_offset = 0  # completions' `text_offset` of the next token

    def _logprobs(self, tokens: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens: chat's `content` list, or the legacy
        completions' parallel lists."""
        if tokens is None:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        **_chat_logprob(t.token, t.logprob),
                        "top_logprobs": [_chat_logprob(x.token, x.logprob) for x in t.top],
                    }
                    for t in tokens
                ]
            }
        offsets = []
        for t in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(t.token)
        return {
            "tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{x.token: x.logprob for x in t.top} for t in tokens],
            "text_offset": offsets,
        }

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, out: GenerateOutput) -> dict[str, Any]:
        if self.chat:
            choice = {"message": {"role": "assistant", "content": out.text}}
            body = self._envelope("chat.completion", [choice])
        else:
            body = self._envelope("text_completion", [{"text": out.text}])
        body["choices"][0].update(
            index=0, finish_reason=out.finish_reason, logprobs=self._logprobs(out.logprobs)
        )
        body["usage"] = _usage(out)
        return body

    def chunk(self, out: GenerateOutput) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"content": out.text}
            if not self._sent_role:
                delta["role"] = "assistant"
                self._sent_role = True
            choice = {"delta": delta}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            body = self._envelope("text_completion", [{"text": out.text}])
        body["choices"][0].update(
            index=0, finish_reason=out.finish_reason, logprobs=self._logprobs(out.logprobs)
        )
        return body

    def usage_chunk(self, out: GenerateOutput) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": _usage(out)}
