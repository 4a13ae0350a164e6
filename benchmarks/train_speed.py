"""EAGLE-3 training throughput on cached features of the default model, variants
interleaved in one process: answer tokens (the labelled ones) trained per second.

- `all rows`: every position through every TTT step (the trainer before this
  benchmark existed: ~380 answer tokens/s on the 896-prompt data);
- `labelled rows`: prompt rows give step-0 keys only, every step runs on the rows that
  have a label (`Batch.window`);
- `+ frozen LM head`: the head's LM-head rows stay the target's (no weight gradient);
- `+ compiled`: the step's forward under `torch.compile` (dynamic shapes);
- `+ bf16`: the forward under bfloat16 autocast, float32 master weights (what
  `train-draft` does where the CPU has bfloat16 matrix instructions).

Each round runs every variant on the same batches (forward then reverse order: A, B, B,
A); the table gives medians and the ratio to `all rows`.

    python benchmarks/train_speed.py --features WORK_DIR/features_train [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
from safetensors import safe_open

from cluster.config import ModelConfig
from cluster.models.default_model import ensure_default_model
from cluster.train.eagle3_model import Eagle3Trainable
from cluster.train.loop import TrainConfig, collate, load_shards, make_batches
from cluster.train.trainer import draft_vocabulary, eagle3_step


def build(variant: str, hf, embed, head, d2t, config):
    torch.manual_seed(0)
    model = Eagle3Trainable(hf, len(d2t), embed)
    with torch.no_grad():
        model.lm_head.weight.copy_(head[torch.arange(len(d2t)) + d2t])
    model.lm_head.weight.requires_grad_("frozen" not in variant)
    runner = torch.compile(model, dynamic=True) if "compiled" in variant else model
    step = eagle3_step(runner, config, window=variant != "all rows")
    params = [p for p in model.parameters() if p.requires_grad]
    precision = "bfloat16" if "bf16" in variant else "float32"
    return model, step, torch.optim.AdamW(params, lr=1e-3), TrainConfig(precision=precision)


def run(model, step, optimizer, config, batches) -> tuple[float, int]:
    """Seconds and answer tokens (step 0's labels) of one pass over `batches`."""
    tokens, started = 0, time.perf_counter()
    for batch in batches:
        with config.autocast():
            loss, counts = step(batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        tokens += counts.totals[0]
    return time.perf_counter() - started, tokens


def gemm_rate(dtype: torch.dtype, rows: int = 4096) -> float:
    """GFLOP/s of a [rows, 576] x [576, 1536] matmul, the head's MLP shape: the roofline
    a CPU training step cannot beat."""
    a, w = torch.randn(rows, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
    for _ in range(3):
        torch.nn.functional.linear(a, w)
    started, n = time.perf_counter(), 20
    for _ in range(n):
        torch.nn.functional.linear(a, w)
    return 2 * rows * 576 * 1536 * n / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--features", required=True, nargs="+", help="EAGLE-3 feature folders")
    parser.add_argument("--batches", type=int, default=12, help="batches per variant per round")
    parser.add_argument("--batch-tokens", type=int, default=TrainConfig.batch_tokens)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=None)
    args = parser.parse_args()

    target = ensure_default_model()
    hf = ModelConfig(path=target, dtype="float32").hf_config
    with safe_open(os.path.join(target, "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
        names = set(f.keys())
        head = f.get_tensor("lm_head.weight").float() if "lm_head.weight" in names else embed
    sequences = load_shards(args.features)
    config = TrainConfig(batch_tokens=args.batch_tokens)
    d2t, _ = draft_vocabulary(sequences, config.draft_vocab_size, int(hf.vocab_size))
    label_map = torch.full((int(hf.vocab_size),), -100, dtype=torch.int64)
    label_map[torch.arange(len(d2t)) + d2t] = torch.arange(len(d2t))
    order = make_batches(sequences, config.batch_tokens, random.Random(0))[: args.batches]
    batches = [collate(sequences, i, label_map, config.ttt_steps) for i in order]
    prompt = sum(int(b.first_row.sum()) for b in batches)
    total = sum(int(b.valid.sum()) for b in batches)
    print(f"{len(batches)} batches, {total} tokens, {total - prompt} from the first labelled row")

    variants = args.variants or [
        "all rows",
        "labelled rows",
        "labelled rows + frozen LM head",
        "labelled rows + frozen LM head + compiled",
        "labelled rows + compiled",
        "labelled rows + compiled + bf16",
    ]
    built = {v: build(v, hf, embed, head, d2t, config) for v in variants}
    for v in variants:  # warm-up (and compile) outside the timings
        run(*built[v], batches[:2])
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            seconds, tokens = run(*built[v], batches)
            rates[v].append(tokens / seconds)
            print(f"round {r + 1} {v}: {tokens / seconds:.0f} answer tok/s", flush=True)
    for dtype in (torch.float32, torch.bfloat16):
        rate = gemm_rate(dtype)
        print(f"{dtype} GEMM (the MLP's shape, 4096 rows): {rate:.0f} GFLOP/s")
    base = statistics.median(rates[variants[0]])
    print("\n| variant | answer tokens/s (median) | vs all rows |\n|---|---:|---:|")
    for v in variants:
        rate = statistics.median(rates[v])
        print(f"| {v} | {rate:.0f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
