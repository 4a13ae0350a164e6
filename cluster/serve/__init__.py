"""Ray Serve: the `LLMServer` deployment (one engine per replica), the OpenAI-compatible
ingress, manifests and the `build_app` builder they import (`cluster.serve:build_app`).

Names load on first use, so that reading a manifest's args (`cluster.serve.manifest`,
`cluster.serve.args`) imports no Ray.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ChatMessage": "protocol",
    "ClusterArgs": "args",
    "GenerateOutput": "protocol",
    "GenerateRequest": "protocol",
    "LLMServer": "server",
    "Manifest": "manifest",
    "ManifestError": "manifest",
    "ModelArgs": "args",
    "ServerArgs": "args",
    "build_app": "builder",
    "build_openai_app": "builder",
    "load_manifest": "manifest",
    "validate_manifest": "manifest",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cluster.serve' has no attribute {name!r}")
    return getattr(import_module(f"cluster.serve.{_EXPORTS[name]}"), name)
