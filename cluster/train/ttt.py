"""Training-time test (TTT): a draft head's chain of drafting passes, unrolled for training.

Shared by the trainable EAGLE-3, EAGLE-1 and DeepSeek-MTP heads. At TTT step j, row p
stands for position p + j: its input token is x[p + 1 + j], its hidden is the target
feature at p (step 0) or the head's own output of row p at step j - 1, and its output
predicts x[p + 2 + j]. Attention mirrors inference exactly: row p sees the step-0 keys of
positions <= p and its own keys of steps 1..j, rotated at position p + j.

`TTTDecoderLayer` holds a Llama block's parameters under the public names (`self_attn.*`,
`mlp.*`, `post_attention_layernorm`, optional `input_layernorm`); the head applies the
input norm itself (EAGLE-3 norms only the embedding half of its input).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cluster.models.layers import inverse_frequencies, rope_parameters


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TTTAttentionState:
    """One layer's keys and values over a TTT forward: step 0's at every position, then
    each later step's own (one per row, the "diagonal")."""

    def __init__(self, key_valid: torch.Tensor) -> None:
        self.key_valid = key_valid  # [B, T] bool: real positions among the step-0 keys
        self.keys0: torch.Tensor | None = None  # [B, heads, T, head_dim]
        self.values0: torch.Tensor | None = None
        self.diag_keys: list[torch.Tensor] = []  # per step >= 1: [B, heads, W, head_dim]
        self.diag_values: list[torch.Tensor] = []


def row_window(first_row: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The rows a TTT forward computes: sequence b's positions from `first_row[b]` on, as
    anchors [B, W] (W the longest such tail; positions past the end are clamped and are
    not `valid` there). Rows before `first_row` (prompt rows with no label at any step)
    still give the step-0 keys, at a fraction of a row's cost."""
    length = valid.shape[1]
    width = int((valid.sum(1) - first_row).clamp(min=1).max())
    rows = first_row[:, None] + torch.arange(width, device=valid.device)  # [B, W]
    return rows.clamp(max=length - 1)


def gather_rows(x: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] at rows `anchors` [B, W] -> [B, W, ...]."""
    index = anchors.reshape(*anchors.shape, *([1] * (x.dim() - 2)))
    return x.gather(1, index.expand(*anchors.shape, *x.shape[2:]))


class TTTDecoderLayer(nn.Module):
    def __init__(
        self, cfg: Any, qkv_in: int, input_norm: bool = True, hidden_norm: bool = False
    ) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or h // self.heads
        if input_norm:
            self.input_layernorm = RMSNorm(h, eps)
        if hidden_norm:  # EAGLE-3's norm of the hidden half of its input
            self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj = nn.Linear(qkv_in, self.heads * self.head_dim, bias=False)
        a.k_proj = nn.Linear(qkv_in, self.kv_heads * self.head_dim, bias=False)
        a.v_proj = nn.Linear(qkv_in, self.kv_heads * self.head_dim, bias=False)
        a.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        theta, scaling = rope_parameters(cfg)
        self.register_buffer(
            "inv_freq", inverse_frequencies(self.head_dim, theta, scaling), persistent=False
        )

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, head_dim]
        return emb.cos(), emb.sin()

    def _project(
        self, proj: nn.Linear, x: torch.Tensor, heads: int, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """[B, N, qkv_in] -> [B, heads, N, head_dim], rotated at `positions` [B, N] if any."""
        out = proj(x).view(x.shape[0], x.shape[1], heads, self.head_dim).transpose(1, 2)
        if positions is not None:
            out = _rotate(out, *self._rope(positions))
        return out.repeat_interleave(self.heads // heads, dim=1)

    def context(self, x: torch.Tensor, state: TTTAttentionState) -> None:
        """Step 0's keys and values at every position from its attention input x [B, T, qkv_in]."""
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        attn = self.self_attn
        state.keys0 = self._project(attn.k_proj, x, self.kv_heads, positions)
        state.values0 = self._project(attn.v_proj, x, self.kv_heads, None)
        state.diag_keys, state.diag_values = [], []

    def forward(
        self,
        x: torch.Tensor,  # [B, W, qkv_in] the (normed) attention input of the rows
        residual: torch.Tensor,  # [B, W, H]
        anchors: torch.Tensor,  # [B, W] the rows' anchor positions p (at step j: p + j)
        step: int,
        state: TTTAttentionState,
    ) -> torch.Tensor:
        """The block's output (residual stream after attention and MLP) [B, W, H]. Step 0's
        keys must be in `state` (`context`); a later step adds its rows' own keys."""
        attn = self.self_attn
        positions = anchors + step
        q = self._project(attn.q_proj, x, self.heads, positions)
        if step > 0:
            state.diag_keys.append(self._project(attn.k_proj, x, self.kv_heads, positions))
            state.diag_values.append(self._project(attn.v_proj, x, self.kv_heads, None))
        assert state.keys0 is not None and state.values0 is not None
        scale = 1 / math.sqrt(self.head_dim)
        length = state.keys0.shape[2]
        keys = torch.arange(length, device=x.device)
        seen = (keys[None, None] <= anchors[..., None]) & state.key_valid[:, None]  # [B, W, T]
        scores = [(q @ state.keys0.transpose(-1, -2)) * scale]  # [B, heads, W, T]
        scores[0] = scores[0].masked_fill(~seen[:, None], float("-inf"))
        scores += [(q * dk).sum(-1, keepdim=True) * scale for dk in state.diag_keys]  # [B,h,W,1]
        probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        out = probs[..., :length] @ state.values0
        for i, dv in enumerate(state.diag_values):
            out = out + probs[..., length + i : length + i + 1] * dv
        batch, width = anchors.shape
        residual = residual + attn.o_proj(out.transpose(1, 2).reshape(batch, width, -1))
        h = self.post_attention_layernorm(residual)
        mlp = self.mlp
        return residual + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))


class FrozenTable(nn.Module):
    """A frozen copy of one of the target's [vocab, hidden] tables (embedding or LM head),
    kept out of state dicts so checkpoints and exports stay small."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().float().clone(), persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.T


class TTTHead(nn.Module):
    """A one-block draft head unrolled over TTT steps. Subclasses implement `block`,
    `embed_ids`, `fuse` and `logits`."""

    def block(self) -> TTTDecoderLayer:
        raise NotImplementedError

    def first_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """Step-0 hidden from the target features (default: the features themselves)."""
        return features.float()

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) of the block from token embeddings and hidden."""
        raise NotImplementedError

    def logits(self, output: torch.Tensor) -> torch.Tensor:
        """The block's output -> logits (draft or target vocabulary)."""
        raise NotImplementedError

    def outputs(
        self,
        input_ids: torch.Tensor,  # [B, T] the sequences (padded)
        features: torch.Tensor,  # [B, T, F] the target features per position
        valid: torch.Tensor,  # [B, T] bool: real tokens
        steps: int,
        read: Callable[[torch.Tensor], torch.Tensor] | None = None,
        anchors: torch.Tensor | None = None,  # [B, W] the rows to compute (`row_window`)
    ) -> list[torch.Tensor]:
        """The block's output of each TTT step (the next step's hidden) at rows `anchors`
        (default: every position, W = T): list of [B, W, H]; with `read`, `read(output)`
        instead, taken as soon as the step is done."""
        batch, length = input_ids.shape
        if anchors is None:
            anchors = torch.arange(length, device=input_ids.device).expand(batch, length)
        state = TTTAttentionState(valid)
        block = self.block()
        # step 0: every position's keys, then the rows' own pass
        x, residual = self.fuse(
            self.embed_ids(torch.roll(input_ids, -1, dims=1)), self.first_hidden(features)
        )
        block.context(x, state)
        x, residual = gather_rows(x, anchors), gather_rows(residual, anchors)
        hidden = residual  # [B, W, H]; replaced by each step's output
        result = []
        for step in range(steps):
            if step > 0:  # the token at p + 1 + step, on the row's own previous output
                tokens = input_ids.gather(1, (anchors + 1 + step) % length)
                x, residual = self.fuse(self.embed_ids(tokens), hidden)
            hidden = block(x, residual, anchors, step, state)
            result.append(hidden if read is None else read(hidden))
        return result

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        valid: torch.Tensor,
        steps: int,
        anchors: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Logits of each TTT step at rows `anchors` (default: all): list of [B, W, vocab];
        row p of step j predicts input_ids[p + 2 + j]."""
        return self.outputs(input_ids, features, valid, steps, self.logits, anchors)
