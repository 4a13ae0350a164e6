"""Shared set-up for the tests that start Ray: a small local instance, and ways to see
which of our actors are alive and to wait for conditions with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import ray

from cluster.actors import ACTOR_NAMESPACE
from cluster.config import engine_config_from_args
from cluster.serve.launch import start_local_ray

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def init_local_ray(num_cpus: float = 2, proxy: bool = False, **kwargs: Any) -> None:
    """A local Ray without the dashboard, with a small object store and quiet workers, and
    the HTTP ingress `cluster serve` gives it (HAProxy where this Ray has it), or Serve's
    Python proxy with `proxy`."""
    with pytest.MonkeyPatch.context() as env:  # this process's environment is kept
        if proxy:
            env.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
        start_local_ray(
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=200 * 2**20,
            log_to_driver=False,
            **kwargs,
        )


def engine_actor_names(prefix: str = "cluster-") -> list[str]:
    """Names of our live named actors (schedulers and workers)."""
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == ACTOR_NAMESPACE and a["name"].startswith(prefix)
    )


def wait_for(
    condition: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.2
) -> Any:
    """Poll until `condition()` is truthy; its value, or AssertionError after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def speculation_supported(model_path: str) -> bool:
    """Whether this build's engine accepts `speculative_config` (it is landing separately)."""
    try:
        engine_config_from_args(model_path, speculative_config=NGRAM)
    except (ValueError, TypeError, NotImplementedError):
        return False
    return True


def build_llm_app(args: Any) -> Any:
    """Only the `LLMServer` deployment of `args` (the handle API, no HTTP routes)."""
    from cluster.serve.builder import llm_app, prepare_args

    return llm_app(prepare_args(args), http=False)
