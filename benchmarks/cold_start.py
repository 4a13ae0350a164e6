"""Cold compile of the engine's CPU forward: how the C++ wrapper is built.

With prepacked weights the compiled CPU graph has a C++ wrapper: thousands of lines that
call the kernels and the packed products. Inductor builds it either in one file with the
kernels at -O3 (its default) or apart from them at -O1 (`cpp_wrapper_build_separate`,
what the engine uses). This script compiles the default model's forward (one graph for
every token count, as a batch-invariant engine does) each way:
- cold compile seconds, each in a fresh process with an empty inductor cache, the two
  builds interleaved (A, B, B, A, ...), medians;
- step latency at 1 / 4 / 16 tokens, both graphs in one process, interleaved, medians,
  and whether their logits are bitwise equal.

    python benchmarks/cold_start.py [--rounds 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BUILDS = {
    "one file, -O3 (inductor's default)": {"cpp_wrapper_build_separate": False},
    "wrapper apart, -O1 (the engine)": {"cpp_wrapper_build_separate": True},
}


def compiled_forward(build: str):  # -> CompiledForward
    import torch

    import cluster.models.compiled as compiled_module
    from cluster.config import ModelConfig
    from cluster.models.compiled import CompiledForward, CompileOptions
    from cluster.models.default_model import ensure_default_model
    from cluster.models.loader import load_model
    from cluster.parallel import ParallelState
    from cluster.parallel.linear import pack_linears

    config = ModelConfig(path=ensure_default_model(), dtype="auto")
    model = load_model(config, ParallelState.single("cpu"), show_progress=False)
    packed = pack_linears(model)

    def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model.compute_logits(model(ids, positions))

    options = CompileOptions((1, 4, 16, 64), autotune=False, dynamic=True, freeze=packed == 0)
    # the engine's inductor settings with this build's over them, while the graph is built
    engine_settings = compiled_module._cpu_settings
    compiled_module._cpu_settings = lambda o: {**engine_settings(o), **BUILDS[build]}
    try:
        compiled = CompiledForward(forward, options, torch.device("cpu"), build)
        compiled.warm_up()
    finally:
        compiled_module._cpu_settings = engine_settings
    return compiled


def child(build: str) -> None:
    start = time.perf_counter()
    compiled_forward(build)
    print(json.dumps({"compile_s": time.perf_counter() - start}))


def cold_compile_seconds(build: str) -> float:
    with tempfile.TemporaryDirectory(prefix="cold-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        out = subprocess.run(
            [sys.executable, __file__, "--child", build],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    return json.loads(out.strip().splitlines()[-1])["compile_s"]


def step_latency(repeats: int) -> tuple[dict[int, dict[str, float]], bool]:
    import torch

    from cluster.models.attention import AttentionMetadata, attention_context

    graphs = {build: compiled_forward(build) for build in BUILDS}

    def step(build: str, n: int) -> torch.Tensor:
        meta = AttentionMetadata.for_prefill([n], torch.device("cpu"))
        with torch.inference_mode(), attention_context(meta):
            return graphs[build](torch.arange(n) % 1000, torch.arange(n))

    names = list(BUILDS)
    same = all(torch.equal(step(names[0], n), step(names[1], n)) for n in (1, 16))
    table = {}
    for n in (1, 4, 16):
        times: dict[str, list[float]] = {b: [] for b in names}
        for r in range(repeats):
            for b in names if r % 2 == 0 else reversed(names):
                start = time.perf_counter()
                step(b, n)
                times[b].append(time.perf_counter() - start)
        table[n] = {b: 1000 * statistics.median(t) for b, t in times.items()}
    return table, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="cold compiles per build / 1")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--child", choices=list(BUILDS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    names = list(BUILDS)
    seconds: dict[str, list[float]] = {b: [] for b in names}
    for r in range(args.rounds):
        for b in names if r % 2 == 0 else reversed(names):
            seconds[b].append(cold_compile_seconds(b))
            print(f"cold compile, {b}: {seconds[b][-1]:.1f} s", flush=True)
    table, same = step_latency(args.repeats)
    base = names[0]
    print("\n| wrapper build | cold compile (s) | 1 token (ms) | 4 tokens (ms) | 16 tokens (ms) |")
    print("|---|---:|---:|---:|---:|")
    for b in names:
        ms = " | ".join(f"{table[n][b]:.2f}" for n in (1, 4, 16))
        print(f"| {b} | {statistics.median(seconds[b]):.1f} | {ms} |")
    ratio = statistics.median(seconds[names[1]]) / statistics.median(seconds[base])
    print(f"\ncold compile, apart / one file: {ratio:.2f}; logits bitwise equal: {same}")


if __name__ == "__main__":
    main()
