"""Qwen3-Next target: a hybrid stack of gated DeltaNet (linear attention) layers and gated
full-attention layers (`layer_types`), MoE with a gated shared expert, zero-centred
RMSNorms.

- Linear-attention layers (`GatedDeltaNet`): `in_proj_qkvz` and `in_proj_ba` are laid out
  per key head ([q, k, v..., z...] and [b..., a...] for the value heads of that key head),
  then a depthwise causal convolution over q, k, v and the gated delta rule
  (`cluster.models.gated_delta`); the output goes through an RMSNorm gated by silu(z).
  Each request's convolution and recurrent state live beside the KV cache
  (`cluster.worker.state_cache`).
- Full-attention layers (`GatedAttention`): q_proj gives each head's query and an output
  gate; q and k get a zero-centred RMSNorm per head; rope covers the first
  `partial_rotary_factor` of each head; the attention output is multiplied by
  sigmoid(gate) before o_proj.
- Norms are zero-centred: `x_normed * (1 + weight)`, computed in float32 as transformers
  does; the linear layers' gated norm uses its weight as is.
- MoE blocks (`decoder_sparse_step`, `mlp_only_layers`): Qwen3-MoE's routing plus one
  shared expert scaled by sigmoid(`shared_expert_gate`(x)).

Tensor parallelism splits the key heads (with their value heads), the attention heads and
every expert's intermediate dimension. An MTP layer (`mtp.layers.i`, `cluster.models.mtp`)
is a full-attention layer whose MLP follows the same sparsity rule counted from 0.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cluster.models.attention import KVShape, attention
from cluster.models.gated_delta import RecurrentShape, gated_delta
from cluster.models.layers import Rope, RotaryEmbedding, apply_rope, rope_parameters
from cluster.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, head_dim_of
from cluster.models.moe import SparseMoeBlock, expert_checkpoint_shard
from cluster.parallel import (
    ColumnParallelLinear,
    ParallelState,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from cluster.parallel.comm import all_reduce
from cluster.parallel.linear import divide
from cluster.parallel.weights import TensorLike, copy_shard


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm scaling by `1 + weight` (the checkpoint stores the offset from one);
    `forward(x, residual)` adds first and returns (normed, x + residual) like `RMSNorm`."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = residual = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


def layer_type(config: Any, layer_idx: int) -> str:
    """ "linear_attention" or "full_attention"; layers after the target's (MTP) are full."""
    types = list(config.layer_types)
    return types[layer_idx] if layer_idx < len(types) else "full_attention"


class GatedAttention(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        heads = int(config.num_attention_heads)
        self.num_heads = divide(heads, state.tp_size, "num_attention_heads")
        # The q part holds each head's query then its gate: 2 * heads rows of head_dim, so
        # a rank's slice is whole (query, gate) pairs.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            2 * heads,
            int(config.num_key_value_heads),
            state,
            bool(getattr(config, "attention_bias", False)),
            dtype,
        )
        self.o_proj = RowParallelLinear(
            heads * self.head_dim, config.hidden_size, state, dtype=dtype
        )
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        theta, scaling = rope_parameters(config)
        factor = scaling.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1))
        self.rotary_emb = RotaryEmbedding(int(self.head_dim * float(factor)), theta, scaling)
        self.scale = self.head_dim**-0.5

    @property
    def kv_shape(self) -> KVShape:  # an `AttentionLayer`
        return KVShape(self.qkv_proj.num_kv_heads, self.head_dim)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return self.rotary_emb.cos_sin(positions, dtype)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        n, d = hidden.shape[0], self.head_dim
        kv_size = self.qkv_proj.kv_size
        q_gate, k, v = self.qkv_proj(hidden).split([2 * self.num_heads * d, kv_size, kv_size], -1)
        q, gate = q_gate.view(n, self.num_heads, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q.reshape(-1, d)).view(n, self.num_heads, d)
        k = self.k_norm(k.reshape(-1, d)).view(n, -1, d)
        q, k = apply_rope(q, k, rope)
        out = attention(q, k, v.view(n, -1, d), self.layer_idx, self.scale)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, times silu(z) (weight used as is)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.state = state
        tp = state.tp_size
        self.num_k_heads = divide(int(config.linear_num_key_heads), tp, "linear_num_key_heads")
        self.num_v_heads = divide(int(config.linear_num_value_heads), tp, "linear_num_value_heads")
        self.head_k_dim = int(config.linear_key_head_dim)
        self.head_v_dim = int(config.linear_value_head_dim)
        self.kernel = int(config.linear_conv_kernel_dim)
        hidden = int(config.hidden_size)
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * key_dim + value_dim  # this rank's
        # Column splits keep whole key-head groups: the checkpoint lays rows out per key head.
        self.in_proj_qkvz = ColumnParallelLinear(
            hidden, tp * (2 * key_dim + 2 * value_dim), state, dtype=dtype
        )
        self.in_proj_ba = ColumnParallelLinear(
            hidden, tp * 2 * self.num_v_heads, state, dtype=dtype
        )
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(
            torch.empty(self.conv_dim, 1, self.kernel, dtype=dtype), requires_grad=False
        )
        self.conv1d.weight.weight_loader = self._load_conv
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), requires_grad=False)
        for p in (self.dt_bias, self.A_log):
            p.weight_loader = self._load_by_value_head
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, dtype)
        self.out_proj = RowParallelLinear(tp * value_dim, hidden, state, dtype=dtype)

    @property
    def recurrent_shape(self) -> RecurrentShape:  # a `RecurrentLayer`
        return RecurrentShape(
            self.conv_dim, self.kernel, self.num_v_heads, self.head_k_dim, self.head_v_dim
        )

    def _load_conv(self, param: nn.Parameter, loaded: TensorLike) -> None:
        """The checkpoint's channels are [q of every key head, k of every key head, v of
        every value head]: this rank takes its heads from each of the three."""
        rank, tp = self.state.tp_rank, self.state.tp_size
        if loaded.shape[0] != tp * self.conv_dim:
            raise ValueError(
                f"conv1d.weight has {loaded.shape[0]} channels, expected {tp * self.conv_dim}"
            )
        key_dim = self.num_k_heads * self.head_k_dim
        offset = 0
        for part, size in enumerate((key_dim, key_dim, self.conv_dim - 2 * key_dim)):
            start = tp * key_dim * part + rank * size  # parts: q, k (key_dim each), v
            copy_shard(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))
            offset += size

    def _load_by_value_head(self, param: nn.Parameter, loaded: TensorLike) -> None:
        n = self.num_v_heads
        copy_shard(param.data, loaded, 0, self.state.tp_rank * n, n, full=n * self.state.tp_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        nk, dk, dv = self.num_k_heads, self.head_k_dim, self.head_v_dim
        per_key = self.num_v_heads // nk  # value heads per key head
        qkvz = self.in_proj_qkvz(hidden).view(n, nk, 2 * dk + 2 * per_key * dv)
        q, k, v, z = qkvz.split([dk, dk, per_key * dv, per_key * dv], dim=-1)
        b, a = self.in_proj_ba(hidden).view(n, nk, 2 * per_key).chunk(2, dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        beta = b.reshape(n, -1).sigmoid()  # [n, value heads]
        g = -self.A_log.float().exp() * F.softplus(a.reshape(n, -1).float() + self.dt_bias)
        core = gated_delta(
            mixed, g, beta, self.conv1d.weight[:, 0], self.layer_idx, nk, dk, dv
        )  # [n, value heads, dv]
        core = self.norm(core.reshape(-1, dv), z.reshape(-1, dv))
        return self.out_proj(core.reshape(n, -1))


class Qwen3NextMoE(SparseMoeBlock):
    def __init__(self, config: Any, state: ParallelState, dtype: torch.dtype) -> None:
        super().__init__(config, state, dtype)
        size = int(config.shared_expert_intermediate_size)
        self.shared_expert = LlamaMLP(config, state, dtype, size)
        self.shared_expert.down_proj.reduce_results = False  # one all-reduce for the block
        self.shared_expert_gate = ReplicatedLinear(int(config.hidden_size), 1, state, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(self.experts(x) + shared, self.state)


class Qwen3NextDecoderLayer(LlamaDecoderLayer):
    """`self_attn` (full attention) or `linear_attn` (gated DeltaNet), as `layer_types`
    says; the other is None."""

    def __init__(
        self, config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> None:
        nn.Module.__init__(self)
        linear = layer_type(config, layer_idx) == "linear_attention"
        self.self_attn = None if linear else GatedAttention(config, layer_idx, state, dtype)
        self.linear_attn = GatedDeltaNet(config, layer_idx, state, dtype) if linear else None
        self.mlp = self.make_mlp(config, layer_idx, state, dtype)
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = ZeroCentredRMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype
        )

    @staticmethod
    def make_mlp(
        config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> nn.Module:
        index = layer_idx % int(config.num_hidden_layers)  # MTP layers count from 0
        sparse = (
            index not in (getattr(config, "mlp_only_layers", None) or [])
            and int(config.num_experts) > 0
            and (index + 1) % int(config.decoder_sparse_step) == 0
        )
        return Qwen3NextMoE(config, state, dtype) if sparse else LlamaMLP(config, state, dtype)

    def forward(
        self, rope: Rope | None, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.linear_attn is not None:
            hidden = self.linear_attn(hidden)
        else:
            assert rope is not None
            hidden = self.self_attn(rope, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3NextForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3NextDecoderLayer
    norm_cls = ZeroCentredRMSNorm
    checkpoint_shard = staticmethod(expert_checkpoint_shard)  # experts into w13 / w2
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        **LlamaForCausalLM.packed_modules_mapping
    }

    def map_checkpoint_name(self, name: str) -> str | None:
        if name.startswith("mtp."):
            return None  # the MTP head's (loaded by the draft)
        return super().map_checkpoint_name(name)
