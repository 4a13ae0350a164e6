"""EAGLE draft heads on Llama blocks.

- `EagleLlama` (EAGLE-1): `fc(concat(embed, hidden))`, the draft config's decoder layers
  (the first without its input norm), no final norm; returns `hidden + residual` twice.
- `EagleNormFusionLlama` (the Qwen3-MoE-style variant): `eh_proj(concat(enorm(embed),
  hnorm(hidden)))`, exactly one layer, a final norm; returns the normed state twice.
Checkpoints use the public EAGLE layout (`fc.weight`, `layers.N.*`, optional
`embed_tokens.weight` / `lm_head.weight`), without a `model.` prefix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cluster.models.draft_base import DraftModel
from cluster.models.layers import RMSNorm
from cluster.models.llama import LlamaDecoderLayer
from cluster.parallel import ParallelLMHead, ParallelState, ReplicatedLinear, VocabParallelEmbedding


def _own_embedding_and_head(draft: DraftModel, tensor_names: set[str], dtype: torch.dtype) -> None:
    """Embedding and head of the draft's own, only when its checkpoint has them."""
    cfg, state = draft.config, draft.state
    draft.embed_tokens = (
        VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, state, dtype)
        if "embed_tokens.weight" in tensor_names
        else None
    )
    draft.lm_head = (
        ParallelLMHead(cfg.vocab_size, cfg.hidden_size, state, dtype=dtype)
        if "lm_head.weight" in tensor_names
        else None
    )


class EagleLlama(DraftModel):
    def build(
        self, config: Any, state: ParallelState, dtype: torch.dtype, tensor_names: set[str]
    ) -> None:
        hidden = config.hidden_size
        self.num_attention_layers = int(config.num_hidden_layers)
        self.fc = ReplicatedLinear(
            2 * hidden, hidden, state, bias="fc.bias" in tensor_names, dtype=dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.first_layer_idx + i, state, dtype)
            for i in range(self.num_attention_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()
        _own_embedding_and_head(self, tensor_names, dtype)

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(torch.cat([self.embed_tokens(input_ids), hidden], dim=-1))
        residual = None
        rope = self.layers[0].self_attn.rope(positions, h.dtype)
        for layer in self.layers:
            h, residual = layer(rope, h, residual)
        h = h + residual
        return h, h


class EagleNormFusionLlama(DraftModel):
    def build(
        self, config: Any, state: ParallelState, dtype: torch.dtype, tensor_names: set[str]
    ) -> None:
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps, dtype)
        self.hnorm = RMSNorm(hidden, eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, state, dtype=dtype)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, self.first_layer_idx, state, dtype)])
        self.norm = RMSNorm(hidden, eps, dtype)
        _own_embedding_and_head(self, tensor_names, dtype)

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused = torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(hidden)], dim=-1)
        layer = self.layers[0]
        h, residual = layer(layer.self_attn.rope(positions, fused.dtype), self.eh_proj(fused), None)
        h, _ = self.norm(h, residual)
        return h, h
