"""Target forward latency: ours against transformers on the same weights, dtype and machine.

Two shapes per token count N:
- prefill: one sequence of N new tokens;
- decode: N sequences, one new token each, over a cached context of `--context` tokens.
Prints a markdown table with the median latency of each and the ratio (transformers / ours;
above 1 means we are faster).

    python benchmarks/forward.py [--model PATH] [--tokens 1 4 16 64] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from cluster.config import ModelConfig
from cluster.models.attention import AttentionMetadata
from cluster.models.default_model import ensure_default_model
from cluster.models.loader import load_model
from cluster.parallel import ParallelState
from cluster.worker.kv_cache import PagedKVCache
from cluster.worker.worker import attention_layer_shapes

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers renames past_key_values


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--context", type=int, default=64, help="cached tokens per sequence when decoding"
    )
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    path = args.model or ensure_default_model()
    config = ModelConfig(path=path, dtype=args.dtype)
    device = config.resolved_device
    ours = load_model(config, ParallelState.single(device), show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=config.torch_dtype).to(device).eval()
    cfg = ours.config
    vocab = cfg.vocab_size
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn: Callable[[], object]) -> float:
        return median_ms(lambda: (fn(), sync()), args.repeats)

    print(f"model={path} dtype={args.dtype} device={device} threads={torch.get_num_threads()}\n")
    print("| shape | tokens | ours (ms) | transformers (ms) | ratio hf/ours |")
    print("|---|---:|---:|---:|---:|")
    for n in args.tokens:
        ids = torch.randint(0, vocab, (n,), device=device)
        meta = AttentionMetadata.for_prefill([n], device)
        t_ours = timed(lambda ids=ids, meta=meta: ours.compute_logits(ours(ids, meta)))
        t_hf = timed(lambda ids=ids: hf(ids[None]).logits)
        print(f"| prefill | {n} | {t_ours:.2f} | {t_hf:.2f} | {t_hf / t_ours:.2f} |")

    ctx = args.context
    for n in args.tokens:
        prompt = torch.randint(0, vocab, (n, ctx), device=device)
        step = torch.randint(0, vocab, (n,), device=device)
        # The engine's paged KV cache, one block table per sequence.
        blocks_per_seq = -(-(ctx + 1) // 16)
        cache = PagedKVCache(
            attention_layer_shapes(ours), n * blocks_per_seq, 16, config.torch_dtype, device
        )
        tables = torch.arange(n * blocks_per_seq, device=device).view(n, blocks_per_seq)
        pos = torch.arange(ctx, device=device)
        slots = (tables[:, pos // 16] * 16 + pos % 16).flatten()
        prefill = AttentionMetadata.for_prefill([ctx] * n, device)
        prefill.kv_cache, prefill.slot_mapping, prefill.block_tables = cache, slots, tables
        ours(prompt.flatten(), prefill)
        decode = AttentionMetadata(
            list(range(n + 1)),
            [ctx + 1] * n,
            torch.full((n,), ctx, device=device),
            cache,
            slot_mapping=tables[:, ctx // 16] * 16 + ctx % 16,
            block_tables=tables,
        )
        t_ours = timed(lambda step=step, decode=decode: ours.compute_logits(ours(step, decode)))

        past = DynamicCache()
        hf(prompt, past_key_values=past, use_cache=True)

        def hf_decode(step=step, past=past) -> torch.Tensor:
            logits = hf(step[:, None], past_key_values=past, use_cache=True).logits
            past.crop(-1)  # drop the token just added, so every step sees the same context
            return logits

        t_hf = timed(hf_decode)
        print(f"| decode (ctx {ctx}) | {n} | {t_ours:.2f} | {t_hf:.2f} | {t_hf / t_ours:.2f} |")


if __name__ == "__main__":
    main()
