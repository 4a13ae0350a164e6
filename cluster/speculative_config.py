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

import ast
import json
import os
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.architectures import RECURRENT_ARCHITECTURES
from cluster.checkpoints import checkpoint_tensor_shapes
from cluster.draft_tree import max_tree_nodes
from cluster.hub import is_hub_id, resolve_model_path

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
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram window when neither end is given

# vLLM's speculative_config keys and values that mean what one of ours means, so a vLLM
# config works as it is (docs/speculative.md has the table). Keys vLLM has and we do not
# are refused by name, as any unknown key is.
VLLM_METHODS = {"deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp", "[ngram]": "ngram"}
VLLM_DRAFT_SAMPLE_METHODS = {"greedy": "greedy", "probabilistic": "sample"}


def from_vllm(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with vLLM's spellings turned into ours (a ValueError names a bad value)."""
    data = dict(data)
    method = data.get("method")
    if isinstance(method, str) and method in VLLM_METHODS:
        data["method"] = VLLM_METHODS[method]
    if "draft_sample_method" in data:
        value = data.pop("draft_sample_method")
        if value not in VLLM_DRAFT_SAMPLE_METHODS:
            raise ValueError(
                f"speculative.draft_sample_method={value!r}: one of "
                f"{sorted(VLLM_DRAFT_SAMPLE_METHODS)}"
            )
        data["draft_sampling"] = VLLM_DRAFT_SAMPLE_METHODS[value]
    if "speculative_token_tree" in data:
        tree = data.pop("speculative_token_tree")
        if isinstance(tree, str):
            try:
                tree = ast.literal_eval(tree)
            except (ValueError, SyntaxError) as e:
                raise ValueError(
                    f"speculative.speculative_token_tree={tree!r} is not a list of tuples"
                ) from e
        data["tree"] = {"paths": tree}
    if data.get("draft_tensor_parallel_size") in (None, 1):
        data.pop("draft_tensor_parallel_size", None)  # the draft runs on the last rank
    return data


def builtin_head_path(name: str) -> str:
    """A draft head shipped inside the package (`cluster/heads/<name>`)."""
    return os.path.join(os.path.dirname(__file__), "heads", name)


# A draft tree's root and nodes (target verification) and fed nodes (drafting) each need a
# bit of one int64 attention mask.
MAX_TREE_NODES = 62


class TreeConfig(BaseModel):
    """Tree drafting (`cluster/spec_decode/tree_drafting.py`); depth is
    `num_speculative_tokens`.

    Dynamic (EAGLE-2): `topk` children per expanded node, the `topk` best nodes of each
    depth expanded, the `num_nodes` best candidates verified. Bounds: 1 <= num_nodes <=
    topk + (depth - 1) * topk**2 (the candidates made) and <= 62, and (depth - 1) * topk
    <= 62 (the nodes fed). Static: `paths`, each node as the draft ranks along its path
    from the root ([0] the best first draft, [0, 1] its second-best child); every prefix of
    a path is a node, the ranks below a node are 0..m-1, at most 62 nodes, no path longer
    than the depth. topk=1 with num_nodes=depth is the chain.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    topk: int = Field(default=1, ge=1, le=16)
    num_nodes: int | None = Field(default=None, ge=1, le=MAX_TREE_NODES)
    paths: tuple[tuple[int, ...], ...] | None = None

    @model_validator(mode="after")
    def _check(self) -> TreeConfig:
        if (self.num_nodes is None) == (self.paths is None):
            raise ValueError(
                "speculative.tree needs num_nodes (dynamic) or paths (static), not both"
            )
        if self.paths is not None:
            nodes = set(self.paths)
            if not self.paths or len(nodes) != len(self.paths) or len(nodes) > MAX_TREE_NODES:
                raise ValueError(
                    f"speculative.tree.paths must be 1..{MAX_TREE_NODES} distinct paths"
                )
            for path in self.paths:
                if not path or min(path) < 0:
                    raise ValueError(
                        f"speculative.tree.paths: {list(path)} is not a path of ranks >= 0"
                    )
                if len(path) > 1 and path[:-1] not in nodes:
                    raise ValueError(
                        f"speculative.tree.paths: {list(path)} has no parent {list(path[:-1])}"
                    )
            for parent in {(), *nodes}:
                ranks = sorted(p[-1] for p in nodes if p[:-1] == parent)
                if ranks != list(range(len(ranks))):
                    raise ValueError(
                        f"speculative.tree.paths: the children of {list(parent)} have ranks "
                        f"{ranks}; they must be 0..{len(ranks) - 1}"
                    )
        return self

    def depth_of_paths(self) -> int:
        return max(len(p) for p in self.paths or ())

    def num_fed(self, depth: int) -> int:
        """Nodes fed to the draft while growing a tree (each takes a scratch KV slot)."""
        if self.paths is not None:
            return len({p[:-1] for p in self.paths if len(p) > 1})
        return (depth - 1) * self.topk

    @property
    def size(self) -> int:
        """Nodes verified per step."""
        return len(self.paths) if self.paths is not None else int(self.num_nodes or 0)


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    method: Method | None = None
    # The draft checkpoint folder; for "mtp" it defaults to the target's own checkpoint.
    model: str | None = None
    num_speculative_tokens: int = Field(ge=1, le=64)
    # n-gram window: the longest suffix of this many tokens that re-occurs is matched.
    # vLLM's defaults: 5 and 5 when neither is given, the given one when one is.
    prompt_lookup_min: int = Field(default=None, ge=1)  # type: ignore[assignment]
    prompt_lookup_max: int = Field(default=None, ge=1)  # type: ignore[assignment]
    # "sample": requests with temperature > 0 draw their drafts from the draft distribution
    # and hand it to the rejection sampler (better acceptance at high temperature);
    # "greedy": drafts are the draft's argmax, verified as delta distributions (vLLM's way).
    draft_sampling: Literal["greedy", "sample"] = "greedy"
    # Adapt the number of drafts per step (0..num_speculative_tokens, 0 = off) to measured
    # goodput for each batch size (`cluster/engine/spec_controller.py`); lossless either way.
    adaptive: bool = False
    # Draft trees instead of chains (EAGLE-2 style); None: a chain of drafts.
    tree: TreeConfig | None = None
    # Hybrid drafting (`cluster/spec_decode/hybrid.py`): with a draft model, a request whose
    # last `hybrid_lookup_min` or more tokens (up to prompt_lookup_max) occurred earlier in
    # its context drafts by n-gram lookup that step, the model elsewhere. None: off.
    hybrid_lookup_min: int | None = Field(default=None, ge=1)
    # Per-request draft count: a request's chain of drafts ends where the draft model's own
    # probability of the chain so far falls below this (`cluster/spec_decode/chain.py`).
    # None: always num_speculative_tokens (or the adaptive controller's k).
    min_draft_confidence: float | None = Field(default=None, gt=0, lt=1)

    @model_validator(mode="before")
    @classmethod
    def _resolve_vllm_and_builtin(cls, data: Any) -> Any:
        """vLLM's keys and values (`VLLM_ALIASES`), the n-gram window's defaults, and
        `model: "builtin:<name>"`, a head shipped with the package."""
        if not isinstance(data, dict):
            return data
        data = from_vllm(data)
        lookup_min, lookup_max = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
        data["prompt_lookup_min"] = lookup_min or lookup_max or DEFAULT_PROMPT_LOOKUP
        data["prompt_lookup_max"] = lookup_max or lookup_min or DEFAULT_PROMPT_LOOKUP
        model = data.get("model")
        if isinstance(model, str) and model != "ngram" and is_hub_id(model):
            data["model"] = model = resolve_model_path(model, data.pop("revision", None))
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
        if self.tree is not None:
            self._check_tree(self.tree)
        if self.hybrid_lookup_min is not None:
            self._check_hybrid(self.hybrid_lookup_min)
        if self.min_draft_confidence is not None:
            if self.resolved_method == "ngram":
                raise ValueError(
                    "speculative.min_draft_confidence needs a draft model (lookup drafts "
                    "have no probabilities)"
                )
            if self.tree is not None:
                raise ValueError(
                    "speculative.min_draft_confidence applies to chains; a tree has its own "
                    "budget (tree.num_nodes)"
                )
        return self

    def _check_hybrid(self, min_match: int) -> None:
        if self.resolved_method == "ngram":
            raise ValueError(
                "speculative.hybrid_lookup_min needs a draft model (method='ngram' is lookup only)"
            )
        if self.tree is not None:
            raise ValueError(
                "speculative.hybrid_lookup_min and speculative.tree cannot be combined"
            )
        if min_match > self.prompt_lookup_max:
            raise ValueError(
                f"speculative.hybrid_lookup_min={min_match} must not exceed "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )

    def _check_tree(self, tree: TreeConfig) -> None:
        k = self.num_speculative_tokens
        if self.resolved_method == "ngram":
            raise ValueError("speculative.tree needs a draft model (n-gram lookup drafts chains)")
        if self.adaptive:
            raise ValueError("speculative.tree and speculative.adaptive cannot be combined yet")
        if tree.paths is not None and tree.depth_of_paths() > k:
            raise ValueError(
                f"speculative.tree.paths go {tree.depth_of_paths()} deep, deeper than "
                f"num_speculative_tokens={k}"
            )
        if tree.num_nodes is not None:
            made = max_tree_nodes(tree.topk, k)
            if tree.num_nodes > made:
                raise ValueError(
                    f"speculative.tree.num_nodes={tree.num_nodes} exceeds the {made} candidates "
                    f"topk={tree.topk} makes over depth {k} (topk + (depth - 1) * topk**2)"
                )
        if tree.num_fed(k) > MAX_TREE_NODES:
            raise ValueError(
                f"speculative.tree feeds {tree.num_fed(k)} nodes to the draft per step; at most "
                f"{MAX_TREE_NODES} (lower topk or num_speculative_tokens)"
            )

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
