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
    """One layer's keys and values over a TTT forward: step 0's, then each later step's
    own (one per row, the "diagonal")."""

    def __init__(self, base_mask: torch.Tensor) -> None:
        self.base_mask = base_mask  # [B, T, T] causal & valid: the step-0 keys
        self.keys0: torch.Tensor | None = None
        self.values0: torch.Tensor | None = None
        self.diag_keys: list[torch.Tensor] = []
        self.diag_values: list[torch.Tensor] = []


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

    def forward(
        self,
        x: torch.Tensor,  # [B, T, qkv_in] the (normed) attention input
        residual: torch.Tensor,  # [B, T, H]
        positions: torch.Tensor,  # [B, T] the rows' positions at this step
        step: int,
        state: TTTAttentionState,
    ) -> torch.Tensor:
        """The block's output (residual stream after attention and MLP) [B, T, H]."""
        batch, length, _ = x.shape
        attn = self.self_attn
        q = attn.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self._rope(positions)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, h, T, d]
        if step == 0:
            state.keys0, state.values0 = k, v
        else:
            state.diag_keys.append(k)
            state.diag_values.append(v)
        assert state.keys0 is not None and state.values0 is not None
        scale = 1 / math.sqrt(self.head_dim)
        scores = [(q @ state.keys0.transpose(-1, -2)) * scale]  # [B, heads, T, T]
        scores[0] = scores[0].masked_fill(~state.base_mask[:, None], float("-inf"))
        scores += [(q * dk).sum(-1, keepdim=True) * scale for dk in state.diag_keys]  # [B,h,T,1]
        probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        out = probs[..., :length] @ state.values0
        for i, dv in enumerate(state.diag_values):
            out = out + probs[..., length + i : length + i + 1] * dv
        residual = residual + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
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
    ) -> list[torch.Tensor]:
        """The block's output of each TTT step (the next step's hidden): list of [B, T, H];
        with `read`, `read(output)` instead, taken as soon as the step is done."""
        batch, length = input_ids.shape
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        state = TTTAttentionState(causal[None] & valid[:, None, :])
        hidden = self.first_hidden(features)
        positions = torch.arange(length, device=input_ids.device).expand(batch, length)
        result = []
        for step in range(steps):
            shifted = torch.roll(input_ids, shifts=-(1 + step), dims=1)  # token at p + 1 + step
            x, residual = self.fuse(self.embed_ids(shifted), hidden)
            hidden = self.block()(x, residual, positions + step, step, state)
            result.append(hidden if read is None else read(hidden))
        return result

    def forward(
        self, input_ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """Logits of each TTT step: list of [B, T, vocab]; row p of step j predicts
        input_ids[p + 2 + j]."""
        return self.outputs(input_ids, features, valid, steps, self.logits)
