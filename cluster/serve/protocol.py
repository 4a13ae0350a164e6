"""The Serve handle API's request and output types (pydantic).

    await handle.generate.remote(GenerateRequest(prompt="Hi", sampling_params=...))
    async for chunk in handle.options(stream=True).generate.remote(
        GenerateRequest(prompt="Hi", stream=True)
    ): ...

A streamed request yields `GenerateOutput` chunks whose `text` and `token_ids` are what
is new since the previous chunk of the same choice (`index`; their concatenation is the
whole answer); a non-streamed one returns a single `GenerateOutput` holding everything,
or with `sampling_params.n` > 1 a list of them, choice j at index j. `stream` must
match how the handle is called, as with OpenAI's `stream` flag (Serve cannot tell a
replica which of the two calls it is serving).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.sampling_params import SamplingParams, is_valid_unicode


class TextPart(BaseModel):
    """One part of a message's `content` list: text is the only kind a text model reads."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["text"]
    text: str


class _CalledFunction(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(BaseModel):
    """A tool call an earlier assistant turn made (sent back in the conversation)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: _CalledFunction


class ChatMessage(BaseModel):
    """One chat turn, as OpenAI's API sends it: `content` a string or a list of text parts
    (joined with newlines, as vLLM does); `developer` (OpenAI's newer name for `system`)
    reaches the chat template as `system`; `name` is passed to the template, which may use
    it. An assistant turn may carry the `tool_calls` it made (and then no content), a
    `tool` turn the `tool_call_id` it answers. Any other key, or a part other than text,
    is an error naming it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries them")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only a tool message carries one")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (but for an assistant turn with tool_calls)")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: object) -> object:
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported (text only)")
        return v

    @field_validator("content")
    @classmethod
    def _unicode(cls, v: str | list[TextPart] | None) -> str | list[TextPart] | None:
        texts = [v] if isinstance(v, str) else [p.text for p in v or ()]
        if not all(is_valid_unicode(t) for t in texts):
            raise ValueError("content is not valid Unicode (it holds a lone surrogate)")
        return v

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(p.text for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """What the chat template receives for this turn (tool call arguments as the
        objects templates render, when they are JSON)."""
        turn: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text,
        }
        if self.name is not None:
            turn["name"] = self.name
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            turn["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _json_or_text(call)},
                }
                for call in self.tool_calls
            ]
        return turn


def _json_or_text(call: AssistantToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


class GenerateRequest(BaseModel):
    """Exactly one of `prompt`, `prompt_token_ids` or `messages` (chat template applied)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    # With `messages`: tool definitions (OpenAI's form) handed to the chat template.
    tools: list[dict[str, Any]] | None = None
    # With `messages`: extra variables for the chat template (e.g. `enable_thinking`).
    chat_template_kwargs: dict[str, Any] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    request_id: str | None = None
    # The first output carries the prompt's text in `prompt` (OpenAI's `echo`).
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _unicode(cls, v: str | None) -> str | None:
        if v is not None and not is_valid_unicode(v):
            raise ValueError("prompt is not valid Unicode (it holds a lone surrogate)")
        return v

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        given = [self.prompt is not None, self.prompt_token_ids is not None, bool(self.messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        return self


class TopLogprob(BaseModel):
    token_id: int
    token: str
    logprob: float


class TokenLogprob(BaseModel):
    """A token's log-probability (the target's log-softmax of the raw logits at its
    position, as vLLM's default) and the `n` most likely tokens there. The prompt's first
    token has none (`logprob` None): nothing comes before it."""

    token_id: int
    token: str
    logprob: float | None
    top: list[TopLogprob] = Field(default_factory=list)


class GenerateOutput(BaseModel):
    request_id: str
    index: int = 0  # which of the request's `n` choices this is
    text: str  # streamed: the new text of this chunk; otherwise the whole answer
    token_ids: list[int]  # likewise
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far (cumulative)
    num_draft_tokens: int = 0  # speculative drafts verified so far
    num_accepted_tokens: int = 0  # of which accepted
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids`, if asked for
    # In the first output only: the prompt's text (with `echo`), and with
    # `sampling_params.prompt_logprobs` one entry per prompt token.
    prompt: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    engine_id: str = ""  # the replica's engine that served it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def joined(pieces: list[GenerateOutput]) -> GenerateOutput:
    """One choice's whole answer from its streamed pieces (in order)."""
    first, last = pieces[0], pieces[-1]
    whole: dict[str, Any] = {
        "text": "".join(p.text for p in pieces),
        "token_ids": [t for p in pieces for t in p.token_ids],
        "prompt": first.prompt,
        "prompt_logprobs": first.prompt_logprobs,
    }
    if last.logprobs is not None:
        whole["logprobs"] = [t for p in pieces for t in p.logprobs or []]
    return last.model_copy(update=whole)
