"""EAGLE-3 draft head for Llama targets.

Pass 0 fuses three target layers' residual streams: `fc(concat(aux_0, aux_1, aux_2))`
(`[n, 3H] -> [n, H]`). One decoder layer (`midlayer`) attends over
`concat(input_layernorm(embed), hidden_norm(h))` (so its q/k/v projections take 2H
inputs), then a final norm. Logits come from the draft's own LM head over a reduced
vocabulary, mapped to target ids by `d2t`: `target = draft + d2t[draft]`. The next pass
takes the layer's pre-norm output. Checkpoint layout (public EAGLE-3): `fc.weight`,
`midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d` (unused), optional
`embed_tokens.weight`; config `draft_vocab_size` (and `target_hidden_size`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cluster.models.draft_base import DraftModel
from cluster.models.layers import RMSNorm
from cluster.models.llama import LlamaAttention, LlamaMLP
from cluster.parallel import ParallelLMHead, ParallelState, ReplicatedLinear, VocabParallelEmbedding


def eagle3_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """Target layers whose incoming residual stream EAGLE-3 reads (vLLM's choice)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


class Eagle3MidLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_idx, state, dtype, input_size=2 * hidden)
        self.mlp = LlamaMLP(config, state, dtype)
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.hidden_norm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [n, 2H]
        x = self.self_attn(self.self_attn.rope(positions, x.dtype), x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Llama(DraftModel):
    def build(
        self, config: Any, state: ParallelState, dtype: torch.dtype, tensor_names: set[str]
    ) -> None:
        hidden = config.hidden_size
        target_hidden = int(getattr(config, "target_hidden_size", None) or hidden)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.target_vocab_size = int(self.target_config.vocab_size)
        self.aux_layers = eagle3_aux_layers(int(self.target_config.num_hidden_layers))
        self.fc = ReplicatedLinear(3 * target_hidden, hidden, state, dtype=dtype)
        self.midlayer = Eagle3MidLayer(config, self.first_layer_idx, state, dtype)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden, state, dtype=dtype)
        self.d2t = nn.Parameter(
            torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False
        )
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, hidden, state, dtype)
            if "embed_tokens.weight" in tensor_names
            else None
        )

    def combine_target_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, 3 * target_hidden] (the three aux states, concatenated) -> [n, hidden]."""
        return self.fc(hidden)

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.midlayer(positions, self.embed_tokens(input_ids), hidden)
        normed, prenorm = self.norm(x, residual)
        return normed, prenorm

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def compute_logits(self, logits_hidden: torch.Tensor, step: int) -> torch.Tensor:
        """Draft-vocabulary logits scattered into the target vocabulary (-inf elsewhere)."""
        draft_logits = self.lm_head(logits_hidden)  # [n, draft_vocab]
        targets = self._target_ids()
        if targets is None:
            return draft_logits
        out = draft_logits.new_full((draft_logits.shape[0], self.target_vocab_size), float("-inf"))
        out[:, targets] = draft_logits
        return out

    def _target_ids(self) -> torch.Tensor | None:
        """[draft_vocab] the target id of every draft id; None when they are the same ids.
        Read from `d2t` once (the weights are loaded by the first call), not every pass."""
        if not hasattr(self, "_targets"):
            ids = torch.arange(self.draft_vocab_size, device=self.d2t.device)
            identity = self.draft_vocab_size == self.target_vocab_size and not self.d2t.any()
            self._targets = None if identity else self.draft_to_target(ids)
        return self._targets
