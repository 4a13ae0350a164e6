"""`SpeculativeConfig`: which draft proposes tokens, and how many per step.

Methods: "eagle" (EAGLE-1 or the normalised-fusion EAGLE), "eagle3", "mtp" (DeepSeek-
or Qwen3-Next-style heads, usually inside the target checkpoint), "ngram" (prompt
lookup) and "draft_model" (a separate small LM with the same tokenizer). When `method`
is not given it is detected from the draft checkpoint: its `architectures` and the
names of its tensors (safetensors headers or memory-mapped `.bin` files: no weights are
read). A checkpoint with an `fc` over [embedding, hidden] is EAGLE-1, whatever its
`architectures` says (the public EAGLE-1 heads say `LlamaForCausalLM`).
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.architectures import RECURRENT_ARCHITECTURES
from cluster.checkpoints import checkpoint_tensor_shapes

Method = Literal["eagle", "eagle3", "mtp", "ngram", "draft_model"]
DraftKind = Literal[
    "eagle", "eagle_norm_fusion", "eagle3", "mtp_deepseek", "mtp_qwen3_next", "ngram", "draft_model"
]


def _read_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def detect_draft_kind(path: str) -> DraftKind:
    """What kind of draft the checkpoint at `path` holds."""
    names = checkpoint_tensor_shapes(path)
    archs = " ".join(_read_config(path).get("architectures") or [])
    if "Eagle3" in archs or any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if any(n.startswith("mtp.") for n in names):
        return "mtp_qwen3_next"
    if any(".eh_proj." in n and n.startswith("model.layers.") for n in names):
        return "mtp_deepseek"
    if "eh_proj.weight" in names:
        return "eagle_norm_fusion"
    if "fc.weight" in names or "Eagle" in archs:
        return "eagle"
    return "draft_model"


_METHOD_OF_KIND: dict[str, str] = {
    "eagle": "eagle",
    "eagle_norm_fusion": "eagle",
    "eagle3": "eagle3",
    "mtp_deepseek": "mtp",
    "mtp_qwen3_next": "mtp",
    "ngram": "ngram",
    "draft_model": "draft_model",
}


BUILTIN_PREFIX = "builtin:"


def builtin_head_path(name: str) -> str:
    """A draft head shipped inside the package (`cluster/heads/<name>`)."""
    return os.path.join(os.path.dirname(__file__), "heads", name)


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    method: Method | None = None
    # The draft checkpoint folder; for "mtp" it defaults to the target's own checkpoint.
    model: str | None = None
    num_speculative_tokens: int = Field(ge=1, le=64)
    # n-gram window: the longest suffix of this many tokens that re-occurs is matched.
    prompt_lookup_min: int = Field(default=1, ge=1)
    prompt_lookup_max: int = Field(default=4, ge=1)
    # "sample": requests with temperature > 0 draw their drafts from the draft distribution
    # and hand it to the rejection sampler (better acceptance at high temperature);
    # "greedy": drafts are the draft's argmax, verified as delta distributions (vLLM's way).
    draft_sampling: Literal["greedy", "sample"] = "greedy"
    # Adapt the number of drafts per step (0..num_speculative_tokens, 0 = off) to measured
    # goodput for each batch size (`cluster/engine/spec_controller.py`); lossless either way.
    adaptive: bool = False

    @model_validator(mode="before")
    @classmethod
    def _resolve_builtin(cls, data: Any) -> Any:
        """`model: "builtin:<name>"` names a head shipped with the package."""
        model = data.get("model") if isinstance(data, dict) else None
        if isinstance(model, str) and model.startswith(BUILTIN_PREFIX):
            path = builtin_head_path(model[len(BUILTIN_PREFIX) :])
            if not os.path.isdir(path):
                shipped = (
                    sorted(os.listdir(os.path.dirname(path)))
                    if os.path.isdir(os.path.dirname(path))
                    else []
                )
                raise ValueError(
                    f"speculative.model={model!r}: no such shipped head (shipped: {shipped})"
                )
            data = {**data, "model": path}
        return data

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative.prompt_lookup_min={self.prompt_lookup_min} must not exceed "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.method is None and self.model is None:
            raise ValueError("speculative.method or speculative.model is required")
        if self.method == "ngram" and self.model not in (None, "ngram"):
            raise ValueError("speculative.model must be unset for method='ngram'")
        if self.model not in (None, "ngram"):
            if not os.path.isfile(os.path.join(self.model, "config.json")):
                raise ValueError(
                    f"speculative.model={self.model!r} is not a folder with config.json"
                )
            if self.method is not None and self.method != _METHOD_OF_KIND[self.draft_kind]:
                raise ValueError(
                    f"speculative.method={self.method!r} does not match the draft checkpoint "
                    f"{self.model!r}, which holds a {self.draft_kind!r} draft"
                )
        elif self.method in ("eagle", "eagle3", "draft_model"):
            raise ValueError(f"speculative.model is required for method={self.method!r}")
        return self

    @cached_property
    def draft_kind(self) -> DraftKind:
        if self.model in (None, "ngram"):
            if self.method == "mtp":
                raise ValueError("the MTP draft kind needs the target path: use draft_kind_for")
            return "ngram"
        return detect_draft_kind(self.model)

    @property
    def resolved_method(self) -> str:
        if self.method is not None:
            return self.method
        return "ngram" if self.model == "ngram" else _METHOD_OF_KIND[self.draft_kind]

    def draft_path(self, target_path: str) -> str | None:
        """The checkpoint holding the draft weights (None for n-gram)."""
        if self.resolved_method == "ngram":
            return None
        return self.model or target_path

    def draft_kind_for(self, target_path: str) -> DraftKind:
        path = self.draft_path(target_path)
        return "ngram" if path is None else detect_draft_kind(path)

    def check_against_target(self, target_path: str, target_config: Any) -> None:
        """Hidden sizes, vocabularies and heads compatible with the target (raises ValueError)."""
        path = self.draft_path(target_path)
        if path is None:
            return
        kind = self.draft_kind_for(target_path)
        method = self.resolved_method
        if method == "mtp" and not kind.startswith("mtp"):
            raise ValueError(f"speculative.method='mtp' but {path!r} has no MTP heads")
        if method != "mtp" and kind.startswith("mtp"):
            raise ValueError(f"{path!r} holds MTP heads; use speculative.method='mtp'")
        draft = _read_config(path)
        hidden = int(target_config.hidden_size)
        vocab = int(target_config.vocab_size)
        if kind in ("eagle", "eagle_norm_fusion", "eagle3"):
            if int(draft["hidden_size"]) != hidden:
                raise ValueError(
                    f"the draft's hidden_size={draft['hidden_size']} differs from the target's "
                    f"hidden_size={hidden}"
                )
            if int(draft.get("target_hidden_size") or hidden) != hidden:
                raise ValueError(
                    f"the draft expects target_hidden_size={draft['target_hidden_size']}, the "
                    f"target has {hidden}"
                )
        if kind == "draft_model" and set(draft.get("architectures") or []) & set(
            RECURRENT_ARCHITECTURES
        ):
            raise ValueError(
                f"the draft model {path!r} has recurrent layers; a draft LM must be "
                "attention-only (its states are not kept per verified token)"
            )
        if kind == "eagle3" and int(draft.get("draft_vocab_size") or vocab) > vocab:
            raise ValueError("the draft vocabulary is larger than the target's")
        if (
            kind in ("eagle", "eagle_norm_fusion", "draft_model")
            and int(draft["vocab_size"]) != vocab
        ):
            raise ValueError(
                f"the draft's vocab_size={draft['vocab_size']} differs from the target's "
                f"vocab_size={vocab} (the draft must share the target's tokenizer)"
            )
