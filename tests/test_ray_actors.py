"""The engine on Ray actors (no Serve): TP shards in worker actors give the in-process
engine's greedy tokens, and a lost or frozen worker is reported fast instead of hanging."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import ray
from ray_helpers import engine_actor_names, init_local_ray, wait_for
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams
from cluster.actors import EngineClient, PlacementConfig, RayExecutor
from cluster.actors.client import detached
from cluster.actors.ray_executor import _process_exists
from cluster.actors.step_graph import StepGraph
from cluster.actors.step_sockets import StepSockets
from cluster.config import engine_config_from_args
from cluster.engine.errors import EngineDeadError
from cluster.engine.frontend import _newest, stream_outputs
from cluster.llm import build_engine

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # for 3 SmolLM2 shards
PROMPTS = ["What is the capital of France?", "Name a colour.", "one two three four"]
ENGINE = dict(dtype="float32", max_model_len=128, num_kv_blocks=64)
HALF_CPU = PlacementConfig(worker_cpus=0.5, threads_per_worker=1)
CHANNELS = {"compiled_graph": StepGraph, "sockets": StepSockets, "tasks": type(None)}


@pytest.fixture(scope="module")
def ray_session():
    init_local_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    path = str(tmp_path_factory.mktemp("tiny_ray") / "m")
    make_tiny_chat_model(path, smollm2_path, num_hidden_layers=2)
    return path


def in_process(path, prompts, chat=False, params=GREEDY):
    with LLM(path, **ENGINE) as llm:
        if chat:
            conversations = [[{"role": "user", "content": p}] for p in prompts]
            outs = llm.chat(conversations, params, use_tqdm=False)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("channel", list(CHANNELS))
def test_tp2_worker_actors_match_in_process_engine(ray_session, tiny, channel):
    config = engine_config_from_args(tiny, tensor_parallel_size=2, device="cpu", **ENGINE)
    executor = RayExecutor(config, HALF_CPU.model_copy(update={"step_channel": channel}))
    layout = executor.describe()
    assert [w["rank"] for w in layout] == [0, 1]
    assert sorted(w["bundle"] for w in layout) == [0, 1]
    assert len({w["pid"] for w in layout}) == 2  # two processes, one shard each
    engine = build_engine(config, executor)
    assert type(executor.channel.step_channel) is CHANNELS[channel]
    try:
        ids = [engine.next_request_id() for _ in PROMPTS]
        for request_id, prompt in zip(ids, PROMPTS, strict=True):
            engine.add_request(request_id, prompt, GREEDY)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        executor.check_health()
    finally:
        engine.shutdown()
    assert [done[i] for i in ids] == in_process(tiny, PROMPTS)


@pytest.mark.parametrize("channel", ["compiled_graph", "sockets"])
def test_a_rank_that_raises_fails_the_step_while_its_peer_waits_in_a_collective(
    ray_session, tiny, channel
):
    """Rank 1 raises while rank 0 waits in an all-reduce for it (forever): the step must
    still fail at once with rank 1's error (a compiled graph hands back all ranks' replies
    together, so its wait asks the ranks)."""
    config = engine_config_from_args(tiny, tensor_parallel_size=2, device="cpu", **ENGINE)
    executor = RayExecutor(config, HALF_CPU.model_copy(update={"step_channel": channel}))

    def poison(actor):  # runs inside rank 1's actor
        worker = actor.worker
        execute_model = worker.execute_model

        def failing(payload):
            if b"poisoned-request" in payload:
                raise RuntimeError("injected fault")
            return execute_model(payload)

        worker.execute_model = failing

    ray.get(executor.channel.workers[1].__ray_call__.remote(poison))
    engine = build_engine(config, executor)
    assert type(executor.channel.step_channel) is CHANNELS[channel]
    try:
        engine.add_request("poisoned-request", "hello there", GREEDY)
        start = time.monotonic()
        with pytest.raises(
            RuntimeError, match=r"worker rank 1.s step failed: RuntimeError: injected fault"
        ):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 10.0
    finally:
        started = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - started < 10.0  # the stuck rank is killed, not waited for


async def _generate_all(client, prompts, params=GREEDY):
    async def one(prompt):
        outs = [out async for out in client.generate(prompt, params)]
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and outs[-1].finished  # incremental, then done
        return outs[-1].outputs[0].token_ids

    return await asyncio.gather(*(one(p) for p in prompts))


def test_tp3_smollm2_through_scheduler_actor_matches_in_process(ray_session, smollm2_path):
    prompts = PROMPTS[:2]
    config = engine_config_from_args(smollm2_path, tensor_parallel_size=3, device="cpu", **ENGINE)
    client = EngineClient(config, HALF_CPU)
    try:
        tokenizer = client.tokenizer
        chats = [
            {
                "prompt_token_ids": tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            }
            for p in prompts
        ]
        assert [w["rank"] for w in client.layout["workers"]] == [0, 1, 2]
        ours = asyncio.run(_generate_all(client, chats, SHORT))
        after = ray.get(client.scheduler.describe.remote())
        assert after["num_free_kv_blocks"] == after["num_kv_blocks"]  # all freed
        assert after["num_live_requests"] == 0
    finally:
        client.shutdown()
    assert ours == in_process(smollm2_path, prompts, chat=True, params=SHORT)


def _long_params():
    return SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def test_killed_worker_fails_in_flight_requests_within_seconds(ray_session, tiny):
    config = engine_config_from_args(
        tiny, tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=512
    )
    client = EngineClient(config, HALF_CPU, engine_id="killtest")
    assert len(engine_actor_names("cluster-killtest")) == 3  # scheduler + 2 workers
    pid = client.layout["workers"][1]["pid"]

    async def main():
        seen = 0
        killed_at = None
        with pytest.raises(EngineDeadError, match="worker rank 1 is dead"):
            async for out in client.generate("a long answer please", _long_params()):
                seen = len(out.outputs[0].token_ids)
                if killed_at is None and seen >= 2:
                    os.kill(pid, signal.SIGKILL)  # as the OOM killer would: Ray is not told
                    killed_at = time.monotonic()
        assert killed_at is not None and seen < 400
        assert time.monotonic() - killed_at < 5.0
        with pytest.raises(EngineDeadError):  # later requests are refused at once
            async for _ in client.generate("another", GREEDY):
                pass
        with pytest.raises(EngineDeadError):
            await client.check_health()

    try:
        asyncio.run(main())
    finally:
        client.shutdown()
    wait_for(lambda: not engine_actor_names("cluster-killtest"), 10, "the engine's actors to go")


def test_an_exited_process_is_seen_at_once():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(2)  # exited, not yet reaped: a zombie, which must count as gone
    assert not _process_exists(child.pid)
    child.wait()
    assert not _process_exists(child.pid) and _process_exists(os.getpid())


def test_frozen_worker_makes_health_check_report_a_stalled_step(ray_session, tiny):
    config = engine_config_from_args(
        tiny, tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=512
    )
    client = EngineClient(config, HALF_CPU, stall_timeout_s=1.0, engine_id="stalltest")
    pid = client.layout["workers"][1]["pid"]

    async def main():
        assert (await client.check_health())["num_steps"] == 0
        stream = client.generate("keep going", _long_params())
        await stream.__anext__()
        os.kill(pid, signal.SIGSTOP)  # alive to Ray, but it never answers: a zombie
        try:
            await asyncio.sleep(1.5)
            with pytest.raises(Exception, match="the step loop is stalled"):
                await client.check_health(timeout_s=5)
        finally:
            os.kill(pid, signal.SIGCONT)
            await stream.aclose()

    try:
        asyncio.run(main())
    finally:
        client.shutdown()


class _Out:
    def __init__(self, n, finished=False):
        self.n, self.finished = n, finished


def test_newest_merges_until_its_deadline():
    async def main():
        queue = asyncio.Queue()
        for n in range(3):
            queue.put_nowait(_Out(n))
        assert (await _newest(queue, 0.0)).n == 2  # what is already there merges at once
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, queue.put_nowait, _Out(3))
        loop.call_later(0.10, queue.put_nowait, _Out(4, finished=True))
        loop.call_later(0.15, queue.put_nowait, _Out(5))
        start = time.monotonic()
        final = await _newest(queue, loop.time() + 10.0)
        assert (final.n, final.finished) == (4, True)  # a final output ends the wait
        assert time.monotonic() - start < 1.0
        queue.put_nowait(RuntimeError("dead"))
        assert isinstance(await _newest(queue, loop.time() + 10.0), RuntimeError)

    asyncio.run(main())


def test_a_stream_asks_its_interval_after_each_output():
    """`stream_outputs` with a function: asked once per yielded output, and the waits it
    returns decide what merges (0: each output alone; long: merged to the final one)."""

    async def main(waits):
        queue, asked = asyncio.Queue(), []

        def interval():
            asked.append(len(asked))
            return waits[len(asked) - 1]

        loop = asyncio.get_running_loop()
        for n in range(4):
            loop.call_later(0.03 * n, queue.put_nowait, _Out(n, finished=n == 3))
        seen = [out.n async for out in stream_outputs(queue, interval)]
        return seen, len(asked)

    assert asyncio.run(main([0.0, 0.0, 0.0])) == ([0, 1, 2, 3], 3)
    assert asyncio.run(main([10.0])) == ([0, 3], 1)


def test_a_request_that_does_not_stream_gets_only_its_first_and_final_outputs(tiny):
    """`first_and_final` streams (how a replica's client waits for a whole answer) get
    the first output and the final one, the same final output as a stream of every step."""
    from transformers import AutoTokenizer

    from cluster.engine.frontend import FrontEnd
    from cluster.engine.messages import EngineCoreOutput

    config = engine_config_from_args(tiny, device="cpu", **ENGINE)
    frontend = FrontEnd(AutoTokenizer.from_pretrained(tiny), config.model)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tokens = frontend.tokenizer.encode(" one two three four five")[:5]

    async def main():
        queues = {}
        for request_id, first_and_final in (("whole", True), ("stream", False)):
            frontend.admit(request_id, "Count:", params)
            queues[request_id] = frontend.open_stream(request_id, params, first_and_final)
        for i, token in enumerate(tokens):
            reason = "length" if i == len(tokens) - 1 else None
            frontend.process([EngineCoreOutput(r, [token], finish_reason=reason) for r in queues])
        return {r: [q.get_nowait() for _ in range(q.qsize())] for r, q in queues.items()}

    got = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in got["stream"]] == [1, 2, 3, 4, 5]
    assert [len(o.outputs[0].token_ids) for o in got["whole"]] == [1, 5]
    whole, stream = got["whole"][-1].outputs[0], got["stream"][-1].outputs[0]
    assert got["whole"][-1].finished and whole.finish_reason == "length"
    assert (
        (whole.token_ids, whole.text)
        == (stream.token_ids, stream.text)
        == (
            tokens,
            frontend.tokenizer.decode(tokens),
        )
    )


def test_a_stream_is_rate_limited_not_delayed():
    """Outputs slower than the interval go out as they arrive (none waits for the
    interval); outputs faster than it are merged to about one per interval."""

    async def main(gap_s, count, interval_s):
        queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        start = loop.time()
        for n in range(count):
            loop.call_later(gap_s * n, queue.put_nowait, _Out(n, finished=n == count - 1))
        return [
            (out.n, loop.time() - start - gap_s * out.n)
            async for out in stream_outputs(queue, interval_s)
        ]

    slow = asyncio.run(main(0.1, 5, 0.05))
    assert [n for n, _ in slow] == [0, 1, 2, 3, 4]
    assert max(delay for _, delay in slow) < 0.04  # none held back by the 50 ms interval
    fast = asyncio.run(main(0.01, 30, 0.1))  # 300 ms of outputs, one chunk per 100 ms
    assert fast[0][0] == 0 and fast[-1][0] == 29
    assert 3 <= len(fast) <= 6
    assert max(delay for _, delay in fast) < 0.15  # a merged output waits one interval at most


def test_an_abort_that_overtakes_its_add_drops_the_request(ray_session, tiny):
    """The scheduler actor runs calls concurrently, so a client that leaves at once can
    have its abort applied before its add: the add must then not start the request."""
    from cluster.actors.output_socket import read_batches
    from cluster.actors.scheduler_actor import SchedulerActor
    from cluster.actors.wire import encode_request
    from cluster.engine.request import Request

    config = engine_config_from_args(tiny, device="cpu", **ENGINE)
    scheduler = SchedulerActor.options(name="cluster-aborttest-scheduler", namespace="cluster")
    actor = scheduler.remote(config.model_dump_json(), HALF_CPU, None, "cluster-aborttest")
    try:
        ray.get(actor.abort.remote(["early"]))
        request = Request("early", [5, 6, 7], _long_params(), eos_token_id=0)
        ray.get(actor.submit.remote([encode_request(request)]))
        ray.get(actor.submit.remote([encode_request(Request("kept", [5, 6], GREEDY, 0))]))
        seen: set[str] = set()

        async def until_kept_finishes():
            async for batch in read_batches(*ray.get(actor.output_socket.remote())):
                seen.update(o.req_id for o in batch.outputs)
                if any(o.req_id == "kept" and o.finished for o in batch.outputs):
                    return

        asyncio.run(asyncio.wait_for(until_kept_finishes(), 30))
        assert seen == {"kept"}  # "early" never ran
        assert ray.get(actor.health.remote())["num_live_requests"] == 0
    finally:
        ray.kill(actor)


@ray.remote
class _Recorder:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def record(self, value: int) -> None:
        self.seen.append(value)

    def get(self) -> list[int]:
        return self.seen


@ray.remote
class _LeavingCaller:
    async def wait_then_report(self, recorder, value: int) -> None:
        try:
            await asyncio.sleep(60)
        finally:  # what `EngineClient.generate` does when its caller is cancelled
            detached(recorder.record.remote, value)


def test_a_call_made_as_a_cancelled_call_ends_is_not_cancelled_with_it(ray_session):
    """Serve cancels the replica call of a client that left, and Ray cancels that call's
    children: the abort the call sends as it ends must still run (sent plainly, none of
    the eight arrives)."""
    recorder, caller = _Recorder.remote(), _LeavingCaller.remote()
    calls = [caller.wait_then_report.remote(recorder, i) for i in range(8)]
    wait_for(lambda: ray.get(caller.__ray_ready__.remote()) or True, 5, "the caller")
    time.sleep(0.5)  # every call is inside its sleep
    for call in calls:
        ray.cancel(call)
    wait_for(lambda: len(ray.get(recorder.get.remote())) == 8, 10, "all eight reports")
