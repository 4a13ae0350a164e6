"""`cluster demo`: the default deployment, end to end, in a few minutes on a laptop.

Starts a local Ray, deploys `cluster/manifests/default.yaml` (SmolLM2-135M-Instruct with its
shipped EAGLE-3 head), streams a few chat answers through the Serve handle, then deploys
the same manifest with speculation off, sends the same prompts, and prints a table:
tokens/s with and without speculation, acceptance rate, mean acceptance length and
per-position acceptance.

It prints its own progress, the answers and the table; Ray's and Serve's logs appear at
WARNING and above (all of them, and the actors' output, with `verbose`).
"""

from __future__ import annotations

import logging
import os
import time

from cluster.sampling_params import SamplingParams

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain what a GPU is in one sentence.",
]


def default_manifest_path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "manifests", "default.yaml")


def _run_prompts(handle, prompts: list[str], max_new_tokens: int, show: bool) -> tuple[int, float]:
    """(generated tokens, seconds) for the prompts, one at a time (batch 1), streamed."""
    from cluster.serve.protocol import ChatMessage, GenerateRequest

    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        request = GenerateRequest(
            messages=[ChatMessage(role="user", content=prompt)], sampling_params=params, stream=True
        )
        if show:
            print(f"\n>>> {prompt}\n", end="", flush=True)
        start = time.perf_counter()
        last = None
        for chunk in handle.options(stream=True).generate.remote(request):
            last = chunk
            if show:
                print(chunk.text, end="", flush=True)
        seconds += time.perf_counter() - start
        tokens += last.num_output_tokens if last is not None else 0
        if show:
            print()
    return tokens, seconds


def run_demo(
    max_new_tokens: int = 64,
    prompts: list[str] | None = None,
    manifest_path: str | None = None,
    verbose: bool = False,
) -> None:
    import ray
    from ray import serve

    from cluster.serve.launch import deploy, start_local_ray
    from cluster.serve.manifest import load_manifest

    prompts = prompts or DEMO_PROMPTS
    path = manifest_path or default_manifest_path()
    manifest = load_manifest(path)
    level = logging.INFO if verbose else logging.WARNING
    print(f"starting a local Ray for {os.path.relpath(path)}", flush=True)
    start_local_ray(
        logging_level=level,
        log_to_driver=verbose,
        include_dashboard=verbose,
    )
    logging.getLogger("ray.serve").setLevel(level)
    rows = []
    port = None
    try:
        for label, m in (("on", manifest), ("off", manifest.with_args(speculative=None))):
            compiling = os.environ.get("CLUSTER_COMPILE", "auto") != "off"
            note = (
                " (the first start compiles the model's forward: 1-2 minutes on 2 cores)"
                if compiling
                else ""
            )
            print(f"deploying the engine with speculation {label}{note}", flush=True)
            start = time.perf_counter()
            _, url = deploy(m, port=port)
            port = int(url.rsplit(":", 1)[1].split("/")[0])  # the second app reuses it
            print(f"ready in {time.perf_counter() - start:.0f} s", flush=True)
            handle = serve.get_deployment_handle("LLMServer", app_name=m.app_name)
            _run_prompts(handle, prompts[:1], 4, show=False)  # warm-up
            tokens, seconds = _run_prompts(handle, prompts, max_new_tokens, show=label == "on")
            spec = handle.stats.remote().result()["metrics"]["spec_decode"]
            rows.append((label, tokens / seconds, spec))
            serve.delete(m.app_name)
    finally:
        ray.shutdown()  # this process started Ray: stopping it stops Serve with it
    method = (manifest.args.speculative or {}).get("method", "-")
    print(f"\nspeculation: {manifest.args.speculative}\n")
    print(
        "| speculation | tokens/s (batch 1) | speedup | acceptance rate | mean acceptance length | per-position acceptance |"
    )
    print("|---|---:|---:|---:|---:|---|")
    base = rows[-1][1]
    for label, tps, spec in rows:
        if label == "on":
            per_pos = ", ".join(f"{a:.2f}" for a in spec["acceptance_per_position"])
            print(
                f"| on ({method}) | {tps:.1f} | {tps / base:.2f}x | {spec['acceptance_rate']:.2f} "
                f"| {spec['mean_acceptance_length']:.2f} | {per_pos} |"
            )
        else:
            print(f"| off | {tps:.1f} | 1.00x | - | - | - |")
