"""Manifests: Serve config files (`serve run` / `serve deploy` accept them as they are)
whose application has `import_path: cluster.serve:build_app`. Ray Serve LLM's shape
(`args.llm_configs`, under its import path or ours) is read as ours
(`serve_llm_config.py`), so `cluster serve` takes a Ray Serve LLM manifest as it is.

`load_manifest` checks everything that needs no model and no cluster: the Serve schema,
our `args` (unknown keys, k = 0, ...), and the `deployments:` overrides (known names and
keys; the engine's placement is set in `args.placement`, never in `ray_actor_options` or
`placement_group_*`, which would break the replica-in-bundle-0 layout). `check_model`
adds the checks that read the checkpoint. All of it runs before any actor starts.

Importing this module imports no Ray (Serve's schema is read only when a manifest is
validated for serving), so `read_manifest_args` serves the offline `LLM.from_manifest`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

import yaml
from pydantic import ValidationError

from cluster.serve.args import LLM_DEPLOYMENT, ClusterArgs
from cluster.serve.serve_llm_config import (
    RAY_SERVE_LLM_IMPORT_PATHS,
    from_serve_llm,
    is_serve_llm_args,
)

IMPORT_PATH = "cluster.serve:build_app"
# Before the routes moved into LLMServer, a separate deployment served HTTP.
FORMER_INGRESS_DEPLOYMENT = "OpenAIIngress"
_ENGINE_OWNED = ("ray_actor_options", "placement_group_bundles", "placement_group_strategy")


class ManifestError(ValueError):
    """A manifest that cannot be deployed; the message says where and why."""


@dataclass(frozen=True)
class Manifest:
    path: str
    app_name: str
    route_prefix: str
    raw_args: dict[str, Any]
    args: ClusterArgs
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    http_options: dict[str, Any] = field(default_factory=dict)

    def with_args(self, **updates: Any) -> Manifest:
        """A copy with `args` sections deep-merged with `updates` (None removes a key)."""
        merged = _merge(copy.deepcopy(self.raw_args), updates)
        return replace(self, raw_args=merged, args=_validate_args(merged, self.path))

    def with_deployment(self, name: str, **options: Any) -> Manifest:
        deployments = {k: dict(v) for k, v in self.deployments.items()}
        deployments.setdefault(name, {}).update(options)
        _check_deployment(name, deployments[name], self.path)
        return replace(self, deployments=deployments)

    def check_model(self) -> ClusterArgs:
        """The model checks (reads config.json); raises ManifestError."""
        from cluster.serve.builder import prepare_args

        try:
            return prepare_args(self.args)
        except ValueError as e:
            raise ManifestError(f"{self.path}: {e}") from None


def _merge(base: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    for key, value in updates.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def _validate_args(raw: dict[str, Any], path: str) -> ClusterArgs:
    try:
        return ClusterArgs.model_validate(raw)
    except ValidationError as e:
        raise ManifestError(f"{path}: invalid args:\n{e}") from None


def _check_deployment(name: str, options: dict[str, Any], path: str) -> None:
    from ray.serve.schema import DeploymentSchema

    if name == FORMER_INGRESS_DEPLOYMENT:
        raise ManifestError(
            f"{path}: there is no {name} deployment any more: {LLM_DEPLOYMENT} replicas serve "
            f"the OpenAI routes themselves; remove its entry (or move its options to "
            f"{LLM_DEPLOYMENT})"
        )
    if name != LLM_DEPLOYMENT:
        raise ManifestError(
            f"{path}: unknown deployment {name!r} (this app has one: {LLM_DEPLOYMENT})"
        )
    unknown = sorted(set(options) - set(DeploymentSchema.model_fields))
    if unknown:
        raise ManifestError(f"{path}: deployment {name}: unknown keys {unknown}")
    owned = sorted(set(options) & set(_ENGINE_OWNED))
    if name == LLM_DEPLOYMENT and owned:
        raise ManifestError(
            f"{path}: deployment {name}: {owned} are derived from args.parallel and "
            "args.placement (one bundle per rank, the replica in bundle 0); set those instead"
        )


def parse_manifest(config: dict[str, Any], path: str = "<manifest>") -> Manifest:
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as e:
        raise ManifestError(f"{path}: not a valid Serve config:\n{e}") from None
    app = _our_application(config, path)
    raw_args = app.get("args") or {}
    deployments: dict[str, dict[str, Any]] = {}
    if is_serve_llm_args(raw_args):  # Ray Serve LLM's shape: read as ours
        try:
            raw_args, options = from_serve_llm(raw_args)
        except ValueError as e:
            raise ManifestError(f"{path}: {e}") from None
        if options:
            deployments[LLM_DEPLOYMENT] = options
    for entry in app.get("deployments") or []:
        options = {
            **deployments.get(entry["name"], {}),
            **{k: v for k, v in entry.items() if k != "name"},
        }
        deployments[entry["name"]] = options
    for name, options in deployments.items():
        _check_deployment(name, options, path)
    return Manifest(
        path=path,
        app_name=app.get("name", "default"),
        route_prefix=app.get("route_prefix", "/"),
        raw_args=raw_args,
        args=_validate_args(raw_args, path),
        deployments=deployments,
        http_options=dict(config.get("http_options") or {}),
    )


def _our_application(config: dict[str, Any], path: str) -> dict[str, Any]:
    ours = (IMPORT_PATH, *RAY_SERVE_LLM_IMPORT_PATHS)
    apps = [a for a in config.get("applications") or [] if a.get("import_path") in ours]
    if len(apps) != 1:
        raise ManifestError(
            f"{path}: expected exactly one application with import_path {IMPORT_PATH!r}, "
            f"found {len(apps)}"
        )
    return apps[0]


def _read_yaml(path: str) -> dict[str, Any]:
    with open(path) as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict):
        raise ManifestError(f"{path}: expected a YAML mapping with 'applications'")
    return config


def load_manifest(path: str) -> Manifest:
    return parse_manifest(_read_yaml(path), path)


def read_manifest_args(path: str) -> ClusterArgs:
    """Only the application's `args`, validated, without Ray (for the offline engine)."""
    raw = _our_application(_read_yaml(path), path).get("args") or {}
    if is_serve_llm_args(raw):
        try:
            raw = from_serve_llm(raw)[0]
        except ValueError as e:
            raise ManifestError(f"{path}: {e}") from None
    return _validate_args(raw, path)


def validate_manifest(path: str) -> tuple[Manifest, bool]:
    """Load and check a manifest; the model checks run when its folder is here.
    Returns the manifest and whether the model was checked."""
    manifest = load_manifest(path)
    present = manifest.args.model_is_present()
    if present:
        manifest.check_model()
    return manifest, present


def deployment_plan(manifest: Manifest) -> dict[str, Any]:
    """What a deploy would ask Ray for (printed by `cluster serve --dry-run`)."""
    from cluster.serve.builder import deployment_options

    args = manifest.args
    if args.model.device == "auto":  # resolved at deploy time; shown as on a CPU cluster
        args = args.with_device("cpu")
    options = deployment_options(args, manifest.deployments.get(LLM_DEPLOYMENT))
    return {
        "app": manifest.app_name,
        "route_prefix": manifest.route_prefix,
        "model": args.served_model_name,
        "device": manifest.args.model.device,
        "tensor_parallel_size": args.parallel.tensor_parallel_size,
        "speculative": args.speculative,
        "llm_server": {k: v for k, v in options.items() if k != "name"},
    }
