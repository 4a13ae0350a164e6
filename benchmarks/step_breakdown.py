"""Where an engine step's time goes: the Python around the forward, at batch 1 and 64.

Runs `LLM.generate` on the default model (greedy, ignore_eos) and times, per decode step,
each part of the step: scheduling, the msgpack messages (encode and decode, both ways),
building the model inputs, the target forward, sampling (logits, sampler or rejection
sampler), drafting, applying the output in the scheduler, and output processing
(detokenisation and stop strings). Prints a markdown table of ms per step and the share
of the whole step; "other" is the step's time outside the timed parts.

    python benchmarks/step_breakdown.py [--compile on|off] [--spec ngram|eagle3|none]
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from cluster import LLM, SamplingParams
from cluster.engine import llm_engine, messages, output_processor, scheduler
from cluster.worker import input_batch

warnings.filterwarnings("ignore")

SPECS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "eagle3": {"method": "eagle3", "model": "builtin:smollm2-eagle3", "num_speculative_tokens": 3},
}


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original: Callable = getattr(owner, name)
        timers = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timers.seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me a short story about the number {i}."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compile", default="on", choices=["on", "off"])
    parser.add_argument("--spec", default="none", choices=list(SPECS))
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    llm = LLM(compile=args.compile, max_num_seqs=64, speculative_config=SPECS[args.spec])
    runner = llm.engine.core.executor.worker.runner
    timers = Timers()
    parts = [
        (scheduler.Scheduler, "schedule", "schedule"),
        (scheduler.Scheduler, "update_from_output", "apply output (scheduler)"),
        (messages.SchedulerOutput, "encode", "messages"),
        (messages.SchedulerOutput, "decode", "messages"),
        (messages.ModelRunnerOutput, "encode", "messages"),
        (messages.ModelRunnerOutput, "decode", "messages"),
        (input_batch.InputBatch, "prepare", "model inputs"),
        (runner, "target_forward", "target forward"),
        (runner, "_verify", "sampling + verification"),
        (runner, "_propose", "drafting"),
        (output_processor.OutputProcessor, "process", "output processing + detok"),
        (llm_engine.LLMEngine, "advance", "whole step"),
    ]
    for owner, name, label in parts:
        timers.wrap(owner, name, label)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    print(f"compile={args.compile} spec={args.spec} new_tokens={args.new_tokens}\n")
    print("| part | batch 1 (ms/step) | share | batch 64 (ms/step) | share |")
    print("|---|---:|---:|---:|---:|")
    columns = []
    for batch in (1, 64):
        prompts = [{"prompt_token_ids": p} for p in chat_prompts(tokenizer, batch)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        timers.seconds.clear()
        steps = {"n": 0}
        step = llm.engine.advance

        def counted_step(step=step, steps=steps) -> Any:
            steps["n"] += 1
            return step()

        llm.engine.advance = counted_step
        llm.generate(prompts, params, use_tqdm=False)
        llm.engine.advance = step
        columns.append({k: 1000 * v / steps["n"] for k, v in timers.seconds.items()})
    labels = [label for _, _, label in parts if label != "whole step"]
    for label in dict.fromkeys([*labels, "other", "whole step"]):
        cells = []
        for col in columns:
            total = col["whole step"]
            value = (
                total - sum(col.get(x, 0.0) for x in labels)
                if label == "other"
                else col.get(label, 0.0)
            )
            cells.append(f"{value:.2f} | {100 * value / total:.0f}%")
        print(f"| {label} | {' | '.join(cells)} |")
    llm.shutdown()


if __name__ == "__main__":
    main()
