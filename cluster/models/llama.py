"""Llama-architecture target model (Llama-2/3, SmolLM2) on tensor-parallel layers; the
dense decoder that the other families (`qwen.py`) change in a few places.

`forward` takes the flattened new tokens of several sequences and their positions
(the rest of the step's batch comes from `attention_context`) and returns the
final-norm hidden state of every token (plus, when asked, the residual stream
entering chosen layers, which EAGLE-3 reads). `compute_logits` is separate so
the caller picks which rows need logits.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from cluster.models.attention import KVShape, attention
from cluster.models.layers import (
    RMSNorm,
    Rope,
    RotaryEmbedding,
    apply_rope,
    rope_parameters,
    silu_and_mul,
)
from cluster.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    ParallelState,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from cluster.parallel.pipeline import StageActivations, stage_layer_range


def head_dim_of(config: Any) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        state: ParallelState,
        dtype: torch.dtype,
        input_size: int | None = None,  # EAGLE-3 feeds [embedding, hidden]: 2 * hidden_size
        qkv_bias: bool | None = None,  # None: the config's `attention_bias` (o_proj's too)
        o_bias: bool | None = None,
        qk_norm: bool = False,  # Qwen3: RMSNorm over each head of q and k before rope
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        num_kv_heads = int(
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        )
        self.qkv_proj = QKVParallelLinear(
            input_size or config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            num_kv_heads,
            state,
            bias if qkv_bias is None else qkv_bias,
            dtype,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            state,
            bias if o_bias is None else o_bias,
            dtype=dtype,
        )
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        theta, scaling = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, theta, scaling)
        self.scale = self.head_dim**-0.5

    @property
    def kv_shape(self) -> KVShape:  # an `AttentionLayer`
        return KVShape(self.qkv_proj.num_kv_heads, self.qkv_proj.head_dim)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return self.rotary_emb.cos_sin(positions, dtype)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, (heads + 2 * kv_heads) * head_dim] (local)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.qkv_proj.num_heads, self.head_dim)
        k = k.view(-1, self.qkv_proj.num_kv_heads, self.head_dim)
        v = v.view(-1, self.qkv_proj.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = apply_rope(q, k, rope)
        return self.o_proj(attention(q, k, v, self.layer_idx, self.scale))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: Any,
        state: ParallelState,
        dtype: torch.dtype,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        bias = bool(getattr(config, "mlp_bias", False))
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], state, bias, dtype
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, state, bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then MLP. Other families change the two factories."""

    def __init__(
        self, config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.self_attn = self.make_attention(config, layer_idx, state, dtype)
        self.mlp = self.make_mlp(config, layer_idx, state, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    @staticmethod
    def make_attention(
        config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> LlamaAttention:
        return LlamaAttention(config, layer_idx, state, dtype)

    @staticmethod
    def make_mlp(
        config: Any, layer_idx: int, state: ParallelState, dtype: torch.dtype
    ) -> nn.Module:
        return LlamaMLP(config, state, dtype)

    def forward(
        self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder layers of this pipeline stage. Layers of other stages are `nn.Identity`
    placeholders so parameter names keep the checkpoint's global layer indices; the
    embedding lives on the first stage, the final norm on the last."""

    def __init__(
        self,
        config: Any,
        state: ParallelState,
        dtype: torch.dtype,
        layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer,
        norm_cls: type[nn.Module] = RMSNorm,
    ) -> None:
        super().__init__()
        self.config = config
        self.state = state
        self.dtype = dtype
        num_layers = int(config.num_hidden_layers)
        self.start_layer, self.end_layer = stage_layer_range(num_layers, state)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if state.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, state, dtype
            )
        self.layers = nn.ModuleList(
            layer_cls(config, i, state, dtype)
            if self.start_layer <= i < self.end_layer
            else nn.Identity()
            for i in range(num_layers)
        )
        self.norm = (
            norm_cls(config.hidden_size, config.rms_norm_eps, dtype)
            if state.is_last_stage
            else None
        )

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope | None:
        """The step's rotation, from this stage's first attention layer (None: the stage
        has only recurrent layers)."""
        for idx in range(self.start_layer, self.end_layer):
            attn = getattr(self.layers[idx], "self_attn", None)
            if attn is not None:
                return attn.rope(positions, dtype)
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        aux_hidden_layers: tuple[int, ...] = (),
        intermediate: StageActivations | None = None,
    ) -> StageActivations | tuple[torch.Tensor, list[torch.Tensor]]:
        """First stage: from `input_ids`; later stages: from the previous stage's
        `intermediate`. Last stage: (final-norm hidden, aux); others: `StageActivations`."""
        if intermediate is None:
            assert self.embed_tokens is not None, "only the first stage embeds tokens"
            hidden, residual = self.embed_tokens(input_ids), None  # [num_tokens, hidden]
            aux: list[torch.Tensor] = []
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
            aux = list(intermediate.aux)
        rope = self.rope(positions, hidden.dtype)
        for idx in range(self.start_layer, self.end_layer):
            if idx in aux_hidden_layers:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = self.layers[idx](rope, hidden, residual)
        assert residual is not None  # every stage has at least one layer
        if self.norm is None:
            return StageActivations(hidden, residual, aux)
        hidden, _ = self.norm(hidden, residual)
        return hidden, aux


class LlamaForCausalLM(nn.Module):
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer
    norm_cls: ClassVar[type[nn.Module]] = RMSNorm  # the final norm's (and an MTP's norms)
    # The checkpoint tensor of the token embedding (a draft on the last stage may need it).
    embedding_checkpoint_name = "model.embed_tokens.weight"

    # checkpoint name piece -> (our parameter name piece, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint tensors that carry no parameters
    ignored_checkpoint_tensors = ("rotary_emb.inv_freq",)

    def __init__(
        self, config: Any, state: ParallelState, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.config = config
        self.state = state
        self.model = LlamaModel(config, state, dtype, self.decoder_layer_cls, self.norm_cls)
        self.lm_head: ParallelLMHead | None = None
        if state.is_last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, state, dtype=dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        embed = self.model.embed_tokens
        if self.tie_word_embeddings and self.lm_head is not None and embed is not None:
            self.lm_head.tie_to(embed)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        aux_hidden_layers: tuple[int, ...] = (),
        intermediate: StageActivations | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]] | StageActivations:
        """input_ids, positions: [num_tokens] -> final-norm hidden [num_tokens, hidden],
        inside `attention_context(meta)` for the step's batch.

        With `aux_hidden_layers`, also returns the residual stream entering each of those
        layers (transformers' `hidden_states[i]`), in the given layer order. A stage that
        is not the last returns the `StageActivations` for the next one instead.
        """
        out = self.model(input_ids, positions, tuple(aux_hidden_layers), intermediate)
        if isinstance(out, StageActivations):
            return out
        hidden, aux = out
        if not aux_hidden_layers:
            return hidden
        order = sorted(set(aux_hidden_layers))  # the model collects each layer once
        return hidden, [aux[order.index(i)] for i in aux_hidden_layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32 logits, gathered on every TP rank (last stage).
        The product runs in the model dtype; from its result on, sampling and verification
        work in float32."""
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        return self.lm_head(hidden).float()

    def map_checkpoint_name(self, name: str) -> str | None:
        """Checkpoint name -> parameter name on this stage; None for other stages' tensors.
        A tied last stage without the embedding reads its LM head from the embedding."""
        if name.startswith("model.layers."):
            idx = int(name.split(".")[2])
            return name if self.model.start_layer <= idx < self.model.end_layer else None
        if name.startswith("model.embed_tokens."):
            if self.model.embed_tokens is not None:
                return name
            if self.tie_word_embeddings and self.lm_head is not None:
                return name.replace("model.embed_tokens.", "lm_head.")
            return None
        if name.startswith("model.norm."):
            return name if self.model.norm is not None else None
        if name.startswith("lm_head."):
            return name if self.lm_head is not None else None
        return name

    def embedding_for_draft(self) -> VocabParallelEmbedding:
        """The token embedding, created on a last stage that lacks it: shared with a tied
        LM head, otherwise returned empty for the caller to load."""
        if self.model.embed_tokens is None:
            embed = VocabParallelEmbedding(
                self.config.vocab_size, self.config.hidden_size, self.state, self.model.dtype
            ).to(self.state.device)
            if self.tie_word_embeddings and self.lm_head is not None:
                embed.weight = self.lm_head.weight
            self.model.embed_tokens = embed
        return self.model.embed_tokens
