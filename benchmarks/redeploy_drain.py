"""A redeploy during a long stream: does the answer finish? Serve replaces a replica by
starting the new one, then stopping the old one after at most the deployment's
`graceful_shutdown_timeout_s` of draining. `cluster` sets 600 s by default (Serve's own
default is 20 s); this script runs both.

For each drain timeout (`--timeouts`, "default" = ours), it deploys a small random model
(local Ray, CPU), opens one stream of `--tokens` tokens and, after a few seconds, redeploys
a changed manifest (`scheduler.max_num_seqs` 8 -> 16). Then it prints the tokens the
stream delivered, how it ended, and whether a new request is served afterwards.

    python benchmarks/redeploy_drain.py [--tokens 4000 --timeouts default 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from typing import Any

import openai
import ray
import yaml
from ray import serve

from cluster.models.default_model import ensure_default_model
from cluster.serve import load_manifest
from cluster.serve.launch import deploy, start_local_ray

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from tiny_models import make_tiny_chat_model


def write_manifest(folder: str, model: str, max_num_seqs: int, timeout: str) -> str:
    args = {
        "model": {"path": model, "id": "tiny", "device": "cpu", "dtype": "float32"},
        "placement": {"worker_cpus": 0.25, "threads_per_worker": 1},
        "cache": {"num_kv_blocks": 512},
        "scheduler": {"max_num_seqs": max_num_seqs},
    }
    deployment: dict[str, Any] = {"name": "LLMServer"}
    if timeout != "default":
        deployment["graceful_shutdown_timeout_s"] = float(timeout)
    app = {
        "name": "tiny",
        "import_path": "cluster.serve:build_app",
        "args": args,
        "deployments": [deployment],
    }
    path = os.path.join(folder, f"tiny-{max_num_seqs}-{timeout}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"applications": [app]}, f)
    return path


def stream_through_redeploy(folder: str, model: str, tokens: int, timeout: str) -> dict:
    _, url = deploy(load_manifest(write_manifest(folder, model, 8, timeout)))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    seen: dict[str, Any] = {"tokens": None, "finish": None, "end": "running"}

    def read() -> None:
        try:
            stream = client.completions.create(
                model="tiny",
                prompt="go on",
                max_tokens=tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.usage:
                    seen["tokens"] = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].finish_reason:
                    seen["finish"] = chunk.choices[0].finish_reason
            seen["end"] = "[DONE]" if seen["finish"] else "closed without [DONE]"
        except Exception as e:  # the connection cut
            seen["end"] = type(e).__name__

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(3)
    start = time.monotonic()
    deploy(load_manifest(write_manifest(folder, model, 16, timeout)))
    seen["redeploy_s"] = time.monotonic() - start
    reader.join(600)
    retrying = client.with_options(max_retries=3)  # while the ingress picks up the new replica
    after = retrying.completions.create(model="tiny", prompt="hi", max_tokens=4)
    seen["new_request"] = after.usage.completion_tokens == 4
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--timeouts", nargs="+", default=["default", "20"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = os.path.join(folder, "model")
        # slow enough on a CPU that 4000 tokens outlast a redeploy
        make_tiny_chat_model(
            model,
            ensure_default_model(),
            num_hidden_layers=12,
            hidden_size=384,
            intermediate_size=1024,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=args.tokens + 64,
        )
        rows = []
        for timeout in args.timeouts:  # a fresh local Ray each
            start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
            try:
                rows.append((timeout, stream_through_redeploy(folder, model, args.tokens, timeout)))
            finally:
                serve.shutdown()
                ray.shutdown()
    print(f"\none stream of {args.tokens} tokens, redeployed 3 s in\n")
    print(
        "| graceful_shutdown_timeout_s | tokens delivered | finish_reason | stream ended | "
        "redeploy took s | new request served |"
    )
    print("|---|---:|---|---|---:|---|")
    for timeout, seen in rows:
        name = "600 (cluster's default)" if timeout == "default" else timeout
        print(
            f"| {name} | {seen['tokens'] or 'unknown'} | {seen['finish']} | {seen['end']} | "
            f"{seen['redeploy_s']:.1f} | {seen['new_request']} |"
        )


if __name__ == "__main__":
    main()
