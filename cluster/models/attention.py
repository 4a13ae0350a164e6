"""Attention over flattened sequences, behind a small KV-cache interface.

A batch is the concatenation of several sequences' new tokens.
`AttentionMetadata.query_start_loc` marks where each sequence's tokens start and
`seq_lens` gives each sequence's full context length after this step. A KV cache
implements `attend`: store this step's keys and values, then attend each new
token over its sequence's context. `ContiguousKVCache` keeps one contiguous row
per sequence slot; the engine's `PagedKVCache` (cluster/worker/kv_cache.py) uses
blocks. Without a cache, every sequence is computed from scratch.

The step's metadata reaches the attention layers through `attention_context`, not
through the model's arguments: the model's forward then only takes tensors, so a
compiled forward (cluster/models/compiled.py) is one graph per token count, with
attention as one opaque op (`cluster::attention`) that reads the metadata when it
runs. A batch may carry padding rows after its `num_tokens` real ones (a compiled
forward pads to its bucket): they get zeros and write no KV.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from cluster.kernels.library import define_op
from cluster.kernels.paged_attention import causal_attention


class KVCache(Protocol):
    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


class KVShape(NamedTuple):
    """One attention layer's slice of the KV cache on this rank."""

    num_kv_heads: int
    head_dim: int
    # MLA: the values are the keys' vectors (latents), so the cache stores them once.
    values_are_keys: bool = False


@runtime_checkable
class AttentionLayer(Protocol):
    """A module whose keys and values live in the engine's KV cache: the worker sizes one
    cache tensor pair per such layer, found by `layer_idx`."""

    layer_idx: int

    @property
    def kv_shape(self) -> KVShape: ...


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]  # [num_seqs + 1] prefix sums of new tokens per sequence
    seq_lens: list[int]  # [num_seqs] context length (cached + new) per sequence
    positions: torch.Tensor  # [num_tokens] position of every new token
    kv_cache: KVCache | None = None
    slot_mapping: torch.Tensor | None = None  # [num_tokens] cache slot of each token (paged)
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] (paged)
    # [num_tokens] int64 draft-tree masks: which of its sequence's new tokens each token
    # sees (`cluster.kernels.paged_attention`); None: causal attention everywhere.
    tree_bits: torch.Tensor | None = None
    tree_starts: list[int] | None = None  # [num_seqs] first key the bits describe
    # Recurrent layers' states for this step (`cluster.models.gated_delta.StepStates`);
    # None: every sequence's recurrent state starts from zeros and is not kept.
    recurrent: Any = None
    # Values derived from the fields above, computed once per step (see `cached`).
    derived: dict[str, Any] = field(default_factory=dict, repr=False)

    def cached(self, name: str, make: Callable[[], Any]) -> Any:
        """`make()` the first time `name` is asked for, then the same value: every layer of
        a step shares what only depends on the step (the fields must not change after)."""
        if name not in self.derived:
            self.derived[name] = make()
        return self.derived[name]

    @staticmethod
    def for_prefill(seq_lens: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for whole sequences computed from scratch (no cache)."""
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        positions = torch.cat([torch.arange(n) for n in seq_lens]).to(device)
        return AttentionMetadata(starts, list(seq_lens), positions)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_lens(self) -> list[int]:
        return [self.query_start_loc[i + 1] - self.query_start_loc[i] for i in range(self.num_seqs)]


def attention_per_sequence(
    q: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    context: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Each sequence's new queries over the keys/values `context(i)` returns for it."""
    out = torch.empty_like(q)
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if end > start:
            seq_k, seq_v = context(i)
            out[start:end] = causal_attention(q[start:end], seq_k, seq_v, scale)
    return out


# The metadata of the forward running in this thread (or task): set by `attention_context`.
_CURRENT_METADATA: ContextVar[AttentionMetadata | None] = ContextVar(
    "cluster_attention_metadata", default=None
)


@contextmanager
def attention_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Every attention layer run inside this block uses `meta` (this step's batch)."""
    token = _CURRENT_METADATA.set(meta)
    try:
        yield meta
    finally:
        _CURRENT_METADATA.reset(token)


def current_metadata() -> AttentionMetadata:
    """The metadata of the enclosing `attention_context`."""
    meta = _CURRENT_METADATA.get()
    if meta is None:
        raise RuntimeError("attention ran outside attention_context(meta)")
    return meta


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    meta = current_metadata()
    n, num_rows = meta.num_tokens, q.shape[0]  # a compiled forward pads to its bucket
    if num_rows > n:
        q, k, v = q[:n], k[:n], v[:n]
    if meta.kv_cache is not None:
        out = meta.kv_cache.attend(layer_idx, q, k, v, meta, scale)
    elif meta.tree_bits is not None:
        raise ValueError("draft-tree attention needs a paged KV cache")
    else:
        starts = meta.query_start_loc
        out = attention_per_sequence(
            q, meta, scale, lambda i: (k[starts[i] : starts[i + 1]], v[starts[i] : starts[i + 1]])
        )
    out = out.reshape(n, -1)
    if num_rows > n:
        out = torch.cat([out, out.new_zeros(num_rows - n, out.shape[1])])
    return out


def _attend_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


# Opaque to the compiler, and never inside a captured CUDA graph: it reads the step's
# metadata on the host each time it runs (inductor partitions the graph around it).
define_op(
    "attention(Tensor q, Tensor k, Tensor v, SymInt layer_idx, float scale) -> Tensor",
    _attend,
    _attend_fake,
    tags=(torch.Tag.cudagraph_unsafe,),
)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context, for the
    batch of the enclosing `attention_context`.

    q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim] (this step's);
    returns [num_tokens, heads * head_dim]. Under torch.compile this is one opaque op.
    """
    if torch.compiler.is_compiling():
        return torch.ops.cluster.attention(q, k, v, layer_idx, scale)
    return _attend(q, k, v, layer_idx, scale)
