"""Gated DeltaNet (Qwen3-Next's linear attention) over flattened sequences: the short
causal convolution, then the gated delta rule's recurrence, each sequence starting from
its own saved state.

Per layer and sequence the state is (a) the convolution's last `kernel - 1` inputs,
`[kernel - 1, conv_dim]`, and (b) the recurrent matrix per value head,
`[heads, head_k_dim, head_v_dim]` in float32. Token t updates the recurrent state S as

    S = S * exp(g_t)                       (decay; g_t <= 0)
    S = S + k_t (beta_t * (v_t - k_t^T S))^T   (delta rule with rate beta_t)
    o_t = q_t^T S

with q and k L2-normalised and q scaled by head_k_dim ** -0.5: transformers'
`torch_recurrent_gated_delta_rule`, token by token. This file is the torch reference and
the CPU path; the sequences of a step run side by side (padded to the longest), so a decode
step is one iteration whatever the batch. Long runs of tokens after which no state is kept
(most of a prefill) take the equivalent chunked form instead
(`cluster.models.gated_delta_chunked`), several times faster.

States live outside the model (`cluster.worker.state_cache`). The step's `StepStates`
(in `AttentionMetadata.recurrent`) gives each sequence's starting state and takes the
states after its last few tokens: a speculative step verifies k + 1 tokens, and the next
step resumes from the state after the last accepted one. Without it (no cache), every
sequence starts from zeros and nothing is kept.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from cluster.kernels.library import define_op
from cluster.models.attention import AttentionMetadata, current_metadata
from cluster.models.gated_delta_chunked import chunked_delta_rule

# Shorter runs of columns with no kept state stay token by token: little to gain there (on
# CPU the chunked form already wins from a few tokens), and short steps keep the reference.
MIN_CHUNKED_TOKENS = 16


class RecurrentShape(NamedTuple):
    """One recurrent layer's state on this rank."""

    conv_dim: int
    kernel: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int


@runtime_checkable
class RecurrentLayer(Protocol):
    """A module whose per-request state lives in the engine's recurrent state cache: the
    worker sizes one state pair per such layer, found by `layer_idx`."""

    layer_idx: int

    @property
    def recurrent_shape(self) -> RecurrentShape: ...


class StepStates(Protocol):
    """One step's view of the recurrent state cache (see `cluster.worker.state_cache`)."""

    def read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([num_seqs, kernel - 1, conv_dim], [num_seqs, heads, dk, dv]) starting states."""
        ...

    def snapshot_index(self) -> torch.Tensor:
        """[num_seqs, max_len] where the state after each token is kept (-1: not kept)."""
        ...

    def write(
        self,
        layer_idx: int,
        seqs: torch.Tensor,
        index: torch.Tensor,
        conv: torch.Tensor,
        recurrent: torch.Tensor,
    ) -> None:
        """Keep the states after one token of each sequence in `seqs` at `index`."""
        ...


class _Layout:
    """The step's sequences as a padded [num_seqs, max_len] grid of token rows."""

    def __init__(self, meta: AttentionMetadata, device: torch.device) -> None:
        lens = meta.query_lens()
        self.num_seqs, self.max_len = len(lens), max(lens)
        starts = torch.tensor(meta.query_start_loc[:-1], device=device)
        offsets = torch.arange(self.max_len, device=device)
        self.valid = offsets[None, :] < torch.tensor(lens, device=device)[:, None]
        # [num_seqs, max_len] row of each (sequence, offset); padding points at row 0
        self.rows = torch.where(self.valid, starts[:, None] + offsets[None, :], 0)
        self.flat = self.rows[self.valid]  # [num_tokens] in grid order


def _spans(kept: list[bool], chunk_size: int | None) -> list[tuple[int, int, bool]]:
    """The grid's columns as consecutive (start, end, chunked) spans: chunked for each run
    of at least `MIN_CHUNKED_TOKENS` columns in which no state is kept."""
    min_run = MIN_CHUNKED_TOKENS if chunk_size else len(kept) + 1
    spans: list[tuple[int, int, bool]] = []
    start = run = 0  # start of the current token-by-token span; unkept columns before t
    for t, is_kept in enumerate([*kept, True]):
        if not is_kept:
            run += 1
            continue
        if run >= min_run:
            if t - run > start:
                spans.append((start, t - run, False))
            spans.append((t - run, t, True))
            start = t
        run = 0
    if start < len(kept):
        spans.append((start, len(kept), False))
    return spans


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_ref(
    mixed_qkv: torch.Tensor,  # [num_tokens, conv_dim]: q, k, v of every head, before the conv
    g: torch.Tensor,  # [num_tokens, heads] float32 log decay
    beta: torch.Tensor,  # [num_tokens, heads]
    conv_weight: torch.Tensor,  # [conv_dim, kernel]
    layer_idx: int,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    chunk_size: int | None = 32,
) -> torch.Tensor:
    """[num_tokens, heads, head_v_dim]: every sequence of the current step's batch through
    the convolution and the recurrence, from and to its saved states.

    Runs of at least `MIN_CHUNKED_TOKENS` grid columns where no state is kept go through
    the chunked form in chunks of at most `chunk_size` tokens; the other columns (decode,
    verification, the kept tail of a prefill) token by token. `chunk_size=None`: every
    column token by token (the reference)."""
    meta = current_metadata()
    n = meta.num_tokens
    num_rows = mixed_qkv.shape[0]  # a compiled forward pads to its bucket
    mixed_qkv, g, beta = mixed_qkv[:n], g[:n], beta[:n]
    device, dtype = mixed_qkv.device, mixed_qkv.dtype
    grid = meta.cached("delta_layout", lambda: _Layout(meta, device))
    num_seqs, max_len = grid.num_seqs, grid.max_len
    conv_dim, kernel = conv_weight.shape
    heads = g.shape[1]
    key_dim = num_k_heads * head_k_dim
    states: StepStates | None = meta.recurrent
    if states is not None:
        conv0, s = states.read(layer_idx)
        conv0, s = conv0.to(dtype), s.clone()
        keep = states.snapshot_index()  # [num_seqs, max_len]
    else:
        conv0 = mixed_qkv.new_zeros(num_seqs, kernel - 1, conv_dim)
        s = torch.zeros(num_seqs, heads, head_k_dim, head_v_dim, device=device)
        keep = None
    x = mixed_qkv[grid.rows] * grid.valid[..., None]  # [num_seqs, max_len, conv_dim]
    xs = torch.cat([conv0, x], dim=1)  # [num_seqs, kernel - 1 + max_len, conv_dim]
    # the causal convolution in float32, one tap at a time (no [tokens, conv_dim, kernel]
    # product): [num_seqs, max_len, conv_dim]
    taps, weight = xs.float(), conv_weight.float()
    conv = taps[:, :max_len] * weight[:, 0]
    for j in range(1, kernel):
        conv.addcmul_(taps[:, j : j + max_len], weight[:, j])
    conv = F.silu(conv).to(dtype)
    q, k, v = conv.split([key_dim, key_dim, heads * head_v_dim], dim=-1)
    rep = heads // num_k_heads
    q = q.reshape(num_seqs, max_len, num_k_heads, head_k_dim).repeat_interleave(rep, dim=2)
    k = k.reshape(num_seqs, max_len, num_k_heads, head_k_dim).repeat_interleave(rep, dim=2)
    v = v.reshape(num_seqs, max_len, heads, head_v_dim).float()
    q = l2norm(q.float()) * head_k_dim**-0.5
    k = l2norm(k.float())
    # padding tokens get g = 0 and beta = 0: an update that leaves the state as it is
    decay_log = torch.where(grid.valid[..., None], g[grid.rows].float(), 0.0)
    rate = torch.where(grid.valid[..., None], beta[grid.rows].float(), 0.0)
    decay = decay_log.exp()  # [num_seqs, max_len, heads]
    out = torch.empty(num_seqs, max_len, heads, head_v_dim, device=device)
    kept = [False] * max_len if keep is None else (keep >= 0).any(dim=0).tolist()
    for start, end, chunked in _spans(kept, chunk_size):
        if chunked:  # no state is kept inside: the chunked form, state out at the end only
            cols = slice(start, end)
            inputs = (x[:, cols] for x in (q, k, v, decay_log, rate))
            out[:, cols], s = chunked_delta_rule(*inputs, s, chunk_size)
            continue
        for t in range(start, end):
            k_t = k[:, t, :, :, None]  # [num_seqs, heads, dk, 1]
            decayed = s * decay[:, t, :, None, None]
            delta = (v[:, t] - (decayed * k_t).sum(dim=-2)) * rate[:, t, :, None]
            updated = decayed + k_t * delta[:, :, None, :]
            s = torch.where(grid.valid[:, t, None, None, None], updated, s)
            out[:, t] = (s * q[:, t, :, :, None]).sum(dim=-2)
            if keep is not None and kept[t]:
                seqs = (keep[:, t] >= 0).nonzero()[:, 0]
                window = xs[seqs, t + 1 : t + kernel]  # the last kernel - 1 inputs
                states.write(layer_idx, seqs, keep[seqs, t], window, s[seqs])
    result = out[grid.valid].to(dtype)  # [num_tokens, heads, dv] in grid order
    result = torch.empty_like(result).index_copy_(0, grid.flat, result)
    if num_rows > n:
        result = torch.cat([result, result.new_zeros(num_rows - n, heads, head_v_dim)])
    return result


def _gated_delta_fake(
    mixed_qkv, g, beta, conv_weight, layer_idx, num_k_heads, head_k_dim, head_v_dim
):
    return mixed_qkv.new_empty(mixed_qkv.shape[0], g.shape[1], head_v_dim)


# Opaque to the compiler, like attention: it reads the step's metadata and states when it
# runs, and writes the kept states in place.
define_op(
    "gated_delta(Tensor mixed_qkv, Tensor g, Tensor beta, Tensor conv_weight, SymInt layer_idx, "
    "SymInt num_k_heads, SymInt head_k_dim, SymInt head_v_dim) -> Tensor",
    gated_delta_ref,
    _gated_delta_fake,
    tags=(torch.Tag.cudagraph_unsafe,),
)


def gated_delta(
    mixed_qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    layer_idx: int,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> torch.Tensor:
    """`gated_delta_ref` for the enclosing `attention_context`; one opaque op when
    compiled."""
    args = (mixed_qkv, g, beta, conv_weight, layer_idx, num_k_heads, head_k_dim, head_v_dim)
    if torch.compiler.is_compiling():
        return torch.ops.cluster.gated_delta(*args)
    return gated_delta_ref(*args)
