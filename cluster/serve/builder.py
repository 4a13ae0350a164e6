"""`build_app(args)`: the manifest's `import_path` target (`cluster.serve:build_app`).

Validates `args` completely before anything starts: the schema (unknown keys, k = 0,
placement) and, through the engine's own config, the model (TP dividing the heads,
context length, KV room). Only then does it return the Serve application: one
deployment, `LLMServer` (one engine per replica), which serves the OpenAI routes itself
(HTTP proxy -> replica) and answers handle calls (`generate`, `stats`, ...).

Each replica gets one placement-group bundle per rank (`placement_group_bundles`), its
own CPUs merged into bundle 0, with the manifest's strategy (PACK by default). Serve
creates and removes a replica's placement group with the replica, so scaling up or down
adds or frees all of its ranks at once. An `autoscaling_config` scales on the engine's
sequences and KV usage (`autoscaling.py`).
"""

from __future__ import annotations

from typing import Any, Literal

import ray
from ray import serve
from ray.serve import Application

from cluster.serve.args import LLM_DEPLOYMENT, ClusterArgs
from cluster.serve.autoscaling import autoscaling_options
from cluster.serve.openai_app import make_server_class
from cluster.serve.server import LLMServer

# An engine that failed to load will not load on the 20th try (Serve's default) either.
MAX_CONSTRUCTOR_RETRIES = 3
# How long a replica being replaced (a redeploy, scaling down) may drain its in-flight
# requests before Serve stops it: long enough for a long answer to finish streaming
# (Serve's own default, 20 s, cut streams mid-answer). A manifest's `deployments:` entry
# overrides it.
DRAIN_TIMEOUT_S = 600.0


def resolve_device(args: ClusterArgs) -> Literal["cpu", "cuda"]:
    """`auto` is cuda when the Ray cluster (or, without Ray, this machine) has GPUs."""
    if args.model.device != "auto":
        return args.model.device
    if ray.is_initialized():
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def prepare_args(args: ClusterArgs | dict[str, Any]) -> ClusterArgs:
    """Validated args with the device resolved; raises ValueError on a bad manifest."""
    args = ClusterArgs.model_validate(args)
    args = args.with_device(resolve_device(args))
    args.engine_config()  # model checks: heads vs TP, max_model_len, KV room, the draft
    return args


def llm_deployment_options(args: ClusterArgs) -> dict[str, Any]:
    placement = args.placement_config()
    return {
        "name": LLM_DEPLOYMENT,
        "ray_actor_options": {"num_cpus": placement.replica_cpus},
        "placement_group_bundles": placement.bundles(args.parallel.world_size),
        "placement_group_strategy": placement.strategy,
        "max_ongoing_requests": 2 * args.scheduler.max_num_seqs,
        "max_constructor_retry_count": MAX_CONSTRUCTOR_RETRIES,
        "graceful_shutdown_timeout_s": DRAIN_TIMEOUT_S,
    }


def deployment_options(args: ClusterArgs, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """Our options for the deployment, then the manifest's (`overrides`); an
    `autoscaling_config` gets the LLM policy and target unless it names its own."""
    options = {**llm_deployment_options(args), **(overrides or {})}
    if isinstance(options.get("autoscaling_config"), dict):
        options["autoscaling_config"] = autoscaling_options(
            options["autoscaling_config"], args.scheduler.max_num_seqs
        )
    return options


def llm_app(
    args: ClusterArgs, overrides: dict[str, Any] | None = None, http: bool = True
) -> Application:
    """The `LLMServer` deployment with `overrides` applied to its options; with `http`,
    serving the OpenAI routes too."""
    options = deployment_options(args, overrides)
    cls = make_server_class() if http else LLMServer
    return serve.deployment(cls).options(**options).bind(args)


def build_openai_app(
    args: ClusterArgs | dict[str, Any],
    deployment_overrides: dict[str, dict[str, Any]] | None = None,
) -> Application:
    """The OpenAI-serving `LLMServer` app; `deployment_overrides` maps the deployment's
    name to `.options()` values (what a manifest's `deployments:` section holds)."""
    args = prepare_args(args)
    return llm_app(args, (deployment_overrides or {}).get(LLM_DEPLOYMENT))


def build_app(args: ClusterArgs) -> Application:
    """Serve builder (`import_path: cluster.serve:build_app`)."""
    return build_openai_app(args)
