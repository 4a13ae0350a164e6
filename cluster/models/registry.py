"""Maps Hugging Face `architectures` names to our model classes."""

from __future__ import annotations

from typing import Any

from torch import nn

from cluster.models.llama import LlamaForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class_for(hf_config: Any) -> type[nn.Module]:
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    raise ValueError(
        f"architectures={names} are not supported (supported: {supported_architectures()})"
    )
