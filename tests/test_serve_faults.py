"""The load-and-fault suite: a served engine (TP=2, n-gram speculation, an API key) under a
mix of valid and invalid requests at concurrency, dropped streams, a fuzz of its OpenAPI
schema, and a killed worker. No request may get a 5xx but a dead engine's 503; valid
greedy answers equal their serial ones; and after every part the engine is idle again (no
live requests, every KV block free).

CI runs a bounded version; the whole of it runs from one command:

    CLUSTER_FAULTS_FULL=1 python -m pytest tests/test_serve_faults.py
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from typing import Any

import httpx
import pytest
import ray
import yaml
from hypothesis import HealthCheck, given, settings
from ray import serve
from ray_helpers import init_local_ray, wait_for
from tiny_models import make_tiny_chat_model

from cluster.serve import load_manifest
from cluster.serve.launch import deploy

FULL = os.environ.get("CLUSTER_FAULTS_FULL") == "1"
NUM_REQUESTS = 400 if FULL else 120
NUM_FUZZ = 400 if FULL else 60
CONCURRENCY = 16
API_KEY = "sk-faults"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny"
PROMPTS = ["Once upon a time", "The list: one, two,", "def add(a, b):", "Q: why? A:"]
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    folder = tmp_path_factory.mktemp("faults")
    model = str(folder / "m")
    make_tiny_chat_model(model, smollm2_path, num_hidden_layers=2)
    args = {
        "model": {"path": model, "id": MODEL, "device": "cpu", "dtype": "float32"},
        "parallel": {"tensor_parallel_size": 2},
        "placement": {"worker_cpus": 0.25, "threads_per_worker": 1},
        "cache": {"num_kv_blocks": 128},
        "scheduler": {"max_num_seqs": 8},
        "speculative": {"method": "ngram", "num_speculative_tokens": 3},
        "server": {"api_key": API_KEY, "max_waiting_requests": 64},
    }
    args["model"]["max_model_len"] = MAX_MODEL_LEN
    app = {"name": "faults", "import_path": "cluster.serve:build_app", "args": args}
    app["deployments"] = [
        {"name": "LLMServer", "health_check_period_s": 1, "graceful_shutdown_timeout_s": 1}
    ]
    path = folder / "faults.yaml"
    path.write_text(yaml.safe_dump({"applications": [app]}))
    # Serve's Python proxy here (the other serving tests run on the default, HAProxy): a
    # Ray without HAProxy serves through it, and its statuses must be the same
    init_local_ray(num_cpus=2, proxy=True)
    _, url = deploy(load_manifest(str(path)))
    yield url, serve.get_deployment_handle("LLMServer", "faults")
    serve.shutdown()
    ray.shutdown()


def assert_idle(handle: Any, timeout_s: float = 20) -> None:
    def idle() -> bool:
        s = handle.stats.remote().result()
        return (
            s["num_live_requests"] == 0
            and s["num_unfinished_requests"] == 0
            and s["num_free_kv_blocks"] == s["num_kv_blocks"]
        )

    wait_for(idle, timeout_s, "the engine to be idle (no requests, every KV block free)")


# ---- the mixed load ----------------------------------------------------------------------
def _completion(i: int, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 12, **fields}


SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=3)
# (kind, path, body or raw bytes, expected status)
INVALID = [
    ("temperature", {"temperature": -1}),
    ("top_p", {"top_p": 0}),
    ("top_k below -1", {"top_k": -2}),  # 0 and -1 mean off, as in vLLM
    ("top_k overflow", {"top_k": 10**30}),
    ("max_tokens zero", {"max_tokens": 0}),
    ("max_tokens past the context", {"max_tokens": 10**6}),
    ("n", {"n": 0}),
    ("best_of", {"best_of": 2}),
    ("logprobs", {"logprobs": 21}),
    ("empty stop", {"stop": [""]}),
    ("negative stop id", {"stop_token_ids": [-1]}),
    ("stop id outside the vocabulary", {"stop_token_ids": [10**9]}),
    ("logit_bias key", {"logit_bias": {"x": 1}}),
    ("logit_bias value", {"logit_bias": {"5": 1000}}),
    ("logit_bias token", {"logit_bias": {"999999999": 1}}),
    ("lone surrogate", {"prompt": "\ud800"}),
    ("empty prompt", {"prompt": ""}),
    ("token outside the vocabulary", {"prompt": [10**9]}),
    ("long prompt", {"prompt": "word " * 400}),
    ("seed", {"seed": 2**70}),
    ("presence", {"presence_penalty": 5}),
    ("repetition", {"repetition_penalty": -1}),
    ("temperature type", {"temperature": "hot"}),
    ("no model", {"model": None}),
]


def _request(i: int, rng: random.Random) -> tuple[str, str, Any, int, dict[str, str]]:
    """(kind, path, JSON body or raw bytes, expected status, extra headers)."""
    roll = rng.random()
    if roll < 0.30:
        return "greedy", "/v1/completions", _completion(i, temperature=0), 200, {}
    if roll < 0.40:
        body = _completion(i, temperature=0, stream=True)
        return "greedy stream", "/v1/completions", body, 200, {}
    if roll < 0.50:
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0}
        return "chat", "/v1/chat/completions", body, 200, {}
    if roll < 0.60:
        extra = dict(
            presence_penalty=1.5,
            frequency_penalty=-1,
            repetition_penalty=1.3,
            stop=["\n", "e"],
            logit_bias={"7": 50, "9": -100},
            stream_options={"include_usage": True},
            stream=True,
        )
        return "sampled", "/v1/completions", _completion(i, **SAMPLED, **extra), 200, {}
    if roll < 0.68:
        return "dropped", "/v1/completions", _completion(i, max_tokens=100, stream=True), 200, {}
    if roll < 0.72:
        return "no key", "/v1/completions", _completion(i), 401, {"Authorization": "Bearer no"}
    if roll < 0.75:
        return "unknown model", "/v1/completions", _completion(i, model="gpt-4"), 404, {}
    if roll < 0.78:
        return "not UTF-8", "/v1/completions", b'{"model": "tiny", "prompt": "\xff"}', 400, {}
    kind, fields = INVALID[i % len(INVALID)]
    return kind, "/v1/completions", _completion(i, **fields), 400, {}


async def _send(
    client: httpx.AsyncClient, kind: str, path: str, body: Any, headers: dict[str, str]
) -> tuple[int, Any]:
    """(status, the answer: its text for completions, "" for a dropped stream)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "Content-Type": "application/json", **headers}
    if not (isinstance(body, dict) and body.get("stream")):
        reply = await client.post(path, content=content, headers=headers)
        data = reply.json()
        if reply.status_code != 200:
            return reply.status_code, data
        choice = data["choices"][0]
        return 200, choice.get("text", choice.get("message", {}).get("content"))
    async with client.stream("POST", path, content=content, headers=headers) as reply:
        if reply.status_code != 200:
            return reply.status_code, json.loads(await reply.aread())
        pieces = []
        async for line in reply.aiter_lines():
            if kind == "dropped":
                return 200, ""  # leave after the first event
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                return event["error"]["code"], event
            pieces += [c.get("text", "") for c in event["choices"]]
        return 200, "".join(pieces)


GREEDY_KINDS = ("greedy", "greedy stream", "chat")


def _key(body: dict[str, Any]) -> str:
    """The same request, streamed or not."""
    return json.dumps({k: v for k, v in body.items() if k != "stream"}, sort_keys=True)


def test_mixed_load_gets_the_right_statuses_and_serial_answers(server):
    url, handle = server
    rng = random.Random(0)
    plan = [_request(i, rng) for i in range(NUM_REQUESTS)]

    async def run() -> tuple[dict[str, str], list[tuple[str, int, int, Any]]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            serial = {}  # the greedy answers, one request at a time
            for kind, path, body, _, headers in plan:
                if kind in GREEDY_KINDS and _key(body) not in serial:
                    plain = {k: v for k, v in body.items() if k != "stream"}
                    serial[_key(body)] = (await _send(client, kind, path, plain, headers))[1]
            limit = asyncio.Semaphore(CONCURRENCY)

            async def one(kind, path, body, expected, headers):
                async with limit:
                    status, answer = await _send(client, kind, path, body, headers)
                return kind, expected, status, answer, body

            results = await asyncio.gather(*(one(*p) for p in plan))
            return serial, results

    serial, results = asyncio.run(run())
    wrong = [(k, e, s, a) for k, e, s, a, _ in results if s != e]
    assert not wrong, wrong[:10]
    for kind, _, _, answer, body in results:
        if kind in GREEDY_KINDS:
            assert answer == serial[_key(body)], kind
    print(Counter(k for k, *_ in results))
    assert_idle(handle)


# ---- the schema fuzz ---------------------------------------------------------------------
def test_fuzzed_requests_never_get_a_server_error(server):
    import schemathesis
    from schemathesis import GenerationMode

    url, handle = server
    spec = httpx.get(f"{url}/openapi.json", headers=AUTH, timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    strategy = schema.as_strategy() | schema.as_strategy(GenerationMode.NEGATIVE)
    seen: Counter[int] = Counter()
    calls = iter(range(10**9))

    @settings(
        max_examples=NUM_FUZZ,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def check(case: Any) -> None:
        if isinstance(case.body, dict) and next(calls) % 4:
            case.body["model"] = MODEL  # most of them get past the model check
        response = case.call(base_url=url, headers=AUTH, timeout=60)
        seen[response.status_code] += 1
        assert response.status_code < 500, (case.path, case.body, response.text)

    check()
    print(seen)
    assert seen[200] > 0 and seen[400] > 0  # the fuzz reached the engine and the checks
    assert_idle(handle)


# ---- a killed worker ---------------------------------------------------------------------
def test_killed_worker_fails_its_stream_and_the_engine_restarts_in_place(server):
    url, handle = server
    before = handle.stats.remote().result()
    pid = before["workers"][1]["pid"]
    body = json.dumps(_completion(0, max_tokens=100, stream=True, ignore_eos=True))
    headers = {**AUTH, "Content-Type": "application/json"}

    async def run() -> tuple[int, float | None]:
        """(the stream's error code, or 200 if it ended well; when the worker was killed)"""
        killed_at = None
        async with (
            httpx.AsyncClient(base_url=url, timeout=120) as client,
            client.stream("POST", "/v1/completions", content=body, headers=headers) as reply,
        ):
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    return event["error"]["code"], killed_at
                if killed_at is None:  # the first tokens are out: kill, as the OOM killer
                    os.kill(pid, signal.SIGKILL)  # would (Ray is not told)
                    killed_at = time.monotonic()
        return 200, killed_at

    code, killed_at = asyncio.run(run())
    assert code == 503 and killed_at is not None
    print(f"the stream failed {time.monotonic() - killed_at:.1f} s after the kill")

    # A request sent now waits for the new engine (or is served by it) instead of failing.
    reply = httpx.post(
        f"{url}/v1/completions", json=_completion(1, temperature=0), headers=AUTH, timeout=120
    )
    assert reply.status_code == 200
    print(f"served again {time.monotonic() - killed_at:.1f} s after the kill")
    after = handle.stats.remote().result()
    # the same replica (its counters go on), a new engine with new workers
    assert after["engine_restarts"] == 1 and after["engine_id"] != before["engine_id"]
    assert after["metrics"]["requests_error"] >= 1  # the killed stream, counted here
    assert all(w["pid"] != pid for w in after["workers"])
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert_idle(handle)
