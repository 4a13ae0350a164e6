"""What serving through Ray costs: latency and throughput of the same engine in this
process (`LLM.generate`), through a Serve handle (`LLMServer`) and through HTTP (the
OpenAI route, with the `openai` client), streamed and not, at concurrency 1 and 16.

`c` clients each send requests back to back (greedy, `--max-tokens` tokens, ignore_eos)
until `--requests-per-client` each are done; in process, each round of `c` requests is
one batch. Both engines stay up and the paths run interleaved (every path, then every
path in reverse, `--rounds` times); the table reports medians. Prints a markdown table; the last column is throughput relative to the
in-process engine. For the Ray paths the second table splits an engine step as the
client sees it (wall time over steps) into the worker's own step, the scheduler actor's
round trip to it (scheduling, the step socket, applying the result) and the rest
(outputs to the replica, the replica, Serve, the client, and each request's own
calls spread over its steps), from the scheduler actor's
cumulative timings; the last lines estimate what Ray adds per engine step at
concurrency 1 from latencies (each step is one token then, without speculation).

    python benchmarks/serve.py [--manifest cluster/manifests/default.yaml] [--no-spec]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import warnings
from collections.abc import Awaitable, Callable

warnings.filterwarnings("ignore")

PROMPTS = [f"Tell me something interesting about topic number {i}." for i in range(64)]
Call = Callable[[str], Awaitable[int]]  # one request -> its output token count


async def measure(call: Call, concurrency: int, per_client: int) -> dict[str, float]:
    """`concurrency` clients sending `per_client` requests each, back to back."""
    latencies: list[float] = []
    tokens = 0

    async def client(c: int) -> None:
        nonlocal tokens
        for i in range(per_client):
            start = time.perf_counter()
            n = await call(PROMPTS[(c * per_client + i) % len(PROMPTS)])
            latencies.append(time.perf_counter() - start)
            tokens += n  # (not `tokens += await ...`: that reads `tokens` before awaiting)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    return _summary(latencies, tokens, time.perf_counter() - start)


def in_process(llm, params, concurrency: int, per_client: int) -> dict:
    """The same engine here: `per_client` rounds of `concurrency` requests, each round one
    `LLM.generate` batch (clients in lockstep; with ignore_eos they finish together)."""
    llm.generate(PROMPTS[:1], params, use_tqdm=False)  # warm-up
    scheduler = llm.engine.core.scheduler
    first_step = scheduler.step_id
    latencies, tokens, start = [], 0, time.perf_counter()
    for r in range(per_client):
        batch = PROMPTS[r * concurrency : (r + 1) * concurrency]
        begin = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        latencies += [time.perf_counter() - begin] * len(batch)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    wall = time.perf_counter() - start
    steps = max(1, scheduler.step_id - first_step)
    return {**_summary(latencies, tokens, wall), "client_ms": 1e3 * wall / steps}


def _summary(latencies: list[float], tokens: int, wall: float) -> dict[str, float]:
    q = statistics.quantiles(latencies, n=10) if len(set(latencies)) > 1 else latencies * 9
    return {
        "mean": statistics.fmean(latencies),
        "p50": statistics.median(latencies),
        "p90": q[8],
        "tok_s": tokens / wall,
    }


def scheduler_actor():
    """The deployment's scheduler actor (one replica: one engine)."""
    import ray

    from cluster.actors.placement import ACTOR_NAMESPACE

    (name,) = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == ACTOR_NAMESPACE and a["name"].endswith("-scheduler")
    ]
    return ray.get_actor(name, namespace=ACTOR_NAMESPACE)


def served(call: Call, concurrency: int, per_client: int, scheduler) -> dict[str, float]:
    """One warm-up request, then `measure` with step timings (the warm-up's steps, batch-1
    steps, stay out of them)."""
    asyncio.run(call(PROMPTS[0]))
    return with_step_timings(lambda: asyncio.run(measure(call, concurrency, per_client)), scheduler)


def with_step_timings(run: Callable[[], dict[str, float]], scheduler) -> dict[str, float]:
    """`run()`'s summary plus per-step milliseconds: the worker's own step, the scheduler
    actor's step and the client's (wall time over the steps taken meanwhile)."""
    import ray

    before = ray.get(scheduler.timings.remote())
    start = time.perf_counter()
    summary = run()
    wall = time.perf_counter() - start
    after = ray.get(scheduler.timings.remote())
    steps = max(1, after["steps"] - before["steps"])
    worker_s = after["workers"][-1]["step_s"] - before["workers"][-1]["step_s"]  # last rank
    return {
        **summary,
        "worker_ms": 1e3 * worker_s / steps,
        "scheduler_ms": 1e3 * (after["step_s"] - before["step_s"]) / steps,
        "client_ms": 1e3 * wall / steps,
    }


def ray_calls(manifest, params) -> tuple[dict[str, Call], str]:
    """The four Ray paths, and the HTTP ingress the replica reports."""
    import openai
    from ray import serve

    from cluster.serve import GenerateRequest
    from cluster.serve.launch import deploy

    _, url = deploy(manifest)
    handle = serve.get_deployment_handle("LLMServer", manifest.app_name)
    model = manifest.args.served_model_name
    clients: dict[int, openai.AsyncOpenAI] = {}  # one per event loop

    def client() -> openai.AsyncOpenAI:
        key = id(asyncio.get_running_loop())
        if key not in clients:
            clients[key] = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        return clients[key]

    http = {"max_tokens": params.max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}

    async def handle_whole(prompt: str) -> int:
        request = GenerateRequest(prompt=prompt, sampling_params=params)
        return len((await handle.generate.remote(request)).token_ids)

    async def handle_stream(prompt: str) -> int:
        request = GenerateRequest(prompt=prompt, sampling_params=params, stream=True)
        chunks = [c async for c in handle.options(stream=True).generate.remote(request)]
        return chunks[-1].num_output_tokens

    async def http_whole(prompt: str) -> int:
        out = await client().completions.create(model=model, prompt=prompt, **http)
        return out.usage.completion_tokens

    async def http_stream(prompt: str) -> int:
        stream = await client().completions.create(
            model=model, prompt=prompt, stream=True, stream_options={"include_usage": True}, **http
        )
        usage = [c.usage async for c in stream if c.usage]
        return usage[-1].completion_tokens

    paths = {
        "Serve handle": handle_whole,
        "Serve handle, streamed": handle_stream,
        "HTTP (openai client)": http_whole,
        "HTTP, streamed": http_stream,
    }
    return paths, handle.stats.remote().result()["http_ingress"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", default="cluster/manifests/default.yaml")
    parser.add_argument("--model", help="another checkpoint folder than the manifest's")
    parser.add_argument("--no-spec", action="store_true", help="turn speculation off")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="each a forward and a reverse pass")
    parser.add_argument("--num-cpus", type=float, default=None, help="for a local Ray")
    parser.add_argument(
        "--stream-chunks-per-s", type=float, help="server.stream_chunks_per_s (the manifest's)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads, here and per worker actor"
    )
    parser.add_argument(
        "--ingress",
        choices=("proxy", "haproxy"),
        default="haproxy",
        help="Serve's HTTP ingress: HAProxy straight to the replica (the default of a Ray "
        "started by cluster), or Serve's Python proxy (RAY_SERVE_ENABLE_HA_PROXY=0)",
    )
    args = parser.parse_args()

    import ray
    import torch

    from cluster import LLM, SamplingParams
    from cluster.serve import load_manifest
    from cluster.serve.launch import start_local_ray

    torch.set_num_threads(args.threads)
    manifest = load_manifest(args.manifest).with_args(
        placement={"threads_per_worker": args.threads}
    )
    if args.no_spec:
        manifest = manifest.with_args(speculative=None)
    if args.stream_chunks_per_s:
        manifest = manifest.with_args(server={"stream_chunks_per_s": args.stream_chunks_per_s})
    if args.model:
        manifest = manifest.with_args(
            model={"path": args.model, "id": "model", "max_model_len": None}
        )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    base = "in-process LLM.generate"
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1" if args.ingress == "haproxy" else "0"
    start_local_ray(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    # Both engines stay up; an idle one costs no CPU. Each round measures every path,
    # then again in reverse order (A, B, ..., B, A), and the table reports medians.
    llm = LLM(**manifest.args.engine_args())
    try:
        paths: dict[str, Callable[[int], dict[str, float]]] = {
            base: lambda c: in_process(llm, params, c, args.requests_per_client)
        }
        calls, ingress = ray_calls(manifest, params)
        scheduler = scheduler_actor()
        for name, call in calls.items():
            paths[name] = lambda c, call=call: served(call, c, args.requests_per_client, scheduler)
        for _ in range(args.rounds):
            for c in args.concurrency:
                for name in [*paths, *reversed(paths)]:
                    runs.setdefault((name, c), []).append(paths[name](c))
                    print(f"  {name:24s} c={c:<3d} {runs[name, c][-1]}", flush=True)
    finally:
        llm.shutdown()
        ray.shutdown()
    results = {
        key: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for key, rs in runs.items()
    }

    spec = "off" if manifest.args.speculative is None else manifest.args.speculative["method"]
    print(
        f"\n{manifest.args.served_model_name}, speculation {spec}, {args.max_tokens} tokens "
        f"per request, {args.requests_per_client} requests per client, HTTP ingress: {ingress}\n"
    )
    print(
        "| path | concurrency | mean latency (s) | p50 (s) | p90 (s) | tokens/s | vs in-process |"
    )
    print("|---|---|---|---|---|---|---|")
    for (name, c), r in results.items():
        ratio = r["tok_s"] / results[base, c]["tok_s"]
        print(
            f"| {name} | {c} | {r['mean']:.3f} | {r['p50']:.3f} | {r['p90']:.3f} "
            f"| {r['tok_s']:.1f} | {ratio:.2f}x |"
        )
    print(
        "\n| path | concurrency | ms/step (client) | worker's own ms/step | scheduler actor "
        "round trip (us) | outputs to the client (us) | Ray in all (us) |"
    )
    print("|---|---|---|---|---|---|---|")
    for (name, c), r in results.items():
        if "worker_ms" not in r:
            print(f"| {name} | {c} | {r['client_ms']:.1f} | | | | |")
            continue
        print(
            f"| {name} | {c} | {r['client_ms']:.1f} | {r['worker_ms']:.1f} "
            f"| {1e3 * (r['scheduler_ms'] - r['worker_ms']):.0f} "
            f"| {1e3 * (r['client_ms'] - r['scheduler_ms']):.0f} "
            f"| {1e3 * (r['client_ms'] - r['worker_ms']):.0f} |"
        )
    unit = "step" if spec == "off" else "token"  # with drafts, a step makes several tokens
    if 1 in args.concurrency:
        for name in ("Serve handle", "HTTP (openai client)"):
            extra = (results[name, 1]["mean"] - results[base, 1]["mean"]) / args.max_tokens
            print(f"\nRay cost per {unit} at concurrency 1 ({name}): {extra * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
