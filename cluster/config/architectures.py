"""The target architectures `cluster` serves, and the checks a checkpoint's config must
pass before any process, actor or placement group starts (`EngineConfig` runs them).

Each name is written once, here, with the `cluster.models` module whose class of that name
implements it; `cluster.models.registry` imports the class from there. This module knows
only names and what each config must satisfy.
"""

from __future__ import annotations

from typing import Any

# Hugging Face `architectures` names we serve -> the module of `cluster.models` that holds
# the class of the same name.
TARGET_ARCHITECTURES: dict[str, str] = {
    "DeepseekV3ForCausalLM": "deepseek",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "qwen",
    "Qwen2ForCausalLM": "qwen",
    "Qwen3ForCausalLM": "qwen",
    "Qwen3MoeForCausalLM": "qwen",
    "Qwen3NextForCausalLM": "qwen3_next",
}
# Architectures with recurrent (linear-attention) layers: their per-request state cannot
# be rebuilt from cached KV blocks, so they run without prefix caching.
RECURRENT_ARCHITECTURES = ("Qwen3NextForCausalLM",)
# `rope_type`s whose frequencies `cluster.models.layers` computes (transformers' formulas).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def architecture_of(hf_config: Any) -> str:
    """The first of the config's `architectures` that is served; ValueError otherwise."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in TARGET_ARCHITECTURES:
            return name
    raise ValueError(
        f"architectures={names} are not supported (supported: {list(TARGET_ARCHITECTURES)})"
    )


def has_recurrent_layers(hf_config: Any) -> bool:
    return architecture_of(hf_config) in RECURRENT_ARCHITECTURES


def rope_type_of(hf_config: Any) -> str:
    """The config's rope type (old `rope_scaling` or new `rope_parameters` style)."""
    params = {
        **dict(getattr(hf_config, "rope_scaling", None) or {}),
        **dict(getattr(hf_config, "rope_parameters", None) or {}),
    }
    return str(params.get("rope_type", params.get("type", "default")))


def sliding_window_of(hf_config: Any) -> int | None:
    """The attention window of the config's sliding-window layers; None when every layer
    attends to the whole sequence."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def _divides(tp: int, value: int, name: str) -> None:
    if value % tp:
        allowed = [n for n in range(1, value + 1) if value % n == 0]
        raise ValueError(
            f"parallel.tensor_parallel_size={tp} must divide the model's {name}={value} "
            f"(allowed: {allowed})"
        )


def check_target_config(hf_config: Any, tensor_parallel_size: int, max_model_len: int) -> None:
    """Architecture, rope type, activation, sliding window and TP divisibility; each
    failure is a ValueError naming the field and what is allowed."""
    arch = architecture_of(hf_config)
    rope_type = rope_type_of(hf_config)
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported (supported: {list(ROPE_TYPES)})"
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
    window = sliding_window_of(hf_config)
    if window is not None and window < max_model_len:
        raise ValueError(
            f"the model attends through a sliding window of {window} tokens, which cluster "
            f"does not implement; set model.max_model_len <= {window} (within the window "
            "attention is exact)"
        )
    quant = getattr(hf_config, "quantization_config", None)
    if quant is not None:
        quant = quant if isinstance(quant, dict) else quant.to_dict()
        if quant.get("quant_method") != "fp8":
            raise ValueError(
                f"quantization_config.quant_method={quant.get('quant_method')!r} is not "
                "supported (only 'fp8' with block scales, dequantised at load)"
            )
    tp = tensor_parallel_size
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    _divides(tp, num_heads, "num_attention_heads")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"parallel.tensor_parallel_size={tp} must divide the model's "
            f"num_key_value_heads={num_kv_heads} or be a multiple of it"
        )
    _divides(tp, int(hf_config.intermediate_size), "intermediate_size")
    if arch in ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "Qwen3NextForCausalLM"):
        _divides(tp, int(hf_config.moe_intermediate_size), "moe_intermediate_size")
    if arch == "Qwen3NextForCausalLM":
        for name in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "shared_expert_intermediate_size",
        ):
            _divides(tp, int(getattr(hf_config, name)), name)
    if arch == "DeepseekV3ForCausalLM" and int(hf_config.n_routed_experts) % int(hf_config.n_group):
        raise ValueError(
            f"n_routed_experts={hf_config.n_routed_experts} must be a multiple of "
            f"n_group={hf_config.n_group}"
        )


def num_routed_experts(hf_config: Any) -> int:
    """The routed experts of an MoE config (0 for a dense one)."""
    return int(getattr(hf_config, "n_routed_experts", None) or getattr(hf_config, "num_experts", 0))


def check_expert_parallel(hf_config: Any, tensor_parallel_size: int, ep: int) -> None:
    """Expert parallelism spreads whole experts over one stage's TP ranks."""
    if ep == 1:
        return
    if ep != tensor_parallel_size:
        raise ValueError(
            f"parallel.expert_parallel_size={ep} must be 1 or tensor_parallel_size="
            f"{tensor_parallel_size} (the experts are spread over one stage's TP ranks)"
        )
    experts = num_routed_experts(hf_config)
    if experts == 0:
        raise ValueError(
            f"parallel.expert_parallel_size={ep} needs a mixture-of-experts model; "
            f"{architecture_of(hf_config)} has no routed experts"
        )
    if experts % ep:
        raise ValueError(
            f"parallel.expert_parallel_size={ep} must divide the model's {experts} experts"
        )
