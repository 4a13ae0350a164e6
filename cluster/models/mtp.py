"""Multi-token-prediction heads, read from the target checkpoint.

- DeepSeek style (`model.layers.{L+i}.{enorm,hnorm,eh_proj,shared_head.norm}` plus the
  weights of one decoder layer of the target's architecture: MLA + MoE for DeepSeek-V3,
  a Llama block otherwise): `eh_proj(concat(enorm(embed), hnorm(hidden)))`, the block,
  returns `residual + hidden`; logits through that layer's `shared_head` (its norm, then
  the target's LM head).
- Qwen3-Next style (`mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,layers.i,norm}`):
  `fc(concat(norm_e(embed), norm_h(hidden)))`, one layer, the final norm; one tensor out.
  The layers and norms are the target family's: for Qwen3-Next a gated full-attention
  layer with its MoE and zero-centred norms, Llama's otherwise.
Pass `step` uses MTP layer `step % num_mtp_layers`. Embedding and LM head are always
the target's.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from cluster.models.draft_base import DraftModel
from cluster.models.layers import RMSNorm
from cluster.models.llama import LlamaForCausalLM
from cluster.parallel import ColumnParallelLinear, ParallelState, ReplicatedLinear


def count_mtp_layers(tensor_names: set[str], num_target_layers: int, style: str) -> int:
    if style == "deepseek":
        pattern = re.compile(r"model\.layers\.(\d+)\.eh_proj\.")
        found = {int(m.group(1)) for n in tensor_names if (m := pattern.match(n))}
        return len({i for i in found if i >= num_target_layers})
    pattern = re.compile(r"mtp\.layers\.(\d+)\.")
    return len({int(m.group(1)) for n in tensor_names if (m := pattern.match(n))})


def _target_family(config: Any) -> type[nn.Module]:
    """The target model class whose decoder layer an MTP block is (Llama's when the
    config names no served architecture)."""
    from cluster.models.registry import model_class_for

    try:
        return model_class_for(config)
    except ValueError:
        return LlamaForCausalLM


class DeepSeekMTPLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps, dtype)
        self.hnorm = RMSNorm(hidden, eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, state, dtype=dtype)
        # the target's own block: DeepSeek-V3's is MLA + MoE
        self.mtp_block = _target_family(config).decoder_layer_cls(config, layer_idx, state, dtype)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps, dtype)


class DeepSeekMTP(DraftModel):
    def build(
        self, config: Any, state: ParallelState, dtype: torch.dtype, tensor_names: set[str]
    ) -> None:
        self.num_attention_layers = count_mtp_layers(tensor_names, self.first_layer_idx, "deepseek")
        self.num_step_kinds = self.num_attention_layers
        family = _target_family(config)
        self.packed_modules_mapping = family.packed_modules_mapping
        self.checkpoint_shard = getattr(family, "checkpoint_shard", None)
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict(
            {
                str(i): DeepSeekMTPLayer(config, i, state, dtype)
                for i in range(
                    self.first_layer_idx, self.first_layer_idx + self.num_attention_layers
                )
            }
        )
        self.embed_tokens = self.lm_head = None  # always the target's

    def map_checkpoint_name(self, name: str) -> str | None:
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m is None or int(m.group(1)) < self.first_layer_idx:
            return None  # the target's own tensors
        rest = m.group(2)
        if rest.startswith(("shared_head.head.", "embed_tokens.")):
            return None  # the target's LM head and embedding (DeepSeek stores copies)
        own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
        if not rest.startswith(own):
            rest = "mtp_block." + rest
        return f"model.layers.{m.group(1)}.{rest}"

    def _layer(self, step: int) -> DeepSeekMTPLayer:
        return self.model.layers[str(self.first_layer_idx + step % self.num_attention_layers)]

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self._layer(step)
        fused = torch.cat([layer.enorm(self.embed_tokens(input_ids)), layer.hnorm(hidden)], dim=-1)
        block = layer.mtp_block
        h, residual = block(
            block.self_attn.rope(positions, fused.dtype), layer.eh_proj(fused), None
        )
        h = residual + h
        return h, h

    def compute_logits(self, logits_hidden: torch.Tensor, step: int) -> torch.Tensor:
        return self.lm_head(self._layer(step).shared_head.norm(logits_hidden))


class Qwen3NextMTPModule(nn.Module):
    def __init__(
        self,
        config: Any,
        first_layer_idx: int,
        num_layers: int,
        state: ParallelState,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        family = _target_family(config)
        self.pre_fc_norm_embedding = family.norm_cls(hidden, eps, dtype)
        self.pre_fc_norm_hidden = family.norm_cls(hidden, eps, dtype)
        self.fc = ColumnParallelLinear(2 * hidden, hidden, state, gather_output=True, dtype=dtype)
        self.layers = nn.ModuleList(
            family.decoder_layer_cls(config, first_layer_idx + i, state, dtype)
            for i in range(num_layers)
        )
        self.norm = family.norm_cls(hidden, eps, dtype)


class Qwen3NextMTP(DraftModel):
    def build(
        self, config: Any, state: ParallelState, dtype: torch.dtype, tensor_names: set[str]
    ) -> None:
        self.num_attention_layers = count_mtp_layers(
            tensor_names, self.first_layer_idx, "qwen3_next"
        )
        self.num_step_kinds = self.num_attention_layers
        self.mtp = Qwen3NextMTPModule(
            config, self.first_layer_idx, self.num_attention_layers, state, dtype
        )
        family = _target_family(config)
        self.packed_modules_mapping = family.packed_modules_mapping
        self.checkpoint_shard = getattr(family, "checkpoint_shard", None)
        self.embed_tokens = self.lm_head = None  # always the target's

    def map_checkpoint_name(self, name: str) -> str | None:
        return name if name.startswith("mtp.") else None

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.mtp
        fused = torch.cat(
            [m.pre_fc_norm_embedding(self.embed_tokens(input_ids)), m.pre_fc_norm_hidden(hidden)],
            dim=-1,
        )
        layer = m.layers[step % self.num_attention_layers]
        h, residual = layer(layer.self_attn.rope(positions, fused.dtype), m.fc(fused), None)
        h, _ = m.norm(h, residual)
        return h, h
