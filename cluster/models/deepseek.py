"""DeepSeek-V3 target: multi-head latent attention (MLA) over a paged cache of latents,
and MoE layers with shared experts and grouped top-k routing, on the Llama decoder.

MLA. Each token's keys and values come from one compressed latent `c_kv`
([kv_lora_rank], after `kv_a_layernorm`) plus one rope key `k_rot` ([qk_rope_head_dim])
shared by all heads. The paged cache holds exactly that, `[c_kv, k_rot]` as a single KV
head stored once, and attention runs in the latent ("absorbed") form: each head's query no-rope part
is multiplied into the latent space by its slice of `kv_b_proj` (W_UK), the scores are
`[q_latent, q_rot] . [c_kv, k_rot]`, and the weighted sum of latents goes back out
through W_UV. This is transformers' computation reassociated, not approximated. The
values are the keys' vectors (the cache's value tensor is its key tensor,
`KVShape.values_are_keys`); only the first `kv_lora_rank` columns of the output are used.

Tensor parallelism splits the heads (q_b_proj / q_proj, kv_b_proj columns, o_proj rows)
and every expert's intermediate dimension; the latent projections are replicated.

Routing (`DeepseekMoE.route`): sigmoid scores; the experts are split into `n_group`
groups, the `topk_group` groups with the highest sum of their two best scores (after
adding `e_score_correction_bias`) are kept, and the top-k experts of those are chosen by
the corrected scores but weighted by the plain ones (renormalised if `norm_topk_prob`),
times `routed_scaling_factor`. The shared experts run on every token.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cluster.models.attention import KVShape, attention
from cluster.models.layers import RMSNorm, Rope, RotaryEmbedding, apply_rope, rope_parameters
from cluster.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from cluster.models.moe import SparseMoeBlock, expert_checkpoint_shard
from cluster.parallel import (
    ColumnParallelLinear,
    ParallelState,
    ReplicatedLinear,
    RowParallelLinear,
)
from cluster.parallel.comm import all_reduce
from cluster.parallel.linear import divide


def softmax_scale(config: Any) -> float:
    """1 / sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim) squared."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling = rope_parameters(config)
    m_all = scaling.get("mscale_all_dim")
    if scaling.get("rope_type", "default") != "default" and m_all:
        factor = float(scaling["factor"])
        mscale = 0.1 * m_all * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... to the rotate-half layout [x0, x2, ..., x1, x3, ...]
    (DeepSeek's `rope_interleave`; queries and keys alike, so scores are unchanged)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAttention(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hidden = int(config.hidden_size)
        eps = 1e-6  # the latent norms' own epsilon in DeepSeek's code (not rms_norm_eps)
        heads = int(config.num_attention_heads)
        self.num_heads = divide(heads, state.tp_size, "num_attention_heads")
        self.nope_dim = int(config.qk_nope_head_dim)
        self.rope_dim = int(config.qk_rope_head_dim)
        self.v_dim = int(config.v_head_dim)
        self.kv_lora_rank = int(config.kv_lora_rank)
        qk_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, state, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps, dtype)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, heads * qk_dim, state, dtype=dtype
            )
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim, state, dtype=dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.kv_lora_rank + self.rope_dim, state, bias, dtype
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), state, dtype=dtype
        )
        self.kv_b_proj.fp8_allowed = False  # read as W_UK / W_UV below, never called
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, state, bias, dtype=dtype)
        theta, scaling = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(self.rope_dim, theta, scaling)
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        self.scale = softmax_scale(config)

    @property
    def kv_shape(self) -> KVShape:  # an `AttentionLayer`: one latent "head", stored once
        return KVShape(1, self.kv_lora_rank + self.rope_dim, values_are_keys=True)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return self.rotary_emb.cos_sin(positions, dtype)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q_nope, q_rot = q.view(n, self.num_heads, -1).split([self.nope_dim, self.rope_dim], -1)
        c_kv, k_rot = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], -1)
        c_kv = self.kv_a_layernorm(c_kv)  # [n, kv_lora_rank]
        k_rot = k_rot.reshape(n, 1, self.rope_dim)
        if self.interleaved:
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        q_rot, k_rot = apply_rope(q_rot, k_rot, rope)
        # this rank's heads of kv_b_proj: [heads, nope + v, kv_lora_rank]
        w_kv = self.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank)
        w_uk, w_uv = w_kv.split([self.nope_dim, self.v_dim], dim=1)
        q_latent = torch.einsum("thd,hdc->thc", q_nope, w_uk)  # [n, heads, kv_lora_rank]
        query = torch.cat([q_latent, q_rot], dim=-1)  # [n, heads, kv_lora_rank + rope]
        key = torch.cat([c_kv[:, None, :], k_rot], dim=-1)  # [n, 1, kv_lora_rank + rope]
        out = attention(query, key, key, self.layer_idx, self.scale)
        latent = out.view(n, self.num_heads, -1)[..., : self.kv_lora_rank]
        values = torch.einsum("thc,hvc->thv", latent, w_uv)  # [n, heads, v_head_dim]
        return self.o_proj(values.reshape(n, -1))


class DeepseekMoE(SparseMoeBlock):
    def __init__(self, config: Any, state: ParallelState, dtype: torch.dtype) -> None:
        num_experts = int(config.n_routed_experts)
        super().__init__(config, state, dtype, num_experts)
        self.gate = ReplicatedLinear(
            int(config.hidden_size), num_experts, state, dtype=torch.float32
        )
        self.gate.fp8_allowed = False  # its weight is read directly (`route`)
        self.gate.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
        )
        self.num_groups = int(config.n_group)
        self.topk_group = int(config.topk_group)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        shared = int(getattr(config, "n_shared_experts", 0) or 0)
        size = int(config.moe_intermediate_size) * shared
        self.shared_experts = LlamaMLP(config, state, dtype, size) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.gate.weight).sigmoid()  # [n, experts] float32
        choice = scores + self.gate.e_score_correction_bias
        grouped = choice.view(x.shape[0], self.num_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [n, groups]
        best_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        keep = keep[:, :, None].expand_as(grouped).reshape_as(choice)
        choice = choice.masked_fill(~keep, float("-inf"))
        top_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, top_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return top_ids, (weights * self.routed_scaling_factor).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(self.experts(x), self.state)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def make_attention(
        config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> MLAttention:
        return MLAttention(config, layer_idx, state, dtype)

    @staticmethod
    def make_mlp(
        config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> nn.Module:
        if layer_idx >= int(config.first_k_dense_replace):
            return DeepseekMoE(config, state, dtype)
        return LlamaMLP(config, state, dtype)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = DeepseekV3DecoderLayer
    # (no fused q/k/v: only the dense and shared-expert MLPs pack gate and up)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    checkpoint_shard = staticmethod(expert_checkpoint_shard)  # experts into w13 / w2
