"""msgpack forms of what crosses between a Serve replica and its scheduler actor.

Requests go in (token ids and sampling parameters, already validated by the replica);
batches of per-request step outputs come back with a snapshot of the engine's state.
Plain data only, like the scheduler <-> worker messages: no pickled objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from cluster.engine.messages import EngineCoreOutput, TokenLogprobs, pack
from cluster.engine.request import Request
from cluster.engine.stats import EngineStats
from cluster.sampling_params import SamplingParams


def encode_request(request: Request) -> bytes:
    return msgpack.packb(
        {
            "request_id": request.request_id,
            "prompt_token_ids": request.prompt_token_ids,
            "sampling_params": request.sampling_params.model_dump(),
            "eos_token_id": request.eos_token_id,
        }
    )


def decode_request(payload: bytes) -> Request:
    data = msgpack.unpackb(payload)
    return Request(
        data["request_id"],
        data["prompt_token_ids"],
        SamplingParams(**data["sampling_params"]),
        eos_token_id=data["eos_token_id"],
    )


@dataclass(frozen=True)
class OutputBatch:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)
    error: str | None = None  # set once the step loop has died

    def encode(self) -> bytes:
        return pack(self)

    @staticmethod
    def decode(payload: bytes) -> OutputBatch:
        data: dict[str, Any] = msgpack.unpackb(payload)
        outputs = []
        for o in data["outputs"]:
            if o["new_logprobs"] is not None:
                o["new_logprobs"] = [TokenLogprobs(**t) for t in o["new_logprobs"]]
            if o["prompt_logprobs"] is not None:
                o["prompt_logprobs"] = [TokenLogprobs(**t) for t in o["prompt_logprobs"]]
            outputs.append(EngineCoreOutput(**o))
        return OutputBatch(outputs, EngineStats(**data["stats"]), data["error"])
