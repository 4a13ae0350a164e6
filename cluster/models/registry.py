"""Maps Hugging Face `architectures` names to our model classes: the names and their
modules come from `cluster.config.architectures` (written once, there); a class is
imported when a model of its architecture is built."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from cluster.config.architectures import TARGET_ARCHITECTURES, architecture_of


def supported_architectures() -> list[str]:
    return sorted(TARGET_ARCHITECTURES)


def model_class(name: str) -> type[nn.Module]:
    """The model class of a served architecture name (KeyError for others)."""
    module = importlib.import_module(f"cluster.models.{TARGET_ARCHITECTURES[name]}")
    return getattr(module, name)


def model_class_for(hf_config: Any) -> type[nn.Module]:
    return model_class(architecture_of(hf_config))
