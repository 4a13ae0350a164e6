"""The fleet on this machine: prefix-aware routing against Serve's own balancing, and
autoscaling through a ramp of load, with small replicas of the default model.

Workload: users sharing a set of system prompts (`--systems`, each a few hundred tokens;
each request picks one at random, seeded), each user asking its own questions in
streamed chat completions of `--max-tokens` tokens, one after another. Each replica's
KV cache (`--kv-gib`) holds about half of the system prompts.

Phase `routing`: two replicas at a fixed concurrency; HAProxy's least-connections
(`server.request_router: least_loaded`) against the prefix router, runs interleaved
A B B A; per run, the prefix-cache hit rate (prompt tokens found in the replicas'
caches), TTFT and ITL percentiles, requests and errors, then the medians.

Phase `ramp`: an `autoscaling_config` of 1-2 replicas and the prefix router; the number
of users ramps 1 -> `--max-users` -> 1. Every second it records users, streams in
flight, running replicas and the latencies of requests that finished; it prints the
table and draws load, replicas and TTFT over time (matplotlib) next to it.

    python benchmarks/fleet.py [--phase routing ramp] [--max-users 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import openai
import ray
from ray import serve

from cluster.serve import load_manifest
from cluster.serve.launch import deploy, start_local_ray

DEFAULT_MANIFEST = os.path.join(
    os.path.dirname(__file__), "..", "cluster", "manifests", "default.yaml"
)


@dataclass
class Record:
    """One request: when it started and ended, its TTFT and mean ITL, or its error."""

    start: float
    end: float = 0.0
    ttft: float | None = None
    itl: float | None = None
    error: str | None = None


@dataclass
class Run:
    records: list[Record] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)  # one per second
    prefix_queried: int = 0
    prefix_hits: int = 0
    in_flight: int = 0
    model: str = ""
    t0: float = 0.0  # when the load started (time.monotonic)


def system_prompts(count: int, sentences: int) -> list[str]:
    topics = ["billing", "travel", "cooking", "hardware", "gardening", "law", "music", "chess"]
    return [
        f"You are the {topics[s % len(topics)]} assistant of company {s}. "
        + " ".join(
            f"Rule {i}: answer {topics[s % len(topics)]} questions politely, case {i}."
            for i in range(sentences)
        )
        for s in range(count)
    ]


def manifest(router: str, replicas: int | None, autoscaling: dict[str, Any] | None, kv_gib: float):
    m = load_manifest(DEFAULT_MANIFEST).with_args(
        placement={"worker_cpus": 0.9, "threads_per_worker": 1},
        cache={"cpu_kv_cache_gib": kv_gib},
        server={"request_router": router},
    )
    options = {**m.deployments.get("LLMServer", {}), "graceful_shutdown_timeout_s": 30}
    if autoscaling is not None:
        options.pop("num_replicas", None)  # Serve refuses both
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas
    return dataclasses.replace(m, deployments={"LLMServer": options})


def prefix_counters() -> dict[str, tuple[int, int]]:
    """Per live engine: (prompt tokens looked up, found) in its prefix cache."""
    out = {}
    for name in ray.util.list_named_actors(all_namespaces=True):
        if name["namespace"] == "cluster" and name["name"].endswith("-scheduler"):
            try:
                d = ray.get(
                    ray.get_actor(name["name"], namespace="cluster").describe.remote(), timeout=5
                )
            except Exception:
                continue
            out[name["name"]] = (d["prefix_cache_queried_tokens"], d["prefix_cache_hit_tokens"])
    return out


def running_replicas(app: str) -> int:
    try:
        state = serve.status().applications[app].deployments["LLMServer"]
    except KeyError:
        return 0
    return state.replica_states.get("RUNNING", 0)


async def user_loop(
    client, user: int, systems: list[str], max_tokens: int, active, stop, run: Run
) -> None:
    """One user: while `active(user)`, one streamed chat completion after another."""
    n = 0
    while not stop.is_set():
        if not active(user):
            await asyncio.sleep(0.2)
            continue
        n += 1
        messages = [
            {
                "role": "system",
                "content": systems[random.Random(user * 100003 + n).randrange(len(systems))],
            },
            {"role": "user", "content": f"User {user}, question {n}: what should I check first?"},
        ]
        record = Record(start=time.monotonic())
        chunks: list[float] = []
        run.in_flight += 1
        try:
            stream = await client.chat.completions.create(
                model=run.model,
                messages=messages,
                max_tokens=max_tokens,
                stream=True,
                temperature=0,
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    chunks.append(time.monotonic())
        except Exception as e:  # counted, never hidden
            record.error = f"{type(e).__name__}: {e}"[:200]
        finally:
            run.in_flight -= 1
        record.end = time.monotonic()
        if chunks:
            record.ttft = chunks[0] - record.start
            record.itl = (chunks[-1] - chunks[0]) / (len(chunks) - 1) if len(chunks) > 1 else None
        run.records.append(record)


async def drive(url: str, app: str, users_at, duration: float, max_users: int, args) -> Run:
    """Run the workload for `duration` s with `users_at(t)` users active at time t."""
    run = Run()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    run.model = (await client.models.list()).data[0].id
    systems = system_prompts(args.systems, args.system_sentences)
    stop = asyncio.Event()
    t0 = run.t0 = time.monotonic()
    before = await asyncio.to_thread(prefix_counters)
    seen = dict(before)

    def active(user: int) -> bool:
        return user < users_at(time.monotonic() - t0)

    users = [
        asyncio.ensure_future(user_loop(client, u, systems, args.max_tokens, active, stop, run))
        for u in range(max_users)
    ]
    while (now := time.monotonic() - t0) < duration:
        replicas = await asyncio.to_thread(running_replicas, app)
        counters = await asyncio.to_thread(prefix_counters)
        seen.update(counters)  # an engine scaled away keeps its last counters
        sample = {
            "t": now,
            "users": users_at(now),
            "replicas": replicas,
            "in_flight": run.in_flight,
        }
        run.samples.append(sample)
        await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*users)
    await client.close()
    for name, (queried, hits) in seen.items():
        q0, h0 = before.get(name, (0, 0))
        run.prefix_queried += queried - q0
        run.prefix_hits += hits - h0
    return run


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(run: Run) -> dict[str, float]:
    ok = [r for r in run.records if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [r.itl for r in ok if r.itl is not None]
    return {
        "requests": len(run.records),
        "errors": len(run.records) - len(ok),
        "hit_rate": run.prefix_hits / run.prefix_queried if run.prefix_queried else 0.0,
        "ttft_p50_ms": 1e3 * pct(ttft, 0.5),
        "ttft_p90_ms": 1e3 * pct(ttft, 0.9),
        "itl_p50_ms": 1e3 * pct(itl, 0.5),
        "itl_p90_ms": 1e3 * pct(itl, 0.9),
    }


def with_app(
    router: str, replicas: int | None, autoscaling: dict[str, Any] | None, body, kv_gib: float
) -> Any:
    """Start a local Ray, deploy, run `body(url)`, and shut everything down."""
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        _, url = deploy(manifest(router, replicas, autoscaling, kv_gib))
        return body(url)
    finally:
        serve.shutdown()
        ray.shutdown()


def routing_phase(args) -> None:
    results: dict[str, list[dict[str, float]]] = {"least_loaded": [], "prefix": []}
    for router in ["least_loaded", "prefix", "prefix", "least_loaded"]:

        def body(url: str) -> Run:
            asyncio.run(
                drive(url, "cluster", lambda t: args.users, 5.0, args.users, args)
            )  # warm-up
            return asyncio.run(
                drive(url, "cluster", lambda t: args.users, args.seconds, args.users, args)
            )

        row = summary(with_app(router, 2, None, body, args.kv_gib))
        results[router].append(row)
        print(f"{router:13s} " + "  ".join(f"{k}={v:.3g}" for k, v in row.items()), flush=True)
    print(
        f"\nmedians over {len(results['prefix'])} runs each, 2 replicas, {args.users} users, "
        f"{args.systems} system prompts:"
    )
    print(
        "| router | requests | errors | prefix hit rate | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    medians = {}
    for router, rows in results.items():
        m = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        medians[router] = m
        print(
            f"| {router} | {m['requests']:.0f} | {m['errors']:.0f} | {m['hit_rate']:.3f} | {m['ttft_p50_ms']:.0f} | "
            f"{m['ttft_p90_ms']:.0f} | {m['itl_p50_ms']:.1f} | {m['itl_p90_ms']:.1f} |"
        )
    base, ours = medians["least_loaded"], medians["prefix"]
    print(
        f"\nprefix / least_loaded: hit rate {ours['hit_rate'] / max(base['hit_rate'], 1e-9):.2f}x, "
        f"TTFT p50 {ours['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x"
    )


def ramp_phase(args) -> None:
    steps = [1, 2, 4, 8, args.max_users, args.max_users, 8, 4, 2, 1, 0, 0]
    step_s = args.step_seconds

    def users_at(t: float) -> int:
        return steps[min(int(t // step_s), len(steps) - 1)]

    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "initial_replicas": 1,
        "target_ongoing_requests": max(2, args.max_users // 2),
        "upscale_delay_s": 3,
        "downscale_delay_s": 10,
        "metrics_interval_s": 1,
        "look_back_period_s": 3,
    }
    duration = step_s * len(steps)
    run = with_app(
        "prefix",
        None,
        autoscaling,
        lambda url: asyncio.run(drive(url, "cluster", users_at, duration, args.max_users, args)),
        args.kv_gib,
    )
    print(
        "| t s | users | streams in flight | replicas | finished that second | their TTFT p50 ms |"
    )
    print("|---|---|---|---|---|---|")
    for s in run.samples:
        done = [r for r in run.records if s["t"] - 1 <= r.end - run.t0 <= s["t"] and r.ttft]
        ttft = 1e3 * statistics.median([r.ttft for r in done]) if done else float("nan")
        print(
            f"| {s['t']:.0f} | {s['users']} | {s['in_flight']} | {s['replicas']} | {len(done)} | {ttft:.0f} |"
        )
    row = summary(run)
    print("\nramp: " + "  ".join(f"{k}={v:.3g}" for k, v in row.items()))
    print(
        f"replicas seen: {sorted({s['replicas'] for s in run.samples})}; max 2 reached at "
        f"{next((s['t'] for s in run.samples if s['replicas'] == 2), None)} s"
    )
    errors = [r.error for r in run.records if r.error]
    if errors:
        print("errors:", errors[:5])
    plot(run, os.path.join(args.out, "fleet_ramp.png"))


def plot(run: Run, path: str) -> None:
    try:
        import matplotlib
    except ImportError:  # the table above is the result; the plot needs the bench extra
        print("no plot: matplotlib is missing (pip install -e '.[bench]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = run.t0
    fig, ax = plt.subplots(3, 1, sharex=True, figsize=(8, 7))
    ax[0].step([s["t"] for s in run.samples], [s["users"] for s in run.samples], where="post")
    ax[0].set_ylabel("users")
    ax[1].step(
        [s["t"] for s in run.samples],
        [s["replicas"] for s in run.samples],
        where="post",
        color="C1",
    )
    ax[1].set_ylabel("running replicas")
    done = [r for r in run.records if r.ttft is not None]
    ax[2].scatter(
        [r.start - t0 + r.ttft for r in done], [1e3 * r.ttft for r in done], s=6, color="C2"
    )
    ax[2].set_ylabel("TTFT ms")
    ax[2].set_xlabel("seconds")
    fig.suptitle("fleet ramp: prefix router, autoscaling 1-2 replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--phase", nargs="+", default=["routing", "ramp"], choices=["routing", "ramp"]
    )
    parser.add_argument("--systems", type=int, default=32, help="distinct system prompts")
    parser.add_argument("--system-sentences", type=int, default=40, help="~12 tokens each")
    parser.add_argument(
        "--kv-gib",
        type=float,
        default=0.25,
        help="KV cache per replica: room for about half the system prompts, so that where "
        "a prompt goes decides whether it is cached (with room for all of them on every "
        "replica, any router ends up hitting)",
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--users", type=int, default=8, help="routing phase: users at once")
    parser.add_argument("--seconds", type=float, default=60.0, help="routing phase: per run")
    parser.add_argument("--max-users", type=int, default=16, help="ramp phase: the peak")
    parser.add_argument("--step-seconds", type=float, default=10.0, help="ramp phase: per step")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}")
    if "routing" in args.phase:
        routing_phase(args)
    if "ramp" in args.phase:
        ramp_phase(args)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
