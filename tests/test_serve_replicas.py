"""Two TP=2 replicas of a tiny model behind the OpenAI route: both serve, back-pressure is
a real 503, a killed worker fails only its replica's requests (fast) and that replica
restarts its engine in place; failed or refused deploys leave no actors behind."""

import asyncio
import dataclasses
import json
import os
import shutil
import time

import openai
import pytest
import ray
import yaml
from ray import serve
from ray_helpers import engine_actor_names, init_local_ray, wait_for
from tiny_models import make_tiny_chat_model

from cluster.serve import ManifestError, build_openai_app, load_manifest
from cluster.serve.launch import deploy

LONG = {"model": "tiny", "prompt": "go on", "max_tokens": 1500, "extra_body": {"ignore_eos": True}}


def write_manifest(folder, model_path, tp=2, request_router="least_loaded", **deployment):
    args = {
        "model": {"path": model_path, "id": "tiny", "device": "cpu", "dtype": "float32"},
        "parallel": {"tensor_parallel_size": tp},
        "placement": {"worker_cpus": 0.25, "threads_per_worker": 1},
        "cache": {"num_kv_blocks": 256},
        "scheduler": {"max_num_seqs": 8},
    }
    args["model"]["max_model_len"] = 1600
    args["server"] = {"request_router": request_router}
    app = {"name": "tiny", "import_path": "cluster.serve:build_app", "args": args}
    app["deployments"] = [{"name": "LLMServer", **deployment}]
    path = os.path.join(folder, f"tiny-tp{tp}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"applications": [app]}, f)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    folder = str(tmp_path_factory.mktemp("replicas"))
    model = os.path.join(folder, "m")
    make_tiny_chat_model(model, smollm2_path, num_hidden_layers=2, max_position_embeddings=2048)
    return folder, model


@pytest.fixture(scope="module")
def app(tiny):
    folder, model = tiny
    manifest = load_manifest(
        write_manifest(
            folder,
            model,
            num_replicas=2,
            max_ongoing_requests=1,
            max_queued_requests=1,
            health_check_period_s=1,
            graceful_shutdown_timeout_s=1,
        )
    )
    init_local_ray(num_cpus=2)
    _, url = deploy(manifest)
    wait_for(lambda: asyncio.run(_both_replicas_take_a_stream(url)), 60, "both replicas routable")
    yield url
    serve.shutdown()
    ray.shutdown()


def _client(url):
    """A client for the running event loop (its connections belong to that loop)."""
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def _open(client):
    """A long stream that has produced its first chunk."""
    stream = await client.completions.create(**LONG, stream=True)
    await stream.__anext__()
    return stream


async def _both_replicas_take_a_stream(url: str) -> bool:
    """Whether two streams opened together both start at once. Serve says "ready" before
    HAProxy's health checks have marked every replica up; until then it answers 503 or sends
    both streams to one replica, where the second waits for the first to end."""
    client = _client(url)
    try:
        first = await _open(client)
    except openai.InternalServerError:  # a 503: HAProxy has no replica marked up yet
        return False
    try:
        second = await asyncio.wait_for(_open(client), timeout=5)
    except TimeoutError:
        return False
    finally:
        await first.close()
    await second.close()
    return True


def _stats_by_engine(handle):
    s = handle.stats.remote().result()
    return {s["engine_id"]: s}


def _engines():
    """Engine ids of the running replicas (from their scheduler actors' names)."""
    return {n.split("-")[1] for n in engine_actor_names() if n.endswith("-scheduler")}


def test_both_replicas_serve_and_backpressure_is_a_503(app):
    assert len(_engines()) == 2  # one engine (scheduler + 2 workers) per replica
    assert len(engine_actor_names()) == 6
    # max_queued_requests=1 bounds each caller's queue: Serve's proxy holds one queue for
    # the deployment, while behind HAProxy each replica's own HTTP server holds one.
    ingress = serve.get_app_handle("tiny").stats.remote().result()["http_ingress"]
    num_queued = {"proxy": 1, "haproxy": 2}[ingress]

    async def main():
        # A replica takes one request at a time (max_ongoing_requests=1), so two streams
        # running at once are served by the two replicas; the next ones find both full and
        # queue, and one more is refused.
        client = _client(app)
        a = await _open(client)
        b = await _open(client)
        queued = []
        for _ in range(num_queued):
            queued.append(asyncio.ensure_future(_open(client)))  # no first chunk yet
            await asyncio.sleep(0.5)
        with pytest.raises(openai.APIStatusError) as e:
            await client.completions.create(**LONG, stream=True)
        assert e.value.status_code == 503  # a real status, not a 200 with a broken stream
        assert "backpressure" in json.dumps(e.value.body)  # Serve says why
        # the queued ones were not refused (one may be served by now: a tiny model's long
        # stream can finish while the others wait)
        assert not any(q.done() and q.exception() is not None for q in queued)
        for q in queued:
            q.cancel()
        await a.close()
        await b.close()

    asyncio.run(main())


def test_killed_worker_fails_its_replica_only_and_the_engine_restarts_in_place(app):
    before = _engines()
    # both streams must start at once, one a replica (not one waiting behind the other)
    wait_for(lambda: asyncio.run(_both_replicas_take_a_stream(app)), 60, "both replicas routable")

    async def read_all(stream):
        """(when it ended, the text or the error)."""
        try:
            text = "".join([c.choices[0].text async for c in stream])
        except openai.APIError as e:
            return time.monotonic(), e
        return time.monotonic(), text

    async def main():
        client = _client(app)
        a, b = await asyncio.gather(_open(client), _open(client))
        # Which replica serves `a` is the router's choice: kill a worker of one engine and
        # tell the streams apart by which one breaks.
        victim = sorted(before)[0]
        ray.kill(ray.get_actor(f"cluster-{victim}-worker-1", namespace="cluster"))
        killed_at = time.monotonic()
        results = await asyncio.gather(read_all(a), read_all(b))
        failed = [(t, r) for t, r in results if isinstance(r, Exception)]
        assert len(failed) == 1, results  # only the victim's request fails ...
        ended, error = failed[0]
        assert "dead" in str(error) and ended - killed_at < 10  # ... with an error, fast
        survivor = next(r for _, r in results if isinstance(r, str))
        assert survivor  # the other replica's stream ran to its end
        return victim

    victim = asyncio.run(main())

    def restarted():
        return len(engine_actor_names()) == 6 and victim not in _engines()

    wait_for(restarted, 90, "the victim's replica to restart its engine")
    assert not engine_actor_names(f"cluster-{victim}")  # its scheduler and workers are gone
    after = _engines()
    assert len(after) == 2 and len(after & before) == 1  # the survivor and a new engine
    # The new engine runs in the victim's replica (not in a replacement): that replica
    # counts one restart.
    (new,) = after - before
    handle = serve.get_deployment_handle("LLMServer", "tiny")
    stats = {}
    wait_for(
        lambda: new in stats or bool(stats.update(_stats_by_engine(handle))),
        30,
        "the router to reach the restarted replica",
    )
    assert stats[new]["engine_restarts"] == 1

    async def both_serve():
        client = _client(app)
        streams = [await _open(client), await _open(client)]  # one per replica, at once
        for stream in streams:
            await stream.close()

    asyncio.run(both_serve())


def test_failed_deploy_leaves_no_actors(app, tiny):
    folder, model = tiny
    broken = os.path.join(folder, "no-weights")
    os.makedirs(broken)
    for name in os.listdir(model):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(model, name), broken)
    args = load_manifest(write_manifest(folder, broken)).args  # the config is fine ...
    before = set(engine_actor_names())
    overrides = {"LLMServer": {"max_constructor_retry_count": 1}}
    with pytest.raises(RuntimeError, match="Deploying application broken failed"):
        serve.run(build_openai_app(args, overrides), name="broken", route_prefix="/broken")
    status = serve.status().applications["broken"].deployments["LLMServer"]
    assert "no *.safetensors or pytorch_model*.bin files" in status.message  # no weights
    serve.delete("broken")
    wait_for(lambda: set(engine_actor_names()) <= before, 30, "the failed engines' actors to go")


def test_refused_manifest_starts_nothing(app, tiny):
    folder, model = tiny
    before = engine_actor_names()
    with pytest.raises(ManifestError, match="must divide"):  # 4 heads, TP=3
        deploy(load_manifest(write_manifest(folder, model, tp=3)))
    assert engine_actor_names() == before
    assert set(serve.status().applications) == {"tiny"}


def _scaler_placement_groups() -> int:
    """Live placement groups of the one-rank `scaler` app (the `tiny` app's have two)."""
    table = ray.util.placement_group_table().values()
    return sum(pg["state"] == "CREATED" and len(pg["bundles"]) == 1 for pg in table)


def test_autoscaling_scales_up_under_load_down_to_zero_and_back(app, tiny):
    """An `autoscaling_config` of 0-2 replicas, scaling on the engines' sequences: 4 streams
    kept open against a target of 2 per replica bring a second replica (its placement
    group with it) and no request fails; idle, the app scales to zero, and the next
    request starts a replica and is answered."""
    folder, model = tiny
    autoscaling = {
        "min_replicas": 0,
        "initial_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 2,
        "upscale_delay_s": 0,
        "downscale_delay_s": 2,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 1,
    }
    manifest = load_manifest(
        write_manifest(
            folder,
            model,
            tp=1,
            request_router="prefix",  # what `auto` is behind HAProxy
            autoscaling_config=autoscaling,
            graceful_shutdown_timeout_s=1,
        )
    )
    manifest = dataclasses.replace(manifest, app_name="scaler", route_prefix="/scaler")
    handle, url = deploy(manifest)

    def replicas() -> int:
        state = serve.status().applications["scaler"].deployments["LLMServer"]
        return state.replica_states.get("RUNNING", 0)

    assert replicas() == 1 and _scaler_placement_groups() == 1
    assert handle.record_autoscaling_stats.remote().result() == {
        "ongoing_sequences": 0.0,
        "waiting_sequences": 0.0,
        "kv_usage": 0.0,
    }
    errors: list[Exception] = []

    def reported_load() -> float:
        assert not errors, errors
        return handle.record_autoscaling_stats.remote().result()["ongoing_sequences"]

    def busy_until_scaled_up() -> None:
        load = wait_for(reported_load, 30, "the replica to report its engine's sequences")
        assert load <= 4
        wait_for(lambda: replicas() == 2, 90, "a second replica under load")
        assert _scaler_placement_groups() == 2  # its ranks came as one placement group

    async def load(stop: asyncio.Event) -> None:
        """Keep 4 streams open until the second replica is up."""
        client = _client(url)

        async def user() -> None:
            while not stop.is_set():
                try:
                    stream = await client.completions.create(**LONG, stream=True)
                    async for _ in stream:
                        if stop.is_set():
                            await stream.close()
                            break
                except Exception as e:  # any failure is the test's failure
                    errors.append(e)
                    return

        users = [asyncio.ensure_future(user()) for _ in range(4)]
        try:
            await asyncio.to_thread(busy_until_scaled_up)
        finally:
            stop.set()
            await asyncio.gather(*users)

    asyncio.run(load(asyncio.Event()))
    assert not errors, errors
    wait_for(lambda: replicas() == 0, 60, "scaling down to zero")
    wait_for(lambda: _scaler_placement_groups() == 0, 30, "the replicas' placement groups to go")
    cold = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert cold.completions.create(model="tiny", prompt="hi", max_tokens=4).choices[0].text
    assert replicas() == 1
    serve.delete("scaler")


def test_prefix_routing_sends_a_prompt_to_the_replica_caching_its_prefix(app, tiny):
    """Two replicas, four long system prompts, each sent twice in a row, twice over: the
    route server names for each request the replica caching its system prompt, so each
    prompt misses the cache once (round robin or least-connections would send the two
    requests of a pair to both replicas and miss twice per prompt)."""
    folder, model = tiny
    path = write_manifest(folder, model, tp=1, request_router="prefix", num_replicas=2)
    manifest = dataclasses.replace(load_manifest(path), app_name="prefix", route_prefix="/prefix")
    before = _engines()
    _, url = deploy(manifest)
    assert "PrefixRouter" in serve.status().applications["prefix"].deployments
    wait_for(lambda: asyncio.run(_both_replicas_take_a_stream(url)), 60, "both replicas routable")
    engines = _engines() - before
    assert len(engines) == 2

    def hit_tokens() -> int:
        schedulers = [ray.get_actor(f"cluster-{e}-scheduler", namespace="cluster") for e in engines]
        return sum(ray.get(s.describe.remote())["prefix_cache_hit_tokens"] for s in schedulers)

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    systems = [" ".join(f"rule {i} of system {s}." for i in range(24)) for s in "ABCD"]
    misses = []
    for i in range(16):
        hits = hit_tokens()
        prompt = f"{systems[(i // 2) % 4]} user {i} asks"
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
        if hit_tokens() == hits:
            misses.append(i)
    # Each prompt's first request misses. Round robin or least-connections put every prompt
    # in both caches: 8 misses. Allow two more than the router's 4: HAProxy redispatches a
    # request whose pinned replica is slow to accept it (`option redispatch`), and on a
    # loaded machine (the full suite) two such lapses in 16 requests have been seen.
    assert {0, 2, 4, 6} <= set(misses) and len(misses) <= 6, misses
    serve.delete("prefix")
