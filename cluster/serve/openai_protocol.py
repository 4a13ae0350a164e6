"""OpenAI request models (pydantic) and the response / stream-chunk bodies built from
`GenerateOutput`s, for `/v1/completions` and `/v1/chat/completions`.

`logprobs` (completions: how many top tokens; chat: `logprobs` + `top_logprobs`) are the
target's log-softmax of the raw logits at each output position, as vLLM returns by
default, and the same with speculation on or off; completions' `echo` puts the prompt
(and its tokens' logprobs) before the completion. Other sampling fields map one to one
onto `SamplingParams` (vLLM's extensions `top_k` (0 or -1: off), `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `min_tokens` are accepted too, and
OpenAI's `logit_bias`); every bad value becomes a 400 naming the field.

No field is ignored in silence. Every field of OpenAI's requests is one of: honoured;
accepted with no effect on what is computed (`NO_EFFECT_FIELDS`: identifiers and hints
such as `user`); or refused with a 400 naming it unless it holds its neutral value
(`UNSUPPORTED_FIELDS`, e.g. `tools`). A field OpenAI's API does not have is refused too
(vLLM's extensions named above and its guided-decoding fields are honoured).

`response_format` (`json_object`, `json_schema`) and vLLM's `structured_outputs` /
`guided_*` fields become the request's `StructuredOutputsParams`: the grammar masks every
sampled position, drafts included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.sampling_params import MAX_CHOICES, SamplingParams
from cluster.serve.protocol import ChatMessage
from cluster.serve.tools import Tool, ToolCalling, ToolChoice
from cluster.structured_outputs import StructuredOutputsParams

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
_SAMPLING_FIELDS = (
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
    "min_tokens",
    "ignore_eos",
    "logit_bias",
)


# Accepted and passed over: they name or describe the caller, or hint at things this
# server does anyway (prefix caching) or has no notion of (service tiers).
NO_EFFECT_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "safety_identifier",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
    }
)


def _off(value: Any) -> bool:
    return value is None or value is False or value in ("", "none", [], {})


# Fields this server cannot honour: refused (400 naming the field) unless they hold the
# value that asks for nothing.
UNSUPPORTED_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "functions": ("function calling is not supported", _off),
    "function_call": ("function calling is not supported", _off),
    "audio": ("audio output is not supported", _off),
    "modalities": ("text only", lambda v: v is None or v == ["text"]),
    "prediction": ("predicted outputs are not supported", _off),
    "web_search_options": ("web search is not supported", _off),
    "reasoning_effort": ("no reasoning settings here", _off),
    "verbosity": ("not supported", _off),
    "store": ("responses are not stored", _off),
    "suffix": ("insertion (a suffix) is not supported", _off),
    "moderation": ("no moderation here", _off),
}


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's named schema (`strict` is how we follow it
    anyway: the grammar allows nothing else)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema is given with type 'json_schema'")
        return self

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.json_schema)  # type: ignore[union-attr]
        return None


# vLLM's older request fields for guided decoding -> `structured_outputs` keys.
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        """Refuse unsupported fields that ask for something; drop the no-effect ones."""
        if not isinstance(data, dict):
            return data
        for name, (why, neutral) in UNSUPPORTED_FIELDS.items():
            if name in data and not neutral(data[name]):
                raise ValueError(f"{name}: not supported by this server ({why})")
        dropped = NO_EFFECT_FIELDS | UNSUPPORTED_FIELDS.keys()
        return {k: v for k, v in data.items() if k not in dropped}

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, v: int | None) -> int | None:
        return -1 if v == 0 else v  # vLLM's convention: 0 and -1 both turn top-k off

    model: str
    # Choices per request: each is its own engine request (sharing the prompt's cached
    # blocks); with a seed, choice i samples with seed + i, as vLLM does.
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
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
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Guided decoding: OpenAI's `response_format`, or vLLM's `structured_outputs` (and its
    # older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _tool_outputs(self) -> StructuredOutputsParams | None:
        return None  # chat requests: the grammar of a named or required tool call

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        given = {
            name: value
            for name, value in (
                ("tool_choice", self._tool_outputs()),
                (
                    "response_format",
                    self.response_format and self.response_format.structured_outputs(),
                ),
                ("structured_outputs", self.structured_outputs),
                *(
                    (f, StructuredOutputsParams(**{key: getattr(self, f)}))
                    for f, key in _GUIDED_FIELDS.items()
                    if getattr(self, f) is not None
                ),
            )
            if value is not None
        }
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: give one way to shape the output")
        return next(iter(given.values()), None)

    def _sampling(self, max_tokens: int | None, **fields: Any) -> SamplingParams:
        values = {f: getattr(self, f) for f in _SAMPLING_FIELDS if getattr(self, f) is not None}
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            structured_outputs=self._structured_outputs(),
            **fields,
            **values,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_OpenAIRequest):
    # one prompt (text or token ids) or a list of them; choice i * n + j is prompt i's j-th
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    max_tokens: int | None = 16
    # The prompt comes back before the completion (its tokens' logprobs too, with
    # `logprobs`); with `max_tokens: 0` only the prompt does (scoring a text).
    echo: bool = False
    best_of: int | None = None
    # The log-probabilities of this many most likely tokens at each position (and of the
    # chosen one), as OpenAI's legacy completions do.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the engine samples one token nobody sees."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported by this server (use n)")
        prompt_logprobs = self.logprobs if self.echo else None
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self._sampling(max_tokens, logprobs=self.logprobs, prompt_logprobs=prompt_logprobs)

    def prompts(self) -> list[dict[str, Any]]:
        """Each prompt's `GenerateRequest` fields, in order."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]  # type: ignore[assignment]
        key = {str: "prompt", list: "prompt_token_ids"}
        return [{key[type(p)]: p, "echo": self.echo} for p in prompt]  # type: ignore[union-attr]


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Tool calling (`cluster.serve.tools`): the tools reach the chat template; the choice
    # decides how the answer is shaped and read ("auto" by default when tools are given).
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_calling(self) -> ToolCalling | None:
        """How the answer is read (None: plain text); raises ValueError naming the field."""
        return ToolCalling.plan(self.tools, self.tool_choice, self.parallel_tool_calls)[0]

    def _tool_outputs(self) -> StructuredOutputsParams | None:
        return ToolCalling.plan(self.tools, self.tool_choice, self.parallel_tool_calls)[1]

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def sampling_params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(self.max_completion_tokens or self.max_tokens, logprobs=logprobs)

    def prompts(self) -> list[dict[str, Any]]:
        tools = None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools]
        template = self.chat_template_kwargs
        return [{"messages": self.messages, "tools": tools, "chat_template_kwargs": template}]


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a text prompt, or chat `messages` through the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's `/detokenize`: token ids back to text."""

    model_config = ConfigDict(extra="forbid")

    model: str
    tokens: list[int]
