"""Target forward latency: ours (eager and compiled) against transformers on the same
weights, dtype and machine, and against the memory roofline.

Three shapes per token count N:
- prefill: one sequence of N new tokens;
- decode: N sequences, one new token each, over a cached context of `--context` tokens;
- verify: one sequence with N new tokens over that cached context (a verification step
  of N - 1 drafts).
Every side of a row is timed interleaved (A, B, C, C, B, A, ...) and reported as a median.
The roofline is the time to read every weight once (in the dtype run: `--dtype auto` is
bfloat16 on CPUs with bfloat16 matrix units) at the read bandwidth measured in the same
run (the faster of a matrix-vector product and a sum over a buffer the size of the
weights). Eager runs with the engine's prepacked bfloat16 weights; compiled is the
engine's batch-invariant graph (one for every token count).

    python benchmarks/forward.py [--model PATH] [--tokens 1 4 16 64] [--no-compile]
                                 [--onednn-column]
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
from cluster.models.attention import AttentionMetadata, attention_context
from cluster.models.compiled import CompiledForward, CompileOptions
from cluster.models.default_model import ensure_default_model
from cluster.models.loader import load_model
from cluster.parallel import ParallelState
from cluster.parallel.linear import pack_linears
from cluster.worker.kv_cache import PagedKVCache
from cluster.worker.worker import attention_layer_shapes

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers renames past_key_values


def interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each function, run in alternating order (A B C, C B A, ...)."""
    names = list(fns)
    for name in names:  # warm-up
        fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def read_bandwidth_gbs(num_bytes: int, device: str, repeats: int = 7) -> float:
    """GB/s of streaming reads over a buffer of `num_bytes` (the faster of a float32
    matrix-vector product and a plain sum: the memory roofline's bandwidth)."""
    cols = 4096
    matrix = torch.randn(num_bytes // 4 // cols, cols, device=device)
    vec = torch.randn(cols, device=device)
    ms = interleaved_ms({"mv": lambda: torch.mv(matrix, vec), "sum": matrix.sum}, repeats)
    return num_bytes / min(ms.values()) / 1e6


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument(
        "--context", type=int, default=64, help="cached tokens per sequence when decoding"
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled column")
    parser.add_argument(
        "--onednn-column",
        action="store_true",
        help="also time the compiled forward with the linear layers packed for oneDNN",
    )
    args = parser.parse_args()

    path = args.model or ensure_default_model()
    config = ModelConfig(path=path, dtype=args.dtype)
    device = config.resolved_device
    ours = load_model(config, ParallelState.single(device), show_progress=False)
    packed = pack_linears(ours)  # as the engine does (bfloat16 on CPU)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=config.torch_dtype).to(device).eval()
    cfg = ours.config
    vocab = cfg.vocab_size
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    bandwidth = read_bandwidth_gbs(weight_bytes, device)
    roofline_ms = weight_bytes / bandwidth / 1e6

    def eager(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return ours.compute_logits(ours(ids, positions))

    def compile_forward(model: torch.nn.Module, name: str) -> CompiledForward:
        # As a batch-invariant engine compiles on CPU: one graph for every token count.
        def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model.compute_logits(model(ids, positions))

        sizes = tuple(sorted(set(args.tokens)))
        options = CompileOptions(sizes, autotune=False, dynamic=True, freeze=packed == 0)
        compiled = CompiledForward(forward, options, torch.device(device), name)
        seconds = compiled.warm_up()
        print(f"compiled the {name} (one graph for every token count) in {seconds:.1f} s")
        return compiled

    compiled = None if args.no_compile else compile_forward(ours, "forward")
    onednn = None
    if args.onednn_column and not args.no_compile:
        other = load_model(config, ParallelState.single(device), show_progress=False)
        pack_linears(other, kernel="onednn")
        onednn = compile_forward(other, "forward with oneDNN products")

    print(
        f"model={path} dtype={args.dtype} ({config.torch_dtype}) device={device} "
        f"threads={torch.get_num_threads()} "
        f"weights={weight_bytes / 1e6:.0f} MB read bandwidth={bandwidth:.1f} GB/s "
        f"roofline={roofline_ms:.2f} ms\n"
    )
    extra = " compiled, oneDNN (ms) | oneDNN / compiled |" if onednn is not None else ""
    print(
        "| shape | tokens | eager (ms) | compiled (ms) | transformers (ms) | hf / compiled "
        f"| compiled / roofline |{extra}"
    )
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if onednn is not None else ""))

    def row(shape: str, n: int, meta: AttentionMetadata, ids: torch.Tensor, hf_fn) -> None:
        def ours_fn(fn: Callable) -> Callable[[], object]:
            def run() -> object:
                with attention_context(meta):
                    out = fn(ids, meta.positions)
                sync()
                return out

            return run

        fns = {"eager": ours_fn(eager), "hf": lambda: (hf_fn(), sync())}
        if compiled is not None:
            fns["compiled"] = ours_fn(compiled)
        if onednn is not None:
            fns["onednn"] = ours_fn(onednn)
        ms = interleaved_ms(fns, args.repeats)
        best = ms.get("compiled", ms["eager"])
        comp = f"{ms['compiled']:.2f}" if "compiled" in ms else "-"
        extra = f" {ms['onednn']:.2f} | {ms['onednn'] / best:.2f} |" if "onednn" in ms else ""
        print(
            f"| {shape} | {n} | {ms['eager']:.2f} | {comp} | {ms['hf']:.2f} | "
            f"{ms['hf'] / best:.2f} | {best / roofline_ms:.2f} |{extra}"
        )

    for n in args.tokens:
        ids = torch.randint(0, vocab, (n,), device=device)
        row(
            "prefill",
            n,
            AttentionMetadata.for_prefill([n], device),
            ids,
            lambda ids=ids: hf(ids[None]).logits,
        )

    ctx = args.context
    verify_steps: dict[int, tuple[AttentionMetadata, torch.Tensor]] = {}
    for shape in ("decode", "verify"):
        for n in args.tokens:
            num_seqs, new = (n, 1) if shape == "decode" else (1, n)
            prompt = torch.randint(0, vocab, (num_seqs, ctx), device=device)
            step = torch.randint(0, vocab, (num_seqs, new), device=device)
            # The engine's paged KV cache, one block table per sequence.
            blocks_per_seq = -(-(ctx + new) // 16)
            cache = PagedKVCache(
                attention_layer_shapes(ours),
                num_seqs * blocks_per_seq,
                16,
                config.torch_dtype,
                device,
            )
            tables = torch.arange(num_seqs * blocks_per_seq, device=device).view(num_seqs, -1)
            pos = torch.arange(ctx, device=device)
            prefill = AttentionMetadata.for_prefill([ctx] * num_seqs, device)
            prefill.kv_cache, prefill.block_tables = cache, tables
            prefill.slot_mapping = (tables[:, pos // 16] * 16 + pos % 16).flatten()
            with attention_context(prefill):
                ours(prompt.flatten(), prefill.positions)
            new_pos = torch.arange(ctx, ctx + new, device=device)
            meta = AttentionMetadata(
                [i * new for i in range(num_seqs + 1)],
                [ctx + new] * num_seqs,
                new_pos.repeat(num_seqs),
                cache,
                slot_mapping=(tables[:, new_pos // 16] * 16 + new_pos % 16).flatten(),
                block_tables=tables,
            )
            past = DynamicCache()
            hf(prompt, past_key_values=past, use_cache=True)

            def hf_step(step=step, past=past, new=new) -> torch.Tensor:
                logits = hf(step, past_key_values=past, use_cache=True).logits
                past.crop(-new)  # every step sees the same context
                return logits

            label = f"{shape} (ctx {ctx})"
            row(label, n, meta, step.flatten(), hf_step)
            if shape == "verify":
                verify_steps[n] = (meta, step.flatten())

    # The verification cost ratio, with every token count's step timed in turns in one
    # loop (the rows above time each shape apart, so machine drift enters their ratios).
    best_fn = compiled if compiled is not None else eager
    if 1 in verify_steps and len(verify_steps) > 1:
        fns: dict[str, Callable[[], object]] = {}
        for n, (meta, ids) in verify_steps.items():

            def run(meta=meta, ids=ids) -> object:
                with attention_context(meta):
                    out = best_fn(ids, meta.positions)
                sync()
                return out

            fns[str(n)] = run
        ms = interleaved_ms(fns, 3 * args.repeats)
        kind = "compiled" if compiled is not None else "eager"
        print(f"\nverification against a one-token step ({kind}, ctx {ctx}, interleaved):\n")
        print("| tokens | step (ms) | / one token |")
        print("|---:|---:|---:|")
        for n in verify_steps:
            print(f"| {n} | {ms[str(n)]:.2f} | {ms[str(n)] / ms['1']:.2f} |")


if __name__ == "__main__":
    main()
