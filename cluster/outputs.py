"""What users get back (vLLM's names): `RequestOutput` holding one `CompletionOutput`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Logprob(BaseModel):
    model_config = ConfigDict(frozen=True)

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionOutput(BaseModel):
    index: int = 0
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One dict per output token: token id -> Logprob (the sampled token and the top-n).
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Speculative decoding, for this request: drafts verified and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(BaseModel):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # With `SamplingParams.prompt_logprobs`: per prompt token, token id -> Logprob (the
    # token itself and the top-n), None for the first token, which nothing predicts.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    outputs: list[CompletionOutput]
    finished: bool
