"""A trainable EAGLE-3 head with training-time test (TTT).

Same parameters and names as the public EAGLE-3 layout our engine loads (`fc`,
`midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), in plain torch so autograd runs through
it. At TTT step j, row p stands for position p + j: its input token is x[p + 1 + j], its
hidden is the target feature at p (step 0) or the head's own pre-norm output of row p at
step j - 1, and it predicts x[p + 2 + j]. Attention mirrors inference exactly: row p
sees the step-0 keys of positions <= p and its own keys of steps 1..j.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cluster.models.rotary import inverse_frequencies, rope_parameters


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


class Eagle3Trainable(nn.Module):
    def __init__(
        self, target_config: Any, draft_vocab_size: int, embed_weight: torch.Tensor
    ) -> None:
        super().__init__()
        cfg = target_config
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or h // self.heads
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = nn.Module()
        m = self.midlayer
        m.input_layernorm, m.hidden_norm, m.post_attention_layernorm = (
            RMSNorm(h, eps) for _ in range(3)
        )
        m.self_attn = nn.Module()
        m.self_attn.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=False)
        m.self_attn.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        m.self_attn.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        m.self_attn.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        m.mlp = nn.Module()
        m.mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        m.mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        m.mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.embed = nn.Embedding.from_pretrained(embed_weight.float(), freeze=True)  # the target's
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
        input_ids: torch.Tensor,  # [B, T] the sequences (padded)
        features: torch.Tensor,  # [B, T, 3H] target aux states per position
        valid: torch.Tensor,  # [B, T] bool: real tokens
        steps: int,
    ) -> list[torch.Tensor]:
        """Draft-vocabulary logits of each TTT step: list of [B, T, draft_vocab]; row p of
        step j predicts input_ids[p + 2 + j]."""
        batch, length = input_ids.shape
        attn = self.midlayer.self_attn
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        base_mask = causal[None] & valid[:, None, :]  # [B, T, T] step-0 keys
        hidden = self.fc(features.float())  # [B, T, H]
        positions = torch.arange(length, device=input_ids.device).expand(batch, length)
        keys0 = values0 = None
        diag_keys: list[torch.Tensor] = []
        diag_values: list[torch.Tensor] = []
        outputs = []
        scale = 1 / math.sqrt(self.head_dim)
        rep = self.heads // self.kv_heads
        for step in range(steps):
            shifted = torch.roll(input_ids, shifts=-(1 + step), dims=1)  # token at p + 1 + step
            embeds = self.embed(shifted)
            normed = self.midlayer.hidden_norm(hidden)
            x = torch.cat([self.midlayer.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
            q = attn.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
            cos, sin = self._rope(positions + step)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            k, v = (
                k.repeat_interleave(rep, dim=1),
                v.repeat_interleave(rep, dim=1),
            )  # [B, heads, T, d]
            if step == 0:
                keys0, values0 = k, v
            else:
                diag_keys.append(k)
                diag_values.append(v)
            scores = [(q @ keys0.transpose(-1, -2)) * scale]  # [B, heads, T, T]
            scores[0] = scores[0].masked_fill(~base_mask[:, None], float("-inf"))
            scores += [
                (q * dk).sum(-1, keepdim=True) * scale for dk in diag_keys
            ]  # [B, heads, T, 1]
            probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
            out = probs[..., :length] @ values0
            for i, dv in enumerate(diag_values):
                out = out + probs[..., length + i : length + i + 1] * dv
            out = attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
            residual = hidden + out
            mlp = self.midlayer.mlp
            h2 = self.midlayer.post_attention_layernorm(residual)
            prenorm = residual + mlp.down_proj(F.silu(mlp.gate_proj(h2)) * mlp.up_proj(h2))
            outputs.append(self.lm_head(self.norm(prenorm)))
            hidden = prenorm
        return outputs

    def export_state(self, d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensors in the public EAGLE-3 layout (no embedding: the target's is shared)."""
        state = {
            k: v.detach().clone().contiguous()
            for k, v in self.state_dict().items()
            if not k.startswith("embed.")
        }
        state["d2t"] = d2t
        state["t2d"] = t2d
        return state
