"""`SpeculativeConfig`: which draft proposes tokens, and how many per step.

`method` names a registered draft method (`cluster/methods/`: "eagle", "eagle3", "mtp",
"draft_model", "ngram", or vLLM's spellings of them). When it is not given, the method
is the one that recognises the draft checkpoint at `model` by its `architectures` and
the names of its tensors (no weights are read). What differs between methods (checks
against the target, loading, proposing) is the method's; this module holds what all
share: the number of drafts, trees, the n-gram window, hybrid drafting, confidence.
"""

from __future__ import annotations

import ast
import os
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.config.draft_registry import (
    DraftMethod,
    canonical_method_name,
    detect_draft,
    read_draft_config,
)
from cluster.config.draft_registry import (
    draft_method as method_named,
)
from cluster.config.hub import is_hub_id, resolve_model_path
from cluster.draft_tree import max_tree_nodes

BUILTIN_PREFIX = "builtin:"
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram window when neither end is given

# vLLM's speculative_config keys and values that mean what one of ours means, so a vLLM
# config works as it is (docs/speculative.md has the table; vLLM's method names are the
# methods' aliases). Keys vLLM has and we do not are refused by name, as any unknown is.
VLLM_DRAFT_SAMPLE_METHODS = {"greedy": "greedy", "probabilistic": "sample"}


def from_vllm(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with vLLM's spellings turned into ours (a ValueError names a bad value)."""
    data = dict(data)
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
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # cluster/
    return os.path.join(package, "heads", name)


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

    # A registered draft method's name or alias (`cluster.config.draft_registry`); None: the one
    # that recognises the checkpoint at `model`.
    method: str | None = None
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
        if isinstance(data.get("method"), str):
            data["method"] = canonical_method_name(data["method"])
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
        source = method_named(self.method).draft_source if self.method is not None else None
        if source == "none" and self.model not in (None, "ngram"):
            raise ValueError(f"speculative.model must be unset for method={self.method!r}")
        if self.model not in (None, "ngram"):
            if not os.path.isfile(os.path.join(self.model, "config.json")):
                raise ValueError(
                    f"speculative.model={self.model!r} is not a folder with config.json"
                )
            detected, kind = detect_draft(self.model)
            if self.method is not None and self.method != detected.name:
                raise ValueError(
                    f"speculative.method={self.method!r} does not match the draft checkpoint "
                    f"{self.model!r}, which holds a {kind!r} draft"
                )
        elif source == "model":
            raise ValueError(f"speculative.model is required for method={self.method!r}")
        if self.tree is not None:
            self._check_tree(self.tree)
        if self.hybrid_lookup_min is not None:
            self._check_hybrid(self.hybrid_lookup_min)
        if self.min_draft_confidence is not None:
            if not self.has_draft_model:
                raise ValueError(
                    "speculative.min_draft_confidence needs a draft model (lookup drafts "
                    "have no probabilities)"
                )
            if self.tree is not None:
                raise ValueError(
                    "speculative.min_draft_confidence applies to chains; a tree has its own "
                    "budget (tree.num_nodes)"
                )
        self.draft_method.check(self)
        return self

    def _check_hybrid(self, min_match: int) -> None:
        if not self.has_draft_model:
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
        if not self.has_draft_model:
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
    def draft_method(self) -> DraftMethod:
        """The registered method this config runs."""
        if self.method is not None:
            return method_named(self.method)
        return method_named("ngram") if self.model == "ngram" else detect_draft(self.model)[0]

    @property
    def resolved_method(self) -> str:
        return self.draft_method.name

    @property
    def has_draft_model(self) -> bool:
        """Whether drafts come from a model (with probabilities), not from lookup."""
        return self.draft_method.draft_source != "none"

    def draft_path(self, target_path: str) -> str | None:
        """The checkpoint holding the draft weights (None for a method without weights)."""
        if not self.has_draft_model:
            return None
        return self.model or target_path

    def draft_kind_for(self, target_path: str) -> str:
        """The layout of the draft's checkpoint (the method's name when it has none)."""
        path = self.draft_path(target_path)
        return self.resolved_method if path is None else detect_draft(path)[1]

    def check_against_target(self, target_path: str, target_config: Any) -> None:
        """The draft checkpoint is one this method loads and fits the target (ValueError)."""
        path = self.draft_path(target_path)
        if path is None:
            return
        method = self.draft_method
        detected, kind = detect_draft(path)
        if kind not in method.kinds:
            raise ValueError(
                f"speculative.method={method.name!r} but {path!r} has no {method.name!r} "
                f"draft (it holds a {kind!r} draft: use speculative.method={detected.name!r})"
            )
        method.check_target(kind, read_draft_config(path), target_config)
