"""Maps Hugging Face `architectures` names to our model classes."""

from __future__ import annotations

from typing import Any

from torch import nn

from cluster.config.architectures import architecture_of
from cluster.models.deepseek import DeepseekV3ForCausalLM
from cluster.models.llama import LlamaForCausalLM
from cluster.models.qwen import (
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)
from cluster.models.qwen3_next import Qwen3NextForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class_for(hf_config: Any) -> type[nn.Module]:
    return _ARCHITECTURES[architecture_of(hf_config)]
