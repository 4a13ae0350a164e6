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
from cluster.serve.prefix_router import ROUTER_PATH, ROUTING_STATS_PERIOD_S
from cluster.serve.route_server import ROUTE_DEPLOYMENT, make_route_server_class
from cluster.serve.server import LLMServer, http_ingress

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


def routes_by_prefix(args: ClusterArgs, haproxy: bool) -> bool:
    """Whether HTTP requests go to the replica caching their prefix (`server.request_router`);
    `haproxy`: whether Serve runs its HAProxy ingress, the only one that asks a router."""
    mode = args.server.request_router
    if mode == "prefix" and not haproxy:
        raise ValueError(
            "server.request_router=prefix needs Serve's HAProxy ingress "
            "(RAY_SERVE_ENABLE_HA_PROXY=1 where Ray starts); use auto or least_loaded"
        )
    caching = args.engine_config().prefix_caching
    return mode == "prefix" or (mode == "auto" and haproxy and caching)


def deployment_options(
    args: ClusterArgs, overrides: dict[str, Any] | None, prefix_routing: bool = False
) -> dict[str, Any]:
    """Our options for the deployment, then the manifest's (`overrides`); an
    `autoscaling_config` gets the LLM policy and target unless it names its own, and
    `prefix_routing` sets the prefix-aware request router unless the manifest set one."""
    options = {**llm_deployment_options(args), **(overrides or {})}
    if isinstance(options.get("autoscaling_config"), dict):
        options["autoscaling_config"] = autoscaling_options(
            options["autoscaling_config"], args.scheduler.max_num_seqs
        )
    if prefix_routing and "request_router_config" not in options:
        options["request_router_config"] = {
            "request_router_class": ROUTER_PATH,
            "request_router_kwargs": {
                "block_size": args.cache.block_size,
                "max_imbalance": args.server.prefix_max_imbalance,
            },
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
        }
    return options


def llm_app(
    args: ClusterArgs,
    overrides: dict[str, Any] | None = None,
    http: bool = True,
    haproxy: bool = False,
) -> Application:
    """The `LLMServer` deployment with `overrides` applied to its options; with `http`,
    serving the OpenAI routes too, and behind `haproxy` with the prefix route server
    attached when `server.request_router` asks for it."""
    prefix_routing = http and routes_by_prefix(args, haproxy)
    options = deployment_options(args, overrides, prefix_routing)
    cls = make_server_class() if http else LLMServer
    app = serve.deployment(cls).options(**options).bind(args)
    if not prefix_routing:
        return app
    router = serve.deployment(make_route_server_class()).options(
        name=ROUTE_DEPLOYMENT,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1000,  # it answers in about a millisecond; never the bottleneck
    )
    return app._with_ingress_request_router(router.bind(app, args))


def build_openai_app(
    args: ClusterArgs | dict[str, Any],
    deployment_overrides: dict[str, dict[str, Any]] | None = None,
    haproxy: bool | None = None,
) -> Application:
    """The OpenAI-serving `LLMServer` app; `deployment_overrides` maps the deployment's
    name to `.options()` values (what a manifest's `deployments:` section holds);
    `haproxy`: whether Serve runs HAProxy (None: as this process's Serve reads it)."""
    args = prepare_args(args)
    if haproxy is None:
        haproxy = http_ingress() == "haproxy"
    return llm_app(args, (deployment_overrides or {}).get(LLM_DEPLOYMENT), haproxy=haproxy)


def build_app(args: ClusterArgs) -> Application:
    """Serve builder (`import_path: cluster.serve:build_app`); run by Serve where the
    cluster runs, so its HAProxy switch is the one this process reads."""
    return build_openai_app(args)
