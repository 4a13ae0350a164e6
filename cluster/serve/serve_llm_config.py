"""Ray Serve LLM's manifest shape, read as ours: an application whose `args` hold
`llm_configs` (one `LLMConfig`: `model_loading_config`, `engine_kwargs`,
`deployment_config`), under Ray Serve LLM's import path or ours. Every field we support
maps onto our `args` and the LLMServer deployment's options; any other field is an error
that names it (never ignored).
"""

from __future__ import annotations

from typing import Any

from cluster.config import FLAT_ENGINE_ARGS as ENGINE_ARGS  # (section, field) per flat name

RAY_SERVE_LLM_IMPORT_PATHS = (
    "ray.serve.llm:build_openai_app",
    "ray.serve.llm:build_llm_deployment",
)
_LLM_CONFIG_KEYS = {
    "model_loading_config",
    "engine_kwargs",
    "deployment_config",
    "log_engine_metrics",
}
_MODEL_LOADING_KEYS = {"model_id", "model_source"}
# vLLM engine_kwargs we take besides our flat engine arguments
_ENGINE_KWARGS_EXTRA = {"speculative_config", "seed", "served_model_name"}


def is_serve_llm_args(args: dict[str, Any]) -> bool:
    return isinstance(args, dict) and "llm_configs" in args


def from_serve_llm(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(our `args`, the LLMServer deployment's options) for Ray Serve LLM `args`; a
    ValueError names every field we do not support."""
    extra = sorted(set(args) - {"llm_configs"})
    configs = args["llm_configs"]
    if extra:
        raise ValueError(f"args: {extra} are not supported beside llm_configs")
    if not isinstance(configs, list) or len(configs) != 1 or not isinstance(configs[0], dict):
        raise ValueError("args.llm_configs: one model per application here (a list of one)")
    config = configs[0]
    _refuse("llm_configs[0]", set(config) - _LLM_CONFIG_KEYS)
    loading = config.get("model_loading_config") or {}
    _refuse("model_loading_config", set(loading) - _MODEL_LOADING_KEYS)
    source = loading.get("model_source", loading.get("model_id"))
    if not isinstance(source, str):
        raise ValueError("model_loading_config.model_source: a local folder or Hugging Face id")
    ours: dict[str, Any] = {"model": {"path": source}}
    if loading.get("model_id"):
        ours["model"]["id"] = loading["model_id"]
    engine = dict(config.get("engine_kwargs") or {})
    _refuse("engine_kwargs", set(engine) - set(ENGINE_ARGS) - _ENGINE_KWARGS_EXTRA)
    if "served_model_name" in engine:
        ours["model"]["id"] = engine.pop("served_model_name")
    if "speculative_config" in engine:
        ours["speculative"] = engine.pop("speculative_config")
    if "seed" in engine:
        ours["seed"] = engine.pop("seed")
    for name, value in engine.items():
        section, field = ENGINE_ARGS[name]
        ours.setdefault(section, {})[field] = value
    return ours, dict(config.get("deployment_config") or {})


def _refuse(where: str, keys: set[str]) -> None:
    if keys:
        raise ValueError(f"{where}: {sorted(keys)} not supported by cluster")
