"""The async engine: concurrent streams, aborts, and bad requests that harm nobody else."""

import asyncio
import itertools

import pytest
from tiny_models import make_tiny_chat_model

from cluster import SamplingParams
from cluster.config import engine_config_from_args
from cluster.engine.async_llm import AsyncLLM
from cluster.llm import build_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_path):
    path = str(tmp_path_factory.mktemp("tiny_async") / "m")
    make_tiny_chat_model(path, smollm2_path, num_hidden_layers=2)
    config = engine_config_from_args(path, dtype="float32", max_model_len=128, num_kv_blocks=64)
    engine = AsyncLLM(build_engine(config))
    yield engine
    engine.shutdown()


async def _collect(engine, prompt, params, request_id=None):
    outputs = [out async for out in engine.generate(prompt, params, request_id)]
    return outputs


def test_streams_are_incremental_and_match_offline(engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        return await asyncio.gather(
            *(_collect(engine, p, params) for p in ["one", "two three", "four"])
        )

    streams = asyncio.run(main())
    for outputs in streams:
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(lengths) and lengths[-1] == 12
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        texts = [o.outputs[0].text for o in outputs]
        assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    # the same prompt alone gives the same tokens (batching never changes greedy output)
    alone = asyncio.run(_collect(engine, "two three", params))
    assert alone[-1].outputs[0].token_ids == streams[1][-1].outputs[0].token_ids


def test_bad_request_fails_alone(engine):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def main():
        good = asyncio.ensure_future(_collect(engine, "a good prompt", params))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="the prompt is empty"):
            await _collect(engine, {"prompt_token_ids": []}, params)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(engine, {"prompt_token_ids": [10**9]}, params)
        return await good

    outputs = asyncio.run(main())
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert len(outputs[-1].outputs[0].token_ids) == 30


def test_abort_and_early_exit_free_the_request(engine):
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        seen = 0
        async for out in engine.generate("stream me", params, "leaver"):
            seen = len(out.outputs[0].token_ids)
            if seen >= 3:
                break  # a client disconnect
        await asyncio.sleep(0.2)
        return seen

    assert asyncio.run(main()) >= 3
    assert engine.num_unfinished_requests == 0
    core = engine.core
    assert not core.has_unfinished_requests()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    engine.check_health()


def test_n_sequences_stream_together_and_leaving_frees_them_all(engine):
    """`n` = 3 through the async API: each output holds all three completions so far
    (index 0..2, cumulative), the last one finished only when all are; sequence j is the
    request seeded with seed + j alone. Leaving early aborts every sequence."""
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, n=3)
    outputs = asyncio.run(_collect(engine, "once upon", params, "fan"))
    assert all(o.request_id == "fan" for o in outputs)
    assert all([c.index for c in o.outputs] == [0, 1, 2] for o in outputs)
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    for before, after in itertools.pairwise(outputs):
        for a, b in zip(before.outputs, after.outputs, strict=True):
            assert b.token_ids[: len(a.token_ids)] == a.token_ids
    for j, completion in enumerate(outputs[-1].outputs):
        alone = params.model_copy(update={"n": 1, "seed": 5 + j})
        assert (
            completion.token_ids
            == asyncio.run(_collect(engine, "once upon", alone))[-1].outputs[0].token_ids
        )
    assert len({tuple(c.token_ids) for c in outputs[-1].outputs}) > 1

    long = params.model_copy(update={"max_tokens": 100})

    async def leave_early():
        async for out in engine.generate("stream me", long, "fan-leaver"):
            if sum(len(c.token_ids) for c in out.outputs) >= 3:
                break
        await asyncio.sleep(0.2)

    asyncio.run(leave_early())
    assert engine.num_unfinished_requests == 0
    core = engine.core
    assert not core.has_unfinished_requests()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
