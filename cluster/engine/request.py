"""A request's state inside the engine core (the scheduler's view)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cluster.engine.messages import TokenLogprobs
from cluster.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    # Draft tokens proposed for the next step (verified by the target there).
    spec_token_ids: list[int] = field(default_factory=list)
    # Their parents when they form a tree (-1: the last token), None for a chain.
    spec_parents: list[int] | None = None
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prompt logprobs gathered chunk by chunk, for a request that asked; None once they
    # went out with its first tokens (and for every other request).
    prompt_logprobs: list[TokenLogprobs] | None = None

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def token_id(self, index: int) -> int:
        """Token at position `index` of prompt + output + spec tokens."""
        if index < len(self.prompt_token_ids):
            return self.prompt_token_ids[index]
        index -= len(self.prompt_token_ids)
        if index < len(self.output_token_ids):
            return self.output_token_ids[index]
        return self.spec_token_ids[index - len(self.output_token_ids)]

    def token_ids(self, start: int, end: int) -> list[int]:
        return [self.token_id(i) for i in range(start, end)]

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.set_drafts([])

    def set_drafts(self, tokens: list[int], parents: list[int] | None = None) -> None:
        self.spec_token_ids = tokens
        self.spec_parents = parents if tokens else None
