"""Nodes that come and go: two replicas of a tiny model on a simulated three-node Ray
cluster (`ray.cluster_utils.Cluster`; one replica fits a node), behind the OpenAI route.
A node removed while both replicas stream takes its replica with it: that stream ends
with an error (never a silent end), the other replica's stream runs to its end, Serve
starts a replacement on the node left free, and both replicas serve again."""

import asyncio
import os
import time

import httpx
import pytest
import ray
import yaml
from ray import serve
from ray.cluster_utils import Cluster
from ray_helpers import wait_for
from tiny_models import make_tiny_chat_model

from cluster.actors import ACTOR_NAMESPACE
from cluster.parallel.spawn import free_port
from cluster.serve import load_manifest
from cluster.serve.launch import deploy

MAX_TOKENS = 600


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, smollm2_path):
    folder = str(tmp_path_factory.mktemp("node_loss"))
    model = os.path.join(folder, "m")
    make_tiny_chat_model(model, smollm2_path, num_hidden_layers=2, max_position_embeddings=1024)
    args = {
        "model": {"path": model, "id": "tiny", "device": "cpu", "dtype": "float32"},
        # 0.6 CPU a replica, 1 CPU a node: one replica per node
        "placement": {"worker_cpus": 0.5, "replica_cpus": 0.1, "threads_per_worker": 1},
        "cache": {"num_kv_blocks": 128},
    }
    args["model"]["max_model_len"] = 1024
    app = {"name": "tiny", "import_path": "cluster.serve:build_app", "args": args}
    app["deployments"] = [
        {
            "name": "LLMServer",
            "num_replicas": 2,
            "max_ongoing_requests": 1,
            "health_check_period_s": 1,
            "graceful_shutdown_timeout_s": 1,
        }
    ]
    path = os.path.join(folder, "tiny.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"applications": [app]}, f)
    node = {"num_cpus": 1, "object_store_memory": 100 * 2**20}
    with pytest.MonkeyPatch.context() as env:  # Serve's Python proxy on the head node
        env.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
        cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        for _ in range(2):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
    # One proxy: the simulated nodes share this host's address.
    serve.start(proxy_location="HeadOnly", http_options={"port": free_port("127.0.0.1")})
    _, url = deploy(load_manifest(path))
    yield cluster, url
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def engine_nodes() -> dict[str, str]:
    """Engine id -> the node its scheduler (and replica) runs on."""
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] == ACTOR_NAMESPACE and name.endswith("-scheduler"):
            try:
                actor = ray.get_actor(name, namespace=ACTOR_NAMESPACE)
                out[name.split("-")[1]] = ray.get(actor.describe.remote(), timeout=5)["node_id"]
            except Exception:
                continue
    return out


async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> tuple[int, str]:
    """(chunks received, how the stream ended: "done", an error message or "cut")."""
    body = {"model": "tiny", "prompt": "go on", "max_tokens": MAX_TOKENS, "stream": True}
    body["ignore_eos"] = True
    tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if line == "data: [DONE]":
                    return tokens, "done"
                if line.startswith("data: {"):
                    if '"error"' in line:
                        return tokens, line
                    tokens += 1
                    if tokens == 2:
                        started.set()
    except httpx.HTTPError as e:  # the connection broke: an error the client sees
        return tokens, f"{type(e).__name__}: {e}"
    return tokens, "cut"  # ended without [DONE] and without an error: never acceptable


def test_a_removed_node_takes_its_replica_and_serve_replaces_it(fleet):
    cluster, url = fleet
    before = engine_nodes()
    assert len(before) == 2 and len(set(before.values())) == 2  # one replica a node
    head = cluster.head_node.node_id
    victim_engine, victim_node_id = next((e, n) for e, n in before.items() if n != head)
    victim = next(n for n in cluster.worker_nodes if n.node_id == victim_node_id)

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            events = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.ensure_future(stream(client, e)) for e in events]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            cluster.remove_node(victim, allow_graceful=False)
            removed_at = time.monotonic()
            return await asyncio.gather(*streams), removed_at

    results, removed_at = asyncio.run(main())
    ended = sorted(results, key=lambda r: r[1] == "done")
    (lost_tokens, lost), (kept_tokens, kept) = ended
    assert kept == "done" and kept_tokens > lost_tokens  # the other replica's stream ran on
    assert lost not in ("done", "cut")  # this one failed, loudly

    def replaced():
        now = engine_nodes()
        return len(now) == 2 and victim_engine not in now and victim_node_id not in now.values()

    wait_for(replaced, 120, "Serve to replace the lost replica on a node left")
    print(f"two replicas again {time.monotonic() - removed_at:.1f} s after the node went")

    async def both_serve():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            events = [asyncio.Event(), asyncio.Event()]
            return await asyncio.gather(*(stream(client, e) for e in events))

    assert [r[1] for r in asyncio.run(both_serve())] == ["done", "done"]
