"""A killed worker under load: how soon its replica serves again when the engine restarts
in place (`server.max_engine_restarts` 3, the default) against Serve replacing the whole
replica (`max_engine_restarts` 0); runs interleaved A B B A.

Two replicas of the default model (`worker_cpus` 0.9, one thread each), `--users` users
streaming chat completions one after another (`fleet.py`'s workload). After `--warm-up`
seconds the worker process of one replica is killed with SIGKILL, as the OOM killer
would (Ray is not told). Per run:

- failed: requests that ended in an error (those in flight on the victim at the kill);
- failed later: requests that started after the kill and failed (0 is the target);
- hung: failed requests that had no answer within the client's 60 s timeout;
- detect s: kill -> the last of the victim's streams ended with its error;
- ready again s: kill -> the new engine's first passing health check (its scheduler and
  every worker answer: the replica serves again; with the prefix router it may get no
  traffic until a prompt's cache or the load sends some);
- survivor stall s: the longest time, between the kill and then, that the other engine
  had requests and made no step (about a step's time if it never stopped).

The inductor cache is warm after the first start (the compiled graphs load from disk).

    python benchmarks/recovery.py [--users 4] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import statistics
import time

import openai
import ray
from fleet import DEFAULT_MANIFEST, Run, cpu_model, system_prompts, user_loop
from ray import serve

from cluster.serve import load_manifest
from cluster.serve.launch import deploy, start_local_ray


def manifest(max_engine_restarts: int):
    m = load_manifest(DEFAULT_MANIFEST).with_args(
        placement={"worker_cpus": 0.9, "threads_per_worker": 1},
        cache={"cpu_kv_cache_gib": 0.25},
        server={"max_engine_restarts": max_engine_restarts},
    )
    options = {**m.deployments.get("LLMServer", {}), "num_replicas": 2}
    options["graceful_shutdown_timeout_s"] = 5
    return dataclasses.replace(m, deployments={"LLMServer": options})


def engines() -> dict[str, dict]:
    """Live engines: id -> {"steps": steps so far and "live": requests in it (both None
    if its health check fails), "pids": its workers' process ids}."""
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] != "cluster" or not name.endswith("-scheduler"):
            continue
        engine = name.split("-")[1]
        try:
            scheduler = ray.get_actor(name, namespace="cluster")
            pids = [w["pid"] for w in ray.get(scheduler.describe.remote(), timeout=2)["workers"]]
        except Exception:
            continue
        try:
            health = ray.get(scheduler.health.remote(), timeout=2)
            steps, live = health["num_steps"], health["num_live_requests"]
        except Exception:
            steps = live = None
        out[engine] = {"steps": steps, "live": live, "pids": pids}
    return out


async def one_run(url: str, args) -> dict[str, float]:
    run = Run()
    # A request hung longer than a minute counts as failed (and as hung).
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    run.model = (await client.models.list()).data[0].id
    systems = system_prompts(8, 10)
    stop = asyncio.Event()
    users = [
        asyncio.ensure_future(
            user_loop(client, u, systems, args.max_tokens, lambda u: True, stop, run)
        )
        for u in range(args.users)
    ]
    await asyncio.sleep(args.warm_up)
    before = await asyncio.to_thread(engines)
    victim, other = sorted(before)
    os.kill(before[victim]["pids"][0], signal.SIGKILL)
    killed_at = time.monotonic()
    survivor: list[tuple[float, int, int]] = []  # (seconds since the kill, steps, live)
    ready_again = None
    while ready_again is None and time.monotonic() - killed_at < args.timeout:
        now = await asyncio.to_thread(engines)
        t = time.monotonic() - killed_at
        if now.get(other, {}).get("steps") is not None:
            survivor.append((t, now[other]["steps"], now[other]["live"]))
        if any(e not in before and now[e]["steps"] is not None for e in now):
            ready_again = t
        await asyncio.sleep(0.25)
    await asyncio.sleep(3)  # the new engine takes its share of the users
    stop.set()
    await asyncio.gather(*users)
    await client.close()
    failed = [r for r in run.records if r.error is not None]
    return {
        "failed": len(failed),
        "failed_later": sum(r.start > killed_at for r in failed),
        "hung": sum("Timeout" in (r.error or "") for r in failed),
        "detect_s": max((r.end - killed_at for r in failed), default=float("nan")),
        "ready_again_s": ready_again if ready_again is not None else float("nan"),
        "survivor_stall_s": _longest_stall(survivor),
        "requests": len(run.records),
    }


def _longest_stall(samples: list[tuple[float, int, int]]) -> float:
    """The longest span of (seconds, cumulative steps, live requests) samples over which
    the engine had requests and its step count did not move."""
    longest, since = 0.0, None
    for t, steps, live in samples:
        if since is not None and steps == since[1] and live > 0:
            longest = max(longest, t - since[0])
        else:
            since = (t, steps)
    return longest


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warm-up", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--rounds", type=int, default=1, help="A B B A per round")
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}")
    sides = {"restart in place": 3, "Serve replaces the replica": 0}
    results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    order = ["restart in place", "Serve replaces the replica"]
    for _ in range(args.rounds):
        for side in order + order[::-1]:
            start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
            try:
                _, url = deploy(manifest(sides[side]))
                row = asyncio.run(one_run(url, args))
            finally:
                serve.shutdown()
                ray.shutdown()
            results[side].append(row)
            print(f"{side}: " + "  ".join(f"{k}={v:.3g}" for k, v in row.items()), flush=True)
    print(f"\nmedians of {2 * args.rounds} runs each, 2 replicas, {args.users} users:")
    print(
        "| after a killed worker | requests | failed | failed later | hung | detect s "
        "| ready again s | survivor stall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for side, rows in results.items():
        m = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(
            f"| {side} | {m['requests']:.0f} | {m['failed']:.0f} | {m['failed_later']:.0f} | "
            f"{m['hung']:.0f} | "
            f"{m['detect_s']:.1f} | {m['ready_again_s']:.1f} | {m['survivor_stall_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
