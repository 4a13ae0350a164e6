"""Pipeline parallelism: throughput of PP=2 (and PP=3) against PP=1, and how long each stage
sits idle, on the same machine in one run.

Each layout serves `--num-requests` concurrent chat requests (greedy, ignore_eos) through
the offline engine; ranks are spawned processes on gloo, each given cores / world_size
torch threads, so every layout uses the same cores. A stage's idle fraction is
1 - (its time inside steps, minus receiving from the previous stage and sending to the
next) / wall time; PP=1 has no stage to wait for, so its idle time is the engine's own
per-step overhead (scheduling, detokenizing). Also
checks that every layout gives the same tokens.

    python benchmarks/pipeline.py [--model PATH] [--num-requests 16] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import time
import warnings

from cluster import LLM, SamplingParams

warnings.filterwarnings("ignore")

TOPICS = ["the ocean", "volcanoes", "bread", "prime numbers", "the moon", "bicycles", "jazz"]


def run(
    model: str | None,
    pp: int,
    num_requests: int,
    new_tokens: int,
    partition: tuple[int, ...] | None = None,
) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    messages = [
        [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} (#{i})."}]
        for i in range(num_requests)
    ]
    engine = dict(dtype="float32", max_model_len=512, pipeline_layer_partition=partition)
    with LLM(model, pipeline_parallel_size=pp, **engine) as llm:
        llm.chat(messages[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        executor = llm.engine.core.executor
        before = executor.stage_timings()
        start = time.perf_counter()
        outs = llm.chat(messages, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = executor.stage_timings()
    idle = []
    for b, a in zip(before, after, strict=True):
        waits = sum(a[k] - b[k] for k in ("recv_wait_s", "send_wait_s"))
        busy = (a["step_s"] - b["step_s"]) - waits
        idle.append(max(0.0, 1 - busy / wall))
    tokens = [o.outputs[0].token_ids for o in outs]
    return {
        "layout": f"PP={pp}" + (f" split {'/'.join(map(str, partition))}" if partition else ""),
        "tok_s": sum(len(t) for t in tokens) / wall,
        "idle": idle,
        "steps": after[0]["steps"] - before[0]["steps"],
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument(
        "--partitions",
        nargs="*",
        default=["19,11", "12,10,8"],
        help="explicit layer splits to add (the last stage also runs the LM head)",
    )
    args = parser.parse_args()
    layouts = [(pp, None) for pp in args.pp]
    layouts += [(len(p.split(",")), tuple(int(n) for n in p.split(","))) for p in args.partitions]
    results = [
        run(args.model, pp, args.num_requests, args.new_tokens, part) for pp, part in layouts
    ]
    base = results[0]
    print(f"\n{args.num_requests} concurrent requests x {args.new_tokens} tokens, float32\n")
    print("| layout | tok/s | vs PP=1 | steps per stage | idle fraction per stage | same tokens |")
    print("|---|---:|---:|---:|---|---|")
    for r in results:
        idle = " / ".join(f"{x:.2f}" for x in r["idle"])
        same = "yes" if r["tokens"] == base["tokens"] else "NO"
        print(
            f"| {r['layout']} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x "
            f"| {r['steps']} | {idle} | {same} |"
        )


if __name__ == "__main__":
    main()
