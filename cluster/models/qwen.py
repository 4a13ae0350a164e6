"""Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE and Mistral targets: the Llama decoder with the
few differences each family has.

- Qwen2: biases on the q, k and v projections (none on o_proj).
- Qwen3: RMSNorm over each head of q and k before rope; biases as `attention_bias` says.
- Qwen3-MoE: Qwen3's attention; sparse MoE blocks (`moe.SparseMoeBlock`) in the layers
  that `decoder_sparse_step` and `mlp_only_layers` pick, dense MLPs elsewhere.
- Mistral: Llama's layers; its sliding window is refused at config time unless
  `max_model_len` fits inside it (`cluster.config.architectures`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cluster.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from cluster.models.moe import SparseMoeBlock, expert_checkpoint_shard
from cluster.parallel import ParallelState


class Qwen2DecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def make_attention(
        config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> LlamaAttention:
        return LlamaAttention(config, layer_idx, state, dtype, qkv_bias=True, o_bias=False)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def make_attention(
        config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> LlamaAttention:
        return LlamaAttention(config, layer_idx, state, dtype, qk_norm=True)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    @staticmethod
    def make_mlp(
        config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> nn.Module:
        sparse = (
            layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and int(config.num_experts) > 0
            and (layer_idx + 1) % int(config.decoder_sparse_step) == 0
        )
        if sparse:
            return SparseMoeBlock(config, state, dtype)
        return LlamaMLP(config, state, dtype)


class Qwen2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen2DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3MoeDecoderLayer

    checkpoint_shard = staticmethod(expert_checkpoint_shard)  # experts into w13 / w2
