"""Ray Serve: the `LLMServer` deployment (one engine per replica), the OpenAI-compatible
ingress, manifests and the `build_app` builder they import (`cluster.serve:build_app`)."""

from cluster.serve.args import ClusterArgs, ModelArgs, ServerArgs
from cluster.serve.builder import build_app, build_llm_app, build_openai_app
from cluster.serve.manifest import Manifest, ManifestError, load_manifest, validate_manifest
from cluster.serve.protocol import ChatMessage, GenerateOutput, GenerateRequest
from cluster.serve.server import LLMServer

__all__ = [
    "ChatMessage",
    "ClusterArgs",
    "GenerateOutput",
    "GenerateRequest",
    "LLMServer",
    "Manifest",
    "ManifestError",
    "ModelArgs",
    "ServerArgs",
    "build_app",
    "build_llm_app",
    "build_openai_app",
    "load_manifest",
    "validate_manifest",
]
