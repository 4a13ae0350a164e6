"""`cluster serve MODEL [flags]`: vLLM's `vllm serve` flags for what we support, turned
into the Serve manifest they mean (`--print-manifest` prints it), so `vllm serve X ...`
works with `vllm` replaced by `cluster`, and the manifest is there to keep and edit.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import yaml

from cluster.serve.manifest import IMPORT_PATH, LLM_DEPLOYMENT, Manifest, parse_manifest

DEFAULT_PORT = 8000  # vLLM's


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's names (and short forms) for the settings a manifest holds."""
    add = parser.add_argument
    add("--revision", help="branch, tag or commit of a Hugging Face id")
    add("--served-model-name", help="the model name clients send (default: MODEL as given)")
    add("--tensor-parallel-size", "-tp", type=int, default=1)
    add("--pipeline-parallel-size", "-pp", type=int, default=1)
    add(
        "--enable-expert-parallel",
        "-ep",
        action="store_true",
        help="MoE models: whole experts spread over the TP ranks (expert_parallel_size = TP)",
    )
    add("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    add("--max-model-len", type=int, help="default: the model's max_position_embeddings")
    add("--max-num-seqs", type=int, help="sequences batched at once")
    add("--speculative-config", type=json.loads, help="JSON, vLLM's keys (docs/speculative.md)")
    add("--api-key", help="Bearer key every route but /health and /metrics needs")
    add(
        "--enable-auto-tool-choice", action="store_true", help='tool_choice "auto" (needs a parser)'
    )
    add("--tool-call-parser", choices=["hermes"], help="reads tool calls out of the model's text")
    add("--num-replicas", type=int, default=1)
    add("--print-manifest", action="store_true", help="print the manifest and stop")


def model_flags_given(flags: argparse.Namespace) -> list[str]:
    """The model flags set to other than their defaults (`--tensor-parallel-size`, ...)."""
    probe = argparse.ArgumentParser()
    add_model_flags(probe)
    defaults = vars(probe.parse_args([]))
    return [
        f"--{name.replace('_', '-')}"
        for name, default in defaults.items()
        if getattr(flags, name, default) != default
    ]


def manifest_config(model: str, flags: argparse.Namespace) -> dict[str, Any]:
    """The Serve config `cluster serve MODEL` deploys."""
    model_args: dict[str, Any] = {"path": model, "dtype": flags.dtype}
    for key in ("revision", "max_model_len"):
        if getattr(flags, key) is not None:
            model_args[key] = getattr(flags, key)
    if flags.served_model_name:
        model_args["id"] = flags.served_model_name
    args: dict[str, Any] = {
        "model": model_args,
        "parallel": {
            "tensor_parallel_size": flags.tensor_parallel_size,
            "pipeline_parallel_size": flags.pipeline_parallel_size,
        },
    }
    if flags.enable_expert_parallel:
        args["parallel"]["expert_parallel_size"] = flags.tensor_parallel_size
    if flags.max_num_seqs is not None:
        args["scheduler"] = {"max_num_seqs": flags.max_num_seqs}
    if flags.speculative_config:
        args["speculative"] = flags.speculative_config
    server = {
        "api_key": flags.api_key,
        "enable_auto_tool_choice": flags.enable_auto_tool_choice or None,
        "tool_call_parser": flags.tool_call_parser,
    }
    if any(v is not None for v in server.values()):
        args["server"] = {k: v for k, v in server.items() if v is not None}
    return {
        "http_options": {"host": flags.host or "127.0.0.1", "port": flags.port or DEFAULT_PORT},
        "applications": [
            {
                "name": "cluster",
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": args,
                "deployments": [{"name": LLM_DEPLOYMENT, "num_replicas": flags.num_replicas}],
            }
        ],
    }


def manifest_for_model(model: str, flags: argparse.Namespace) -> Manifest:
    """Validated like a manifest file (a ManifestError names what is wrong)."""
    return parse_manifest(manifest_config(model, flags), f"cluster serve {model}")


def manifest_yaml(model: str, flags: argparse.Namespace) -> str:
    return yaml.safe_dump(manifest_config(model, flags), sort_keys=False)
