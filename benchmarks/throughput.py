"""Generation throughput: our engine against transformers `generate`, same weights and dtype.

- decode tokens/s at batch 1 (one prompt, `--new-tokens` tokens, greedy, ignore_eos);
- generation throughput for `--num-requests` chat requests (ours: continuous batching;
  transformers: one left-padded batch through `generate`).
Prints a markdown table with the ratio ours / transformers (above 1: we are faster).

    python benchmarks/throughput.py [--model PATH] [--dtype float32] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import time
import warnings

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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--batch-new-tokens", type=int, default=32)
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_model_len=512, max_num_seqs=args.num_requests)
    path = llm.config.model.path
    device = llm.config.model.resolved_device
    hf = (
        AutoModelForCausalLM.from_pretrained(path, dtype=llm.config.model.torch_dtype)
        .to(device)
        .eval()
    )
    tokenizer = llm.get_tokenizer()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    one = chat_prompts(tokenizer, 1)
    ours_generate(llm, one, 4)  # warm-up
    hf_generate(hf, one, 4, pad_id)
    rows = []
    t_ours = ours_generate(llm, one, args.new_tokens)
    t_hf = hf_generate(hf, one, args.new_tokens, pad_id)
    rows.append(("decode, batch 1", args.new_tokens / t_ours, args.new_tokens / t_hf))
    many = chat_prompts(tokenizer, args.num_requests)
    total = args.num_requests * args.batch_new_tokens
    t_ours = ours_generate(llm, many, args.batch_new_tokens)
    t_hf = hf_generate(hf, many, args.batch_new_tokens, pad_id)
    rows.append(
        (
            f"{args.num_requests} requests x {args.batch_new_tokens} tokens",
            total / t_ours,
            total / t_hf,
        )
    )

    print(f"model={path} dtype={args.dtype} device={device} threads={torch.get_num_threads()}\n")
    print("| workload | ours (tokens/s) | transformers generate (tokens/s) | ratio |")
    print("|---|---:|---:|---:|")
    for name, ours, theirs in rows:
        print(f"| {name} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} |")
    llm.shutdown()


if __name__ == "__main__":
    main()
