"""Where serving's CPU goes: every Ray and Serve process's CPU time per engine step while
`--clients` OpenAI clients (in this process) send requests back to back for `--seconds`,
streamed or not, through Serve's Python proxy or its HAProxy ingress.

On a machine whose cores the model's threads use, every millisecond another process takes
stalls the model's step at its next barrier, so this table says what a serving path costs
more steadily than tokens/s do (`benchmarks/serve.py`), which move by +-0.1 between runs
on a shared 2-core machine. Serve reads its ingress from the environment when Ray starts,
so compare the two in two runs:

    python benchmarks/serve_cpu.py --ingress proxy
    python benchmarks/serve_cpu.py --ingress haproxy
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
import warnings

warnings.filterwarnings("ignore")

# Process kinds, matched against each process's command line (first match wins).
KINDS = (
    "WorkerActor",
    "SchedulerActor",
    "ServeReplica",
    "ProxyActor",
    "HAProxyManager",
    "haproxy -db",
    "ServeController",
    "gcs_server",
    "raylet",
    "dashboard",
)


async def load(url: str, model: str, clients: int, seconds: float, stream: bool) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    deadline = time.monotonic() + seconds
    params = {"max_tokens": 64, "temperature": 0, "extra_body": {"ignore_eos": True}}

    async def one(c: int) -> None:
        k = 0
        while time.monotonic() < deadline:
            prompt = f"Tell me something interesting about topic number {c}, part {k}."
            if stream:
                async for _ in await client.completions.create(
                    model=model, prompt=prompt, stream=True, **params
                ):
                    pass
            else:
                await client.completions.create(model=model, prompt=prompt, **params)
            k += 1

    await asyncio.gather(*(one(c) for c in range(clients)))


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of every process of each kind ("client": this process)."""
    import psutil

    totals = {"client": sum(psutil.Process().cpu_times()[:2])}
    for p in psutil.process_iter(["cmdline"]):
        command = " ".join(p.info["cmdline"] or [])
        kind = next((k for k in KINDS if k in command), None)
        if kind is None or p.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):  # it may have exited meanwhile
            totals[kind] = totals.get(kind, 0.0) + sum(p.cpu_times()[:2])
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", default="cluster/manifests/default.yaml")
    parser.add_argument("--ingress", choices=("proxy", "haproxy"), default="haproxy")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=25)
    parser.add_argument("--no-stream", action="store_true")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    args = parser.parse_args()

    import ray
    from serve import scheduler_actor  # benchmarks/serve.py

    from cluster.serve import load_manifest
    from cluster.serve.launch import deploy, start_local_ray

    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1" if args.ingress == "haproxy" else "0"
    manifest = load_manifest(args.manifest).with_args(
        placement={"threads_per_worker": args.threads}, speculative=None
    )
    start_local_ray(include_dashboard=False, log_to_driver=False)
    try:
        handle, url = deploy(manifest)
        ingress = handle.stats.remote().result()["http_ingress"]
        model, stream = manifest.args.served_model_name, not args.no_stream
        asyncio.run(load(url, model, args.clients, 8, stream))  # warm-up
        scheduler = scheduler_actor()
        before, timings = cpu_seconds(), ray.get(scheduler.timings.remote())
        asyncio.run(load(url, model, args.clients, args.seconds, stream))
        after, timings_after = cpu_seconds(), ray.get(scheduler.timings.remote())
    finally:
        ray.shutdown()
    steps = timings_after["steps"] - timings["steps"]
    worker_s = timings_after["workers"][-1]["step_s"] - timings["workers"][-1]["step_s"]
    print(
        f"\n{args.clients} clients, {'streamed' if stream else 'whole'} answers of 64 tokens, "
        f"HTTP ingress {ingress}: {steps} steps, worker's own step {1e3 * worker_s / steps:.1f} ms"
    )
    print("\n| process | CPU ms per step |\n|---|---:|")
    for kind in sorted(after, key=lambda k: before.get(k, 0.0) - after[k]):
        print(f"| {kind} | {1e3 * (after[kind] - before.get(kind, 0.0)) / steps:.2f} |")


if __name__ == "__main__":
    main()
