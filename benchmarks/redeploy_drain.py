"""A redeploy during a long stream: does the answer finish? Serve replaces a replica by
starting the new one, then stopping the old one after at most the deployment's
`graceful_shutdown_timeout_s` of draining. `cluster` sets 600 s by default (Serve's own
default is 20 s); this script runs both.

For each drain timeout (`--timeouts`, "default" = ours), it deploys a small random model
(local Ray, CPU), opens `--streams` streams of `--tokens` tokens and, after a few seconds,
redeploys a changed manifest (`scheduler.max_num_seqs` 8 -> 16). With `--default-model`
it deploys the default manifest instead (SmolLM2 with its EAGLE-3 head; each replica's
worker on 0.9 CPU and one thread, so the old and the new replica fit on 2 cores) and the
change is the issue's: `num_speculative_tokens` 3 -> 2, under 12 chat streams of 120
tokens. Then it prints, per timeout, the tokens the streams delivered, how they ended, and
whether a new request is served afterwards.

    python benchmarks/redeploy_drain.py [--tokens 4000 --timeouts default 20]
    python benchmarks/redeploy_drain.py --default-model --streams 12 --tokens 120 --timeouts default
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

from cluster.demo import default_manifest_path
from cluster.models.default_model import ensure_default_model
from cluster.serve import Manifest, load_manifest
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


def default_manifests(timeout: str) -> tuple[Manifest, Manifest]:
    """The default manifest with small replicas, before and after the redeploy (k 3 -> 2)."""
    manifest = load_manifest(default_manifest_path()).with_args(
        placement={"worker_cpus": 0.9, "threads_per_worker": 1}
    )
    if timeout != "default":
        manifest = manifest.with_deployment("LLMServer", graceful_shutdown_timeout_s=float(timeout))
    return manifest, manifest.with_args(speculative={"num_speculative_tokens": 2})


def stream_through_redeploy(
    before: Manifest, after: Manifest, tokens: int, streams: int, chat: bool
) -> dict:
    _, url = deploy(before)
    model = before.args.served_model_name
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    seen: list[dict[str, Any]] = [
        {"tokens": None, "finish": None, "end": "running"} for _ in range(streams)
    ]

    def read(i: int) -> None:
        extra = {"stream": True, "stream_options": {"include_usage": True}}
        extra["extra_body"] = {"ignore_eos": True}
        try:
            if chat:
                prompt = f"Write a long story about a lighthouse keeper, part {i + 1}."
                stream = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=tokens,
                    **extra,
                )
            else:
                stream = client.completions.create(
                    model=model, prompt="go on", max_tokens=tokens, **extra
                )
            for chunk in stream:
                if chunk.usage:
                    seen[i]["tokens"] = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].finish_reason:
                    seen[i]["finish"] = chunk.choices[0].finish_reason
            seen[i]["end"] = "[DONE]" if seen[i]["finish"] else "closed without [DONE]"
        except Exception as e:  # the connection cut
            seen[i]["end"] = type(e).__name__
        seen[i]["ended_at"] = time.monotonic()

    readers = [threading.Thread(target=read, args=(i,)) for i in range(streams)]
    for reader in readers:
        reader.start()
    time.sleep(3)
    start = time.monotonic()
    deploy(after)
    redeploy_s = time.monotonic() - start  # Serve reports the new version running
    for reader in readers:
        reader.join(900)
    retrying = client.with_options(max_retries=3)  # while the ingress picks up the new replica
    new = retrying.completions.create(model=model, prompt="hi", max_tokens=4)
    return {
        "tokens": [x["tokens"] for x in seen],
        "finish": sorted({str(x["finish"]) for x in seen}),
        "ends": {e: sum(x["end"] == e for x in seen) for e in {x["end"] for x in seen}},
        "redeploy_s": redeploy_s,
        "open_at_redeploy": sum(x["ended_at"] > start for x in seen),
        "last_end_s": max(x["ended_at"] for x in seen) - start,
        "new_request": new.usage.completion_tokens == 4,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--timeouts", nargs="+", default=["default", "20"])
    parser.add_argument(
        "--default-model", action="store_true", help="the default manifest, k 3 -> 2"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = os.path.join(folder, "model")
        if not args.default_model:
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
            if args.default_model:
                before, after = default_manifests(timeout)
            else:
                before = load_manifest(write_manifest(folder, model, 8, timeout))
                after = load_manifest(write_manifest(folder, model, 16, timeout))
            start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
            try:
                seen = stream_through_redeploy(
                    before, after, args.tokens, args.streams, args.default_model
                )
                rows.append((timeout, seen))
            finally:
                serve.shutdown()
                ray.shutdown()
    what = "the default manifest, k 3 -> 2" if args.default_model else "a tiny model"
    print(f"\n{args.streams} stream(s) of {args.tokens} tokens, {what}, redeployed 3 s in\n")
    print(
        "| graceful_shutdown_timeout_s | tokens delivered per stream | finish_reason | "
        "streams ended | open when the redeploy began | last one ended (s after it began) | "
        "redeploy took s | new request served |"
    )
    print("|---|---|---|---|---:|---:|---:|---|")
    for timeout, seen in rows:
        name = "600 (cluster's default)" if timeout == "default" else timeout
        tokens = ", ".join(str(t) for t in sorted(seen["tokens"], key=str))
        ends = ", ".join(f"{n} {e}" for e, n in sorted(seen["ends"].items()))
        print(
            f"| {name} | {tokens} | {', '.join(seen['finish'])} | {ends} | "
            f"{seen['open_at_redeploy']} | {seen['last_end_s']:.1f} | "
            f"{seen['redeploy_s']:.1f} | {seen['new_request']} |"
        )


if __name__ == "__main__":
    main()
