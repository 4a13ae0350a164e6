"""What one rank of a layout holds, counted from a model's `config.json` with the shapes
our model classes build (`cluster.models.llama`, `qwen`, `deepseek`, `qwen3_next`).

Tensor parallelism splits the heads, the MLPs, every expert's intermediate dimension and
the vocabulary; replicated pieces (norms, routers, MLA's latent projections, KV heads when
the TP size exceeds them) count whole on every rank; pipeline stages hold their own
layers, the first the embedding and the last the final norm and LM head. Linear weights
and experts are kept apart from the rest: an FP8 checkpoint stores them as FP8 with block
scales (MLA's `kv_b_proj`, read as a matrix, stays in the model dtype).
`tests/test_memory_plan.py` checks these counts against a meta-device instantiation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cluster.config import stage_layer_counts
from cluster.config.architectures import architecture_of

# Linear weight shapes on one rank: (rows, cols, how many such matrices).
Linear = tuple[int, int, int]


@dataclass(frozen=True)
class RankWeights:
    """The parameters one rank holds, by how they are stored."""

    linears: tuple[Linear, ...]  # FP8-able matrices (FP8 checkpoints store these as FP8)
    other: int  # elements in the model dtype (embeddings, norms, LM head, conv, ...)
    float32: int  # elements kept in float32 whatever the dtype (DeepSeek's router)

    def num_bytes(self, dtype_bytes: int, fp8_block: tuple[int, int] | None) -> int:
        if fp8_block is None:
            matrices = sum(r * c * n for r, c, n in self.linears) * dtype_bytes
        else:
            br, bc = fp8_block
            matrices = sum(
                (r * c + 4 * math.ceil(r / br) * math.ceil(c / bc)) * n for r, c, n in self.linears
            )
        return matrices + self.other * dtype_bytes + self.float32 * 4


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, None)
    return default if value is None else value


def _local_kv_heads(num_kv_heads: int, tp: int) -> int:
    return num_kv_heads // tp if num_kv_heads % tp == 0 else 1


def _mlp(config: Any, inter: int, tp: int) -> tuple[list[Linear], int]:
    """(gate_up_proj and down_proj, bias elements) of a SiLU-gated MLP on one rank."""
    hidden = int(config.hidden_size)
    bias = 2 * (inter // tp) + hidden if _get(config, "mlp_bias", False) else 0
    return [(2 * (inter // tp), hidden, 1), (hidden, inter // tp, 1)], bias


def _experts(config: Any, hidden: int, tp: int, num_experts: int) -> Iterator[Linear]:
    inter = int(config.moe_intermediate_size) // tp
    yield (2 * inter, hidden, num_experts)  # w13
    yield (hidden, inter, num_experts)  # w2


def _is_sparse(config: Any, index: int) -> bool:
    return (
        index not in (_get(config, "mlp_only_layers", []))
        and int(_get(config, "num_experts", 0)) > 0
        and (index + 1) % int(_get(config, "decoder_sparse_step", 1)) == 0
    )


def _layer(config: Any, arch: str, index: int, tp: int) -> tuple[list[Linear], int, int, int]:
    """(linears, other elements, float32 elements, KV elements per token) of decoder
    layer `index` on one TP rank."""
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(_get(config, "num_key_value_heads", heads))
    head_dim = int(_get(config, "head_dim", hidden // heads))
    linears: list[Linear] = []
    other, f32, kv = 2 * hidden, 0, 0  # the two layer norms
    if arch == "DeepseekV3ForCausalLM":
        nope, rope = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        v_dim, kv_rank = int(config.v_head_dim), int(config.kv_lora_rank)
        q_rank = _get(config, "q_lora_rank")
        if q_rank:
            linears += [(int(q_rank), hidden, 1), (heads // tp * (nope + rope), int(q_rank), 1)]
            other += int(q_rank)
        else:
            linears.append((heads // tp * (nope + rope), hidden, 1))
        linears += [(kv_rank + rope, hidden, 1), (hidden, heads // tp * v_dim, 1)]
        # kv_b_proj is read as a matrix (absorbed into queries and outputs): never FP8
        other += kv_rank + heads // tp * (nope + v_dim) * kv_rank
        kv = kv_rank + rope  # the latent and the rope key, stored once
        if index >= int(config.first_k_dense_replace):
            experts = int(config.n_routed_experts)
            linears += list(_experts(config, hidden, tp, experts))
            f32 += experts * hidden + experts  # router and its correction bias
            shared = int(_get(config, "n_shared_experts", 0))
            inter = int(config.moe_intermediate_size) * shared
        else:
            inter = int(config.intermediate_size)
        if inter:
            mlp, bias = _mlp(config, inter, tp)
            linears, other = linears + mlp, other + bias
        return linears, other, f32, kv
    types = _get(config, "layer_types", [])
    if index < len(types) and types[index] == "linear_attention":
        k_heads = int(config.linear_num_key_heads) // tp
        v_heads = int(config.linear_num_value_heads) // tp
        key_dim = k_heads * int(config.linear_key_head_dim)
        value_dim = v_heads * int(config.linear_value_head_dim)
        linears += [
            (2 * key_dim + 2 * value_dim, hidden, 1),  # in_proj_qkvz
            (2 * v_heads, hidden, 1),  # in_proj_ba
            (hidden, value_dim, 1),  # out_proj
        ]
        conv = (2 * key_dim + value_dim) * int(config.linear_conv_kernel_dim)
        other += conv + 2 * v_heads + int(config.linear_value_head_dim)
    else:
        q_heads = 2 * heads if arch == "Qwen3NextForCausalLM" else heads  # query + gate
        local_kv = _local_kv_heads(kv_heads, tp)
        rows = (q_heads // tp + 2 * local_kv) * head_dim
        linears += [(rows, hidden, 1), (hidden, heads // tp * head_dim, 1)]
        if arch == "Qwen2ForCausalLM" or _get(config, "attention_bias", False):
            other += rows + (hidden if _get(config, "attention_bias", False) else 0)
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"):
            other += 2 * head_dim  # q_norm, k_norm
        kv = 2 * local_kv * head_dim
    if arch in ("Qwen3MoeForCausalLM", "Qwen3NextForCausalLM") and _is_sparse(config, index):
        experts = int(config.num_experts)
        linears += list(_experts(config, hidden, tp, experts))
        other += experts * hidden  # router
        inter = 0
        if arch == "Qwen3NextForCausalLM":
            inter = int(config.shared_expert_intermediate_size)
            other += hidden  # shared_expert_gate
    else:
        inter = int(config.intermediate_size)
    if inter:
        mlp, bias = _mlp(config, inter, tp)
        linears, other = linears + mlp, other + bias
    return linears, other, f32, kv


def stage_weights(
    config: Any,
    tp: int,
    pp: int,
    pp_rank: int,
    partition: tuple[int, ...] | None = None,
    mtp_layers: int = 0,
) -> tuple[RankWeights, int, tuple[int, int]]:
    """(one TP rank's weights, its KV elements per token, its layer range) on stage
    `pp_rank`; the last stage also holds `mtp_layers` multi-token-prediction layers (the
    checkpoint's own draft, loaded with MTP speculation)."""
    arch = architecture_of(config)
    num_layers = int(config.num_hidden_layers)
    counts = stage_layer_counts(num_layers, pp, partition)
    start = sum(counts[:pp_rank])
    end = start + counts[pp_rank]
    linears: list[Linear] = []
    other = f32 = kv = 0
    hidden = int(config.hidden_size)
    draft = range(num_layers, num_layers + mtp_layers) if pp_rank == pp - 1 else range(0)
    for index in [*range(start, end), *draft]:
        lin, oth, f, k = _layer(config, arch, index, tp)
        linears += lin
        other, f32, kv = other + oth, f32 + f, kv + k
    if draft and arch == "Qwen3NextForCausalLM":  # fc, its two input norms, a final norm
        linears.append((hidden // tp, 2 * hidden, 1))
        other += 3 * hidden
    elif draft:  # per layer: eh_proj, enorm, hnorm, shared_head.norm
        linears.append((hidden, 2 * hidden, len(draft)))
        other += 3 * hidden * len(draft)
    vocab_rows = -(-int(config.vocab_size) // tp)  # vocabulary padded to the TP size
    tied = bool(_get(config, "tie_word_embeddings", False))
    if pp_rank == 0:
        other += vocab_rows * hidden
    if pp_rank == pp - 1:
        other += hidden  # final norm
        if not tied or pp > 1:  # tied on one stage: the embedding is the LM head
            other += vocab_rows * hidden
    return RankWeights(tuple(linears), other, f32), kv, (start, end)


def state_bytes_per_request(config: Any, tp: int, layers: tuple[int, int], dtype_bytes: int) -> int:
    """A hybrid model's recurrent states of one request on this stage (conv + delta)."""
    if architecture_of(config) != "Qwen3NextForCausalLM":
        return 0
    k_heads = int(config.linear_num_key_heads) // tp
    v_heads = int(config.linear_num_value_heads) // tp
    dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
    conv_dim = 2 * k_heads * dk + v_heads * dv
    per_layer = (int(config.linear_conv_kernel_dim) - 1) * conv_dim * dtype_bytes
    per_layer += v_heads * dk * dv * 4  # float32 state
    linear = sum(config.layer_types[i] == "linear_attention" for i in range(*layers))
    return linear * per_layer
