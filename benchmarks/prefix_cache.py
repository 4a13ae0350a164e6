"""Automatic prefix caching on a shared-system-prompt workload: time to first token and
throughput with the cache on and off, the same engine otherwise.

Every request is a chat with the same long system prompt and its own question; they
arrive `--concurrency` at a time (each wave waits for the previous one, so later waves
can find the system prompt cached). TTFT is the median over the waves after the first. Runs alternate off, on, on, off (`--rounds` times)
and the table reports medians.

    python benchmarks/prefix_cache.py [--model PATH] [--requests 32] [--concurrency 4]
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

SYSTEM = (
    "You are the support assistant of a company that rents bicycles in a large city. "
    "Answer politely and briefly. Rules: rentals start at 8 am and end at 10 pm; a day "
    "costs 20 euros, a week 90; helmets are free; children under 12 ride only with an "
    "adult; damaged bicycles must be reported at once; payment is by card only; the "
    "deposit is 100 euros and comes back within three days; electric bicycles cost 10 "
    "euros more per day; groups of more than 8 people must book a day ahead; the shop "
    "closes on public holidays. "
) * 3


def run(engine: Any, tokenizer: Any, questions: list[str], concurrency: int, params: Any):
    """(median time to first token of the requests after the first wave, which could find
    the system prompt cached; output tokens per second over all requests)."""

    async def one(question: str) -> tuple[float, int]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        start, first, last = time.perf_counter(), None, None
        async for out in engine.generate(prompt, params):
            first = first or time.perf_counter()
            last = out
        return first - start, len(last.outputs[0].token_ids)

    async def all_waves() -> tuple[list[float], int]:
        ttfts, tokens = [], 0
        for i in range(0, len(questions), concurrency):
            for ttft, n in await asyncio.gather(*map(one, questions[i : i + concurrency])):
                ttfts.append(ttft)
                tokens += n
        return ttfts, tokens

    start = time.perf_counter()
    ttfts, tokens = asyncio.run(all_waves())
    return statistics.median(ttfts[concurrency:]), tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="a checkpoint folder (default: the embedded model)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="off, on, on, off per round")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from cluster import SamplingParams
    from cluster.config import engine_config_from_args
    from cluster.engine.async_llm import AsyncLLM
    from cluster.llm import build_engine
    from cluster.models.default_model import ensure_default_model

    model = args.model or ensure_default_model()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    questions = [
        f"Question {i}: what should I know about rule number {i % 9}?" for i in range(args.requests)
    ]
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for cache in (False, True, True, False):
            config = engine_config_from_args(
                model,
                device="cpu",
                dtype="float32",
                max_model_len=2048,
                enable_prefix_caching=cache,
            )
            engine = AsyncLLM(build_engine(config))
            try:
                tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path)
                results[cache].append(run(engine, tokenizer, questions, args.concurrency, params))
                hit_rate = engine.core.get_metrics()["prefix_cache_hit_rate"]
            finally:
                engine.shutdown()
            print(
                f"  prefix caching {'on ' if cache else 'off'}: {results[cache][-1]} hit rate {hit_rate:.2f}"
            )
    system_tokens = len(tokenizer(SYSTEM)["input_ids"])
    print(
        f"\n{args.requests} chats sharing a {system_tokens}-token system prompt, "
        f"{args.concurrency} at a time, {args.max_tokens} tokens each\n"
    )
    print(
        "| prefix caching | median TTFT after wave 1 (ms) | output tokens/s | TTFT vs off | tokens/s vs off |"
    )
    print("|---|---:|---:|---:|---:|")
    off_ttft = statistics.median(r[0] for r in results[False])
    off_tps = statistics.median(r[1] for r in results[False])
    for cache, runs in results.items():
        ttft = statistics.median(r[0] for r in runs)
        tps = statistics.median(r[1] for r in runs)
        print(
            f"| {'on' if cache else 'off'} | {1e3 * ttft:.0f} | {tps:.1f} "
            f"| {ttft / off_ttft:.2f}x | {tps / off_tps:.2f}x |"
        )


if __name__ == "__main__":
    main()
