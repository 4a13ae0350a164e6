"""Generation throughput: our engine against transformers `generate`, same weights and dtype.

- decode tokens/s at batch 1 (one prompt, `--new-tokens` tokens, greedy, ignore_eos);
- generation throughput for `--num-requests` chat requests (ours: continuous batching;
  transformers: one left-padded batch through `generate`).
Ours runs eagerly and compiled (`compile="on"`, default buckets); every side is timed
interleaved over `--repeats` rounds and reported as a median. Prints a markdown table with
the ratios ours / transformers (above 1: we are faster).

    python benchmarks/throughput.py [--model PATH] [--dtype float32] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams

warnings.filterwarnings("ignore")

TOPICS = [
    "the ocean",
    "volcanoes",
    "bread baking",
    "prime numbers",
    "the moon",
    "bicycles",
    "rainforests",
    "jazz music",
    "chess openings",
    "honey bees",
    "glaciers",
    "the printing press",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"Tell me something interesting about {TOPICS[i % len(TOPICS)]} (#{i}).",
                }
            ],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(n)
    ]


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """Seconds for one left-padded batched `generate` call (greedy, no early stop)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    start = time.perf_counter()
    model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad_id
    )
    elapsed = time.perf_counter() - start
    model.generation_config.eos_token_id = saved
    return elapsed


def ours_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def interleaved(fns: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median seconds of each side, run in alternating order (A B C, C B A, ...)."""
    names, times = list(fns), {name: [] for name in fns}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(fns[name]())
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--batch-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    engine = dict(dtype=args.dtype, max_model_len=512, max_num_seqs=args.num_requests)
    start = time.perf_counter()
    eager = LLM(args.model, compile="off", **engine)
    eager_start_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = LLM(args.model, compile="on", **engine)
    compiled_start_s = time.perf_counter() - start
    path = eager.config.model.path
    device = eager.config.model.resolved_device
    hf = (
        AutoModelForCausalLM.from_pretrained(path, dtype=eager.config.model.torch_dtype)
        .to(device)
        .eval()
    )
    tokenizer = eager.get_tokenizer()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    one = chat_prompts(tokenizer, 1)
    many = chat_prompts(tokenizer, args.num_requests)
    rows = []
    for name, prompts, new in (
        ("decode, batch 1", one, args.new_tokens),
        (
            f"{args.num_requests} requests x {args.batch_new_tokens} tokens",
            many,
            args.batch_new_tokens,
        ),
    ):
        ours_generate(eager, prompts[:1], 4)  # warm-up
        ours_generate(compiled, prompts[:1], 4)
        hf_generate(hf, prompts[:1], 4, pad_id)
        seconds = interleaved(
            {
                "eager": lambda p=prompts, n=new: ours_generate(eager, p, n),
                "compiled": lambda p=prompts, n=new: ours_generate(compiled, p, n),
                "hf": lambda p=prompts, n=new: hf_generate(hf, p, n, pad_id),
            },
            args.repeats,
        )
        total = len(prompts) * new
        rows.append((name, *(total / seconds[k] for k in ("eager", "compiled", "hf"))))

    print(f"model={path} dtype={args.dtype} device={device} threads={torch.get_num_threads()}")
    print(
        f"start-up: eager {eager_start_s:.1f} s, compiled {compiled_start_s:.1f} s "
        f"(buckets {compiled.config.compile.sizes}; a warm inductor cache makes this shorter)\n"
    )
    print(
        "| workload | ours eager (tok/s) | ours compiled (tok/s) | transformers generate "
        "(tok/s) | compiled / transformers | eager / transformers |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, ours_eager, ours_compiled, theirs in rows:
        print(
            f"| {name} | {ours_eager:.1f} | {ours_compiled:.1f} | {theirs:.1f} | "
            f"{ours_compiled / theirs:.2f} | {ours_eager / theirs:.2f} |"
        )
    eager.shutdown()
    compiled.shutdown()


if __name__ == "__main__":
    main()
