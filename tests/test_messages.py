"""Scheduler and model-runner outputs survive msgpack encoding exactly (no pickle)."""

import msgpack

from cluster.actors.wire import OutputBatch
from cluster.engine.messages import (
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from cluster.engine.stats import EngineStats
from cluster.sampling_params import SamplingParams


def test_scheduler_output_round_trip():
    so = SchedulerOutput(
        step_id=7,
        new_requests=[
            NewRequestData(
                "r1", [1, 2, 3], [], SamplingParams(temperature=0.5, top_k=5, stop=["x"], seed=3)
            ),
            NewRequestData(
                "r2", [4], [9, 9], SamplingParams(stop_token_ids=[2], logprobs=2, prompt_logprobs=0)
            ),
        ],
        scheduled=[
            ScheduledRequest("r1", [1, 2, 3], 0, 0, [0, 1], True),
            ScheduledRequest("r2", [9, 5, 6], 3, 2, [], True),
        ],
        freed_req_ids=["old"],
    )
    payload = so.encode()
    assert isinstance(payload, bytes)
    msgpack.unpackb(payload)  # plain msgpack, readable anywhere
    assert SchedulerOutput.decode(payload) == so
    assert sum(len(s.token_ids) for s in so.scheduled) == 6


def test_model_runner_output_round_trip():
    out = ModelRunnerOutput(
        step_id=3,
        req_ids=["a", "b"],
        sampled_token_ids=[[5, 6], []],
        logprobs={
            "a": [TokenLogprobs([5, 5, 8], [-0.1, -0.1, -2.5], 1), TokenLogprobs([6], [-0.7], 2)]
        },
        draft_token_ids=[[1, 2], []],
        prompt_logprobs={"b": PromptLogprobs(16, [TokenLogprobs([7, 3], [-4.0, -0.2], 9)])},
    )
    assert ModelRunnerOutput.decode(out.encode()) == out


def test_output_batch_round_trip():
    lp = [TokenLogprobs([7, 3], [-4.0, -0.2], 9)]
    batch = OutputBatch(
        [EngineCoreOutput("a", [5], lp, prompt_logprobs=lp), EngineCoreOutput("b", [], None)],
        EngineStats(num_running=1),
    )
    assert OutputBatch.decode(batch.encode()) == batch
