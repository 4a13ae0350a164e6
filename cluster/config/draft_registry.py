"""Draft methods and the one table of them.

A speculative method (EAGLE, EAGLE-3, MTP, a draft model, n-gram lookup, or one of your
own) is one `DraftMethod` subclass in one file of `cluster/methods/`, registered by one
line of that package's table. The class says everything that differs between methods:

- configuration: its name and other spellings, where its draft's weights come from, the
  checkpoint layouts ("kinds") it loads and how to recognise them, and its checks against
  the target;
- execution: which target layers the model runner must capture, whether the draft keeps
  KV in the target's cache, its own cache or none, how its draft loads and its proposer;
- training: its trainer, if it has one.

The engine, the worker and `cluster train-draft` ask this table; none of them names a
method. This module is configuration (it imports nothing above it); the table is filled
by `cluster.methods`, which `import cluster` imports. A test or a plug-in registers its
own method with `register_draft_method` (and `registered_draft_method` for a scope).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

from cluster.config.checkpoints import checkpoint_tensor_shapes

DraftSource = Literal["model", "target", "none"]
DraftKV = Literal["target", "own", "none"]


class DraftMethod:
    """One speculative method. Subclasses set the class attributes and override what
    differs; the defaults describe a method whose draft needs nothing from the target."""

    name: ClassVar[str] = ""
    # Other spellings accepted as `speculative.method` (vLLM's, for one).
    aliases: ClassVar[tuple[str, ...]] = ()
    # Where the draft's weights are: "model" (`speculative.model`, required), "target"
    # (`speculative.model`, else the target's own checkpoint), "none" (no weights).
    draft_source: ClassVar[DraftSource] = "model"
    # The draft's attention KV: in the target's paged cache ("target": a head whose
    # layers get layer indices after the target's), in a cache of its own with the same
    # block table ("own": a separate LM), or none. A draft with KV runs passes ahead of
    # the step, so the scheduler reserves `num_speculative_tokens` slots of lookahead.
    kv_cache: ClassVar[DraftKV] = "target"
    # Checkpoint layouts this method loads; `detect` names one of them.
    kinds: ClassVar[tuple[str, ...]] = ()
    # Tried after every other method when a checkpoint's method is detected.
    detect_last: ClassVar[bool] = False

    def detect(self, tensor_names: set[str], architectures: str) -> str | None:
        """The kind of draft a checkpoint holds, if it is this method's (None if not)."""
        return None

    def check(self, spec: Any) -> None:
        """Method-specific checks of a `SpeculativeConfig` (raise ValueError)."""

    def check_target(self, kind: str, draft_config: dict[str, Any], target_config: Any) -> None:
        """Checks of a draft checkpoint's `config.json` against the target's (ValueError)."""

    def target_layers(self, target_config: Any) -> tuple[int, ...]:
        """Target layers whose outputs the draft reads (captured by the model runner);
        () means the draft reads the target's final hidden states."""
        return ()

    def load_draft(self, spec: Any, model_config: Any, target: Any, state: Any) -> Any:
        """The draft module for `target` on the last pipeline stage (None when it has no
        weights)."""
        return None

    def make_proposer(
        self, spec: Any, draft: Any, kv_cache: Any, block_size: int, compile_options: Any
    ) -> Any:
        """The proposer (`cluster.spec_decode.batch.Proposer`): `kv_cache` is the target's
        cache for kv_cache="target", the draft's own for "own", None for "none"."""
        raise NotImplementedError(f"draft method {self.name!r} has no proposer")

    @property
    def trainable(self) -> bool:
        return type(self).train is not DraftMethod.train

    def train(self, data: Any) -> dict[str, Any]:
        """Train this method's draft (`cluster.train.pipeline.TrainInputs`); its history."""
        raise ValueError(f"draft method {self.name!r} has no trainer")


# The registry: every process fills it the same way when `cluster` is imported (built-in
# methods) and tests add to it only inside `registered_draft_method`.
_REGISTRY: dict[str, DraftMethod] = {}


def register_draft_method(method: DraftMethod) -> None:
    """Add `method` to the table (ValueError if its name or an alias is taken)."""
    if not method.name:
        raise ValueError(f"{type(method).__name__} has no name")
    for name in (method.name, *method.aliases):
        if name in _REGISTRY or any(name in m.aliases for m in _REGISTRY.values()):
            raise ValueError(f"draft method {name!r} is registered already")
    _REGISTRY[method.name] = method


def unregister_draft_method(name: str) -> None:
    _REGISTRY.pop(name, None)


@contextlib.contextmanager
def registered_draft_method(method: DraftMethod) -> Iterator[DraftMethod]:
    """`method` registered for the `with` block only."""
    register_draft_method(method)
    try:
        yield method
    finally:
        unregister_draft_method(method.name)


def draft_methods() -> tuple[DraftMethod, ...]:
    """Every registered method, in registration order."""
    return tuple(_REGISTRY.values())


def canonical_method_name(name: str) -> str:
    """`name` or the method it is an alias of; ValueError naming speculative.method."""
    for method in _REGISTRY.values():
        if name == method.name or name in method.aliases:
            return method.name
    known = sorted(n for m in _REGISTRY.values() for n in (m.name, *m.aliases))
    raise ValueError(f"speculative.method={name!r} is not a draft method (known: {known})")


def draft_method(name: str) -> DraftMethod:
    """The registered method called `name` (or one of its aliases)."""
    return _REGISTRY[canonical_method_name(name)]


def read_draft_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def detect_draft(path: str) -> tuple[DraftMethod, str]:
    """(method, kind) of the draft checkpoint at `path`, from its tensor names and its
    `architectures` (no weights are read)."""
    names = set(checkpoint_tensor_shapes(path))
    archs = " ".join(read_draft_config(path).get("architectures") or [])
    ordered = sorted(_REGISTRY.values(), key=lambda m: m.detect_last)
    for method in ordered:
        kind = method.detect(names, archs)
        if kind is not None:
            return method, kind
    raise ValueError(f"no draft method recognises the checkpoint at {path!r}")
