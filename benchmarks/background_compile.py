"""A warm start of the default engine (SmolLM2 with the shipped EAGLE-3 head, k = 3), compiling before serving against serving eagerly
while the graphs compile on a thread (`compile_in_background`, what a Serve replica's
in-place restart does).

Each run is a fresh process (imports included, inductor's cache warm after a first
unmeasured start), modes interleaved A B B A, medians. Per run:
- ready s: process start -> the engine constructed (`LLM(...)` returned);
- first answer s: process start -> a greedy 64-token answer to a chat prompt is complete;
- compiled s: process start -> every forward runs its graph;
- and whether the answer equals the blocking engine's, token for token.

    python benchmarks/background_compile.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

MODES = {"compile, then serve": False, "serve while compiling": True}
EAGLE3 = {"method": "eagle3", "model": "builtin:smollm2-eagle3", "num_speculative_tokens": 3}
PROMPT = "Explain in a few sentences why the sky is blue."


def one_run(background: bool) -> dict:
    """In this (fresh) process: the timings of one start."""
    start = time.perf_counter()
    from cluster import LLM, SamplingParams

    llm = LLM(
        dtype="auto",
        compile="on",
        compile_in_background=background,
        speculative_config=EAGLE3,
    )
    ready = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    out = llm.chat([{"role": "user", "content": PROMPT}], params, use_tqdm=False)
    answered = time.perf_counter()
    runner = llm.engine.core.executor.worker.runner
    forwards = [runner.target_forward, *getattr(runner.proposer, "forwards", [])]
    while any(getattr(f, "eager_until_warm", False) for f in forwards):
        time.sleep(0.05)
    compiled = time.perf_counter()
    llm.shutdown()
    return {
        "ready": ready - start,
        "answered": answered - start,
        "compiled": compiled - start,
        "tokens": list(out[0].outputs[0].token_ids),
    }


def run_in_subprocess(background: bool) -> dict:
    code = f"import json, background_compile as b; print(json.dumps(b.one_run({background})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE)
    if done.returncode != 0:
        raise RuntimeError(f"the measured start failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="A B B A per round")
    args = parser.parse_args()
    from fleet import cpu_model

    print(f"CPU: {cpu_model()}")
    run_in_subprocess(False)  # fills inductor's cache: every measured start is warm
    results: dict[str, list[dict]] = {name: [] for name in MODES}
    names = list(MODES)
    for _ in range(args.rounds):
        for name in [names[0], names[1], names[1], names[0]]:
            results[name].append(run_in_subprocess(MODES[name]))
            r = results[name][-1]
            print(f"{name}: ready {r['ready']:.1f} s, answered {r['answered']:.1f} s")
    reference = results[names[0]][0]["tokens"]
    print("\n| start | ready s | first answer s | compiled s | answer equal |")
    print("|---|---:|---:|---:|---|")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("ready", "answered", "compiled")}
        equal = all(r["tokens"] == reference for r in runs)
        row = f"| {name} | {med['ready']:.1f} | {med['answered']:.1f} | {med['compiled']:.1f} |"
        print(f"{row} {'yes' if equal else 'NO'} |")


if __name__ == "__main__":
    main()
