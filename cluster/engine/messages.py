"""What crosses from the engine core to the workers and back, every step.

Plain typed records with msgpack encode/decode (no pickled objects on this path):
`SchedulerOutput` goes to every worker; `ModelRunnerOutput` comes back from the one
worker that reports (TP rank 0 of the last pipeline stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
from pydantic import BaseModel

from cluster.sampling_params import SamplingParams


def pack(record: Any) -> bytes:
    """msgpack of a record of this module (or `cluster.actors.wire`): each dataclass
    becomes the map of its fields and a pydantic model its dump, as msgpack reaches them
    (no deep copy first, as `dataclasses.asdict` makes: a step's messages are packed
    several times faster)."""
    return msgpack.packb(record, default=_fields)


def _fields(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return {name: getattr(obj, name) for name in obj.__dataclass_fields__}
    if isinstance(obj, BaseModel):
        return obj.model_dump()
    raise TypeError(f"cannot pack {type(obj).__name__}")


@dataclass(frozen=True)
class NewRequestData:
    """A request the workers have not seen (or see again after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when a preempted request resumes
    sampling_params: SamplingParams
    eos_token_id: int | None = None  # kept out until `min_tokens` outputs exist


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of this step, in batch order."""

    req_id: str
    token_ids: list[int]  # tokens to compute now: a prompt chunk, the last sampled token, drafts
    num_computed_tokens: int  # position of token_ids[0]
    num_spec_tokens: int  # the last `num_spec_tokens` of token_ids are drafts to verify
    new_block_ids: list[int]  # blocks appended to the request's block table this step
    sample: bool  # False while a prompt is only partly computed: no token is sampled
    # Draft trees: the parent of each draft (-1: the token before the drafts), None for a
    # chain (`cluster.draft_tree`)
    spec_parents: list[int] | None = None
    # Guided decoding: int32 [1 + num_spec_tokens, ceil(vocab / 32)] allowed-token bits of
    # each sampled row (`cluster.engine.grammar`), None for a request without a grammar
    grammar_bitmask: bytes | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests finished, aborted or preempted since the last step: workers drop their state.
    freed_req_ids: list[str] = field(default_factory=list)
    # Drafts to propose after this step (adaptive speculation); None: the configured k.
    num_drafts: int | None = None
    # [src, dst] cache slots: an accepted draft-tree path's KV, moved where its sequence
    # continues, on every rank before this step's forward (target layers only)
    kv_copies: list[list[int]] = field(default_factory=list)

    def encode(self) -> bytes:
        return pack(self)

    @staticmethod
    def decode(payload: bytes) -> SchedulerOutput:
        data: dict[str, Any] = msgpack.unpackb(payload)
        data["new_requests"] = [
            NewRequestData(**{**d, "sampling_params": SamplingParams(**d["sampling_params"])})
            for d in data["new_requests"]
        ]
        data["scheduled"] = [ScheduledRequest(**d) for d in data["scheduled"]]
        return SchedulerOutput(**data)


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs of one sampled token: ids[0] is the token itself, then the top-n."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of prompt tokens `first + 1 ..`, from the rows at positions `first ..` of
    one prompt chunk (`tokens[i]` is prompt token `first + 1 + i` under position
    `first + i`'s logits)."""

    first: int
    tokens: list[TokenLogprobs]


@dataclass(frozen=True)
class ModelRunnerOutput:
    step_id: int
    req_ids: list[str]
    # Per scheduled request: accepted drafts then the recovered or bonus token; [] when
    # nothing was sampled (a partial prefill).
    sampled_token_ids: list[list[int]]
    # Per request, per sampled token (only for requests that asked for logprobs).
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Per request, drafts for the next step (empty when speculation is off).
    draft_token_ids: list[list[int]] = field(default_factory=list)
    # Per request that asked for prompt logprobs and computed prompt tokens this step.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Per request, the parents of its next drafts when they form a tree (None: a chain).
    draft_parents: list[list[int] | None] = field(default_factory=list)
    # Per request verified against a draft tree: the accepted path's nodes.
    accepted_nodes: dict[str, list[int]] = field(default_factory=dict)

    def encode(self) -> bytes:
        return pack(self)

    @staticmethod
    def decode(payload: bytes) -> ModelRunnerOutput:
        data: dict[str, Any] = msgpack.unpackb(payload)
        data["logprobs"] = {
            req_id: [TokenLogprobs(**t) for t in tokens]
            for req_id, tokens in data["logprobs"].items()
        }
        data["prompt_logprobs"] = {
            req_id: PromptLogprobs(p["first"], [TokenLogprobs(**t) for t in p["tokens"]])
            for req_id, p in data["prompt_logprobs"].items()
        }
        return ModelRunnerOutput(**data)


@dataclass(frozen=True)
class EngineCoreOutput:
    """What one step produced for one request (the engine core's output, per request)."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0  # drafts verified this step
    num_accepted_tokens: int = 0  # of which accepted
    # The prompt's logprobs (tokens 1.. of the prompt), with a request's first new tokens.
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
