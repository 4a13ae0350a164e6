"""`cluster plan MODEL [layout flags]`: will this model and layout fit, read from its
`config.json` (and the safetensors index, when there is one) without loading a weight.

Prints `cluster.models.memory_plan`'s table per pipeline stage and exits 1 when the
layout does not fit. The flags are `vllm serve`'s names.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1}


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="a local folder, a config.json file, or a Hugging Face id (config only)"
    )
    parser.add_argument("--revision", help="branch, tag or commit of a Hugging Face id")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    parser.add_argument(
        "--expert-parallel-size",
        type=int,
        default=1,
        help="1 (every rank holds a slice of every expert) or the TP size (whole experts "
        "spread over the TP ranks); the bytes per rank are the same",
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *DTYPE_BYTES])
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="plan an FP8 checkpoint's weights dequantised to --dtype (the path of GPUs "
        "without FP8 compute) instead of kept as FP8",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="memory of one GPU (default: this machine's first CUDA device, else 80)",
    )
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--speculative-config",
        help="JSON; num_speculative_tokens sizes the step, method 'mtp' adds the MTP layers",
    )


def _read_config(model: str, revision: str | None) -> tuple[Any, int | None]:
    """(the transformers config, the checkpoint's size from its safetensors index)."""
    from transformers import AutoConfig

    from cluster.config.hub import is_hub_id

    if os.path.isfile(model):
        path = model
    elif os.path.isdir(model):
        path = os.path.join(model, "config.json")
    elif is_hub_id(model):
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(model, "config.json", revision=revision)
    else:
        raise SystemExit(f"error: {model!r} is neither a folder, a file nor a Hugging Face id")
    with open(path) as f:
        fields = json.load(f)
    index = os.path.join(os.path.dirname(path), "model.safetensors.index.json")
    total = None
    if os.path.isfile(index):
        with open(index) as f:
            total = (json.load(f).get("metadata") or {}).get("total_size")
    return AutoConfig.for_model(**fields), total


def run_plan(args: argparse.Namespace) -> None:
    import torch

    from cluster.models.fp8 import block_size_of
    from cluster.models.memory_plan import GIB, memory_plan

    config, checkpoint_bytes = _read_config(args.model, args.revision)
    tp, ep = args.tensor_parallel_size, args.expert_parallel_size
    if ep not in (1, tp):
        raise SystemExit(f"error: --expert-parallel-size={ep} must be 1 or the TP size ({tp})")
    dtype = args.dtype
    if dtype == "auto":
        dtype = str(getattr(config, "dtype", None) or "bfloat16").removeprefix("torch.")
        dtype = dtype if dtype in ("float16", "bfloat16") else "bfloat16"
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    memory_gib = args.gpu_memory_gib
    note = ""
    if memory_gib is None:
        if torch.cuda.is_available():
            memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB
        else:
            memory_gib, note = 80.0, " (no GPU here: give --gpu-memory-gib)"
    spec = json.loads(args.speculative_config) if args.speculative_config else {}
    mtp_layers = 0
    if spec.get("method") in ("mtp", "deepseek_mtp", "qwen3_next_mtp"):
        mtp_layers = int(
            getattr(config, "num_nextn_predict_layers", None)
            or getattr(config, "mtp_num_hidden_layers", None)
            or 1
        )
    fp8_block = None if args.dequantize else block_size_of(config)
    plan = memory_plan(
        config,
        tp,
        args.pipeline_parallel_size,
        budget_bytes=int(memory_gib * GIB * args.gpu_memory_utilization),
        dtype_bytes=DTYPE_BYTES[dtype],
        fp8_block=fp8_block,
        kv_dtype_bytes=DTYPE_BYTES[kv_dtype],
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_speculative_tokens=int(spec.get("num_speculative_tokens", 0)),
        mtp_layers=mtp_layers,
        dtype_name=dtype,
        kv_dtype_name=kv_dtype,
    )
    print(
        f"GPU memory {memory_gib:.1f} GiB{note} x gpu_memory_utilization "
        f"{args.gpu_memory_utilization}"
    )
    if checkpoint_bytes:
        print(f"checkpoint (safetensors index): {checkpoint_bytes / GIB:.1f} GiB in all")
    print(plan.table())
    if not plan.fits:
        raise SystemExit(1)
