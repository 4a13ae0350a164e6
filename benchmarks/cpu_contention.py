"""What another process's CPU costs the model: the in-process engine's tokens/s while a
background process burns a given share of one core in short bursts, the way serving's
processes (the replica, the ingress, the scheduler actor, the client) take theirs.

`benchmarks/serve_cpu.py` says how many milliseconds of CPU per engine step serving
spends outside the model; this script says what that much CPU, spent by anyone, costs
the model's tokens/s on this machine, with no Ray or Serve involved. Each load level
runs interleaved with the others (every level, then every level in reverse, `--rounds`
times); the table reports medians and the load process's measured CPU. The last
column is the engine's extra wall time per millisecond of the load's CPU: 0.5 if the load
took its share evenly from the two threads' cores, 1 if every millisecond it runs stalls
both threads (one waits at the next barrier for the other).

    python benchmarks/cpu_contention.py [--shares 0 0.07 0.14 0.28] [--concurrency 1 16]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import time
import warnings

warnings.filterwarnings("ignore")


def burn(share: float, burst_s: float, ready, stop, seed: int) -> None:
    """Busy `burst_s` at a time, then sleep so that the busy share is `share` of a core
    (sleeps jittered, so the bursts do not lock onto the model's step)."""
    rng = random.Random(seed)
    idle_s = burst_s * (1 / share - 1)
    ready.set()
    while not stop.is_set():
        end = time.perf_counter() + burst_s
        while time.perf_counter() < end:
            pass
        time.sleep(idle_s * rng.uniform(0.5, 1.5))


class Load:
    """A background process burning `share` of one core while the `with` block runs."""

    def __init__(self, share: float, burst_s: float, seed: int) -> None:
        self.share, self.burst_s, self.seed = share, burst_s, seed

    def __enter__(self) -> Load:
        self.process = None
        if self.share > 0:
            ctx = mp.get_context("spawn")
            ready, self.stop = ctx.Event(), ctx.Event()
            self.process = ctx.Process(
                target=burn, args=(self.share, self.burst_s, ready, self.stop, self.seed)
            )
            self.process.start()
            ready.wait()
            self.cpu_at_start = self._cpu_seconds()
        self.start = time.perf_counter()
        return self

    def _cpu_seconds(self) -> float:
        import psutil

        times = psutil.Process(self.process.pid).cpu_times()
        return times.user + times.system

    def cpu_share(self) -> float:
        """The load's CPU seconds so far over the wall seconds since it started."""
        if self.process is None:
            return 0.0
        return (self._cpu_seconds() - self.cpu_at_start) / (time.perf_counter() - self.start)

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.stop.set()
            self.process.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", default="cluster/manifests/default.yaml")
    parser.add_argument("--shares", type=float, nargs="+", default=[0, 0.07, 0.14, 0.28])
    parser.add_argument("--burst-ms", type=float, default=0.5, help="busy time per burst")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="each a forward and a reverse pass")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine")
    args = parser.parse_args()

    import torch
    from serve import in_process  # benchmarks/serve.py

    from cluster import LLM, SamplingParams
    from cluster.serve import load_manifest

    torch.set_num_threads(args.threads)
    manifest = load_manifest(args.manifest).with_args(speculative=None)
    llm = LLM(**manifest.args.engine_args())
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs: dict[tuple[float, int], list[dict[str, float]]] = {}
    try:
        for r in range(args.rounds):
            for c in args.concurrency:
                for i, share in enumerate([*args.shares, *reversed(args.shares)]):
                    with Load(share, args.burst_ms / 1e3, seed=r * 100 + i) as load:
                        result = in_process(llm, params, c, args.requests_per_client)
                        result["load_share"] = load.cpu_share()
                    runs.setdefault((share, c), []).append(result)
                    print(f"  share={share:<5} c={c:<3d} {result}", flush=True)
    finally:
        llm.shutdown()
    results = {
        key: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for key, rs in runs.items()
    }
    print(
        f"\n{manifest.args.served_model_name}, speculation off, {args.threads} torch threads, "
        f"{os.cpu_count()} CPUs, load bursts of {args.burst_ms} ms\n"
    )
    print(
        "| concurrency | load (share of one core) | load measured | ms/step | tokens/s "
        "| vs no load | model time lost per ms of load |"
    )
    print("|---|---|---|---|---|---|---|")
    for (share, c), res in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        base = results[args.shares[0], c]
        ratio = res["tok_s"] / base["tok_s"]
        # per ms of the load's CPU, how many ms longer the engine took for the same tokens
        lost = (1 / ratio - 1) / res["load_share"] if res["load_share"] > 0 else float("nan")
        print(
            f"| {c} | {share:.2f} | {res['load_share']:.3f} | {res['client_ms']:.1f} "
            f"| {res['tok_s']:.1f} | {ratio:.2f}x | {lost:.2f} |"
        )


if __name__ == "__main__":
    main()
