"""What Ray adds to an engine step: the same engine in this process (`AsyncLLM`) and on
Ray actors (`EngineClient`: a scheduler actor and one worker actor), without Serve.

For concurrency 1 and 16 (greedy, ignore_eos, `--max-tokens` each), and for each way the
scheduler actor reaches its workers (`placement.step_channel`: one Ray task per rank per
step, a socket per rank, a Ray Compiled Graph), it reports per step: the in-process step; the Ray worker's own step (the model,
msgpack included); the scheduler actor's step (scheduling, the round trip to the worker,
applying the result); the step as the client sees it (wall time over steps: the pump's
long poll and the delivery to the request's stream included). The differences are Ray's
submission and wait (in microseconds), and the delivery. Runs alternate (in-process, then
each channel, then the channels in reverse, then in-process) and report medians.

    python benchmarks/ray_step_cost.py [--model PATH] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import warnings
from typing import Any

os.environ.setdefault("CLUSTER_COMPILE", "off")
warnings.filterwarnings("ignore")

CHANNELS = ("tasks", "sockets", "compiled_graph")  # `placement.step_channel`
PROMPTS = [f"Tell me something interesting about topic number {i}." for i in range(16)]


async def _run_all(generate: Any, prompts: list[str], params: Any) -> int:
    async def one(prompt: str) -> int:
        last = None
        async for out in generate(prompt, params):
            last = out
        return len(last.outputs[0].token_ids)

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


def in_process(config: Any, prompts: list[str], params: Any) -> dict[str, float]:
    from cluster.engine.async_llm import AsyncLLM
    from cluster.llm import build_engine

    engine = AsyncLLM(build_engine(config))
    scheduler = engine.core.scheduler
    try:
        asyncio.run(_run_all(engine.generate, prompts[:1], params))  # warm-up
        first_step = scheduler.step_id
        start = time.perf_counter()
        tokens = asyncio.run(_run_all(engine.generate, prompts, params))
        wall = time.perf_counter() - start
        steps = scheduler.step_id - first_step
    finally:
        engine.shutdown()
    return {"step_ms": 1e3 * wall / steps, "tok_s": tokens / wall}


def on_ray(config: Any, prompts: list[str], params: Any, channel: str) -> dict[str, float]:
    import ray

    from cluster.actors import EngineClient, PlacementConfig

    placement = PlacementConfig(worker_cpus=1, threads_per_worker=2, step_channel=channel)
    client = EngineClient(config, placement)
    try:

        async def run(batch: list[str]) -> int:
            return await _run_all(client.generate, batch, params)

        asyncio.run(run(prompts[:1]))  # warm-up
        before = ray.get(client.scheduler.timings.remote())
        start = time.perf_counter()
        tokens = asyncio.run(run(prompts))
        wall = time.perf_counter() - start
        after = ray.get(client.scheduler.timings.remote())
    finally:
        client.shutdown()
    steps = after["steps"] - before["steps"]
    worker_s = after["workers"][0]["step_s"] - before["workers"][0]["step_s"]
    return {
        "worker_ms": 1e3 * worker_s / steps,
        "scheduler_ms": 1e3 * (after["step_s"] - before["step_s"]) / steps,
        "client_ms": 1e3 * wall / steps,
        "tok_s": tokens / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="a checkpoint folder (default: the embedded model)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="A, B, B, A pairs")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--channels", nargs="+", default=list(CHANNELS), choices=CHANNELS)
    args = parser.parse_args()

    import ray

    from cluster import SamplingParams
    from cluster.config import engine_config_from_args
    from cluster.models.default_model import ensure_default_model

    config = engine_config_from_args(
        args.model or ensure_default_model(), device="cpu", dtype="float32", max_model_len=512
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(
        "| concurrency | steps via | in-process ms/step | Ray worker ms/step "
        "| scheduler actor ms/step | client ms/step | Ray submit+wait us | delivery us "
        "| tok/s Ray / in-process |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for concurrency in args.concurrency:
        prompts = PROMPTS[:concurrency]
        local: list[dict[str, float]] = []
        remote: dict[str, list[dict[str, float]]] = {c: [] for c in args.channels}
        for _ in range(args.rounds):
            local.append(in_process(config, prompts, params))
            for channel in args.channels + args.channels[::-1]:
                remote[channel].append(on_ray(config, prompts, params, channel))
            local.append(in_process(config, prompts, params))

        def med(runs: list[dict[str, float]], key: str) -> float:
            return statistics.median(r[key] for r in runs)

        for channel, runs in remote.items():
            worker, scheduler, client = (
                med(runs, k) for k in ("worker_ms", "scheduler_ms", "client_ms")
            )
            print(
                f"| {concurrency} | {channel} "
                f"| {med(local, 'step_ms'):.2f} | {worker:.2f} | {scheduler:.2f} "
                f"| {client:.2f} | {1e3 * (scheduler - worker):.0f} "
                f"| {1e3 * (client - scheduler):.0f} "
                f"| {med(runs, 'tok_s') / med(local, 'tok_s'):.3f} |"
            )
    ray.shutdown()


if __name__ == "__main__":
    main()
