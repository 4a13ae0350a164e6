"""A request's state inside the engine core (the scheduler's view)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cluster.draft_tree import DraftTree
from cluster.engine.grammar import RequestGrammar
from cluster.engine.messages import PromptLogprobs, TokenLogprobs
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
    # Guided decoding: the grammar state of the output so far (set by the engine core).
    grammar: RequestGrammar | None = None

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = []

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

    def gather_prompt_logprobs(
        self, chunk: PromptLogprobs | None, first_output: bool
    ) -> list[TokenLogprobs] | None:
        """Add a chunk's prompt logprobs (a recomputed chunk after a preemption adds only
        what is missing); all of them once the request has output to go out with."""
        gathered = self.prompt_logprobs
        if gathered is None:
            return None
        if chunk is not None and chunk.first <= len(gathered):
            gathered += chunk.tokens[len(gathered) - chunk.first :]
        if not first_output:
            return None
        self.prompt_logprobs = None
        return gathered

    def append_checking_stops(self, generated: list[int], max_model_len: int) -> list[int]:
        """Append tokens one by one, stopping at the first that ends the request."""
        params = self.sampling_params
        appended: list[int] = []
        for token in generated:
            self.output_token_ids.append(token)
            appended.append(token)
            if not params.ignore_eos and token == self.eos_token_id:
                self.finish(FinishReason.STOP)
            elif token in params.stop_token_ids:
                self.finish(FinishReason.STOP, stop_reason=token)
            elif (
                self.max_tokens is not None and len(self.output_token_ids) >= self.max_tokens
            ) or self.num_tokens >= max_model_len:
                self.finish(FinishReason.LENGTH)
            if self.is_finished:
                break
        if self.grammar is not None:
            self.grammar.accept(appended)
        return appended

    def set_limited_drafts(
        self, drafts: list[int], parents: list[int] | None, max_model_len: int
    ) -> None:
        """The next step's drafts, none past max_tokens (a step yields at most depth + 1
        tokens) or max_model_len (every draft takes a slot), nor past the first one the
        request's grammar forbids."""
        if self.grammar is not None:
            count = self.grammar.num_valid_drafts(drafts, parents)
            drafts, parents = drafts[:count], None if parents is None else parents[:count]
        room = max_model_len - self.num_tokens
        depth_room = room
        if self.max_tokens is not None:
            depth_room = min(room, self.max_tokens - len(self.output_token_ids) - 1)
        if parents is None:
            self.set_drafts(list(drafts[: max(0, depth_room)]))
            return
        depths = DraftTree(tuple(drafts), tuple(parents)).depths
        # nodes come parents first, so a prefix of them is a tree
        count = 0
        while count < min(len(drafts), room) and depths[count] <= depth_room:
            count += 1
        self.set_drafts(list(drafts[:count]), list(parents[:count]))
