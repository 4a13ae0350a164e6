"""Tiny random checkpoints written by the tests (transformers config + save_pretrained):
Llama variants, one config per other served family (`FAMILIES`), and FP8 block-scaled
copies of a checkpoint as DeepSeek-V3 stores them (`write_fp8_copy`)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

BASE = dict(
    vocab_size=251,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

# Named variants covering what the parity tests must cover.
VARIANTS: dict[str, dict[str, Any]] = {
    "gqa_untied_odd_vocab": {},
    "tied_mha": dict(num_key_value_heads=4, tie_word_embeddings=True, vocab_size=256),
    "llama3_rope": dict(
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=128,
        ),
    ),
    "one_kv_head_bias": dict(
        num_key_value_heads=1, attention_bias=True, mlp_bias=True, vocab_size=257
    ),
}


# name -> (transformers architecture, config overrides): one tiny config per family,
# covering what sets it apart (biases, q/k norms, head_dim != hidden / heads, YaRN, MoE).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2ForCausalLM", dict(vocab_size=256)),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=24, attention_bias=False)),
    "qwen3_yarn_bias": (
        "Qwen3ForCausalLM",
        dict(
            attention_bias=True,
            rope_parameters=dict(
                rope_type="yarn", factor=4.0, original_max_position_embeddings=128, rope_theta=1e4
            ),
        ),
    ),
    "mistral": ("MistralForCausalLM", dict(sliding_window=None, head_dim=32)),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=12,
        ),
    ),
    "deepseek_v3_yarn_no_q_lora": (
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            moe_intermediate_size=16,
            n_routed_experts=4,
            n_shared_experts=2,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            first_k_dense_replace=2,
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=128,
                mscale=1.0,
                mscale_all_dim=0.8,
                rope_theta=1e4,
            ),
        ),
    ),
    "qwen3_next": (
        "Qwen3NextForCausalLM",
        dict(
            num_hidden_layers=4,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            head_dim=16,
            partial_rotary_factor=0.25,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[2],
        ),
    ),
    "qwen3_moe_unnormed": (
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=False),
    ),
}


def make_tiny_llama(
    path: str, seed: int = 0, architecture: str = "LlamaForCausalLM", **overrides: Any
) -> Any:
    """Write a random tiny checkpoint of `architecture` (a transformers class name;
    Llama by default) to `path` (float32) and return the HF model."""
    torch.manual_seed(seed)
    model_cls = getattr(transformers, architecture)
    config_cls = LlamaConfig if model_cls is LlamaForCausalLM else model_cls.config_class
    config = config_cls(**{**BASE, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():  # random norms, so a wrong norm path cannot hide behind ones
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif "experts" in name or name.endswith("mlp.gate.weight"):  # decisive routing
                p.copy_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's routing correction
                b.copy_(torch.randn_like(b) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return model


def make_tiny_family(path: str, family: str, seed: int = 0, **overrides: Any) -> Any:
    architecture, family_overrides = FAMILIES[family]
    return make_tiny_llama(path, seed, architecture, **{**family_overrides, **overrides})


def hf_logits(model: Any, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """transformers' logits for each sequence alone: list of [len, vocab]."""
    with torch.no_grad():
        return [model(s[None]).logits[0] for s in seqs]


def make_tiny_chat_model(path: str, tokenizer_path: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny random Llama sharing the default model's tokenizer (vocab 49152), so the
    engine's text paths (chat template, detokenization, stop strings) run on it."""
    from transformers import AutoTokenizer

    overrides.setdefault("vocab_size", 49152)
    overrides.setdefault("eos_token_id", 2)
    model = make_tiny_llama(path, seed=seed, **overrides)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(path)
    return model


def quantize_fp8_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scale per block) as DeepSeek's checkpoints store them."""
    rows, cols = weight.shape
    scales = torch.zeros(-(-rows // block), -(-cols // block))
    quantized = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = weight[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scales[i, j] = part.abs().max() / 448.0
            quantized[i * block : (i + 1) * block, j * block : (j + 1) * block] = (
                part / scales[i, j]
            ).to(torch.float8_e4m3fn)
    return quantized, scales


def write_fp8_copy(path: str, folder: str, block: int) -> dict[str, torch.Tensor]:
    """Copy the checkpoint at `path` to `folder` with every projection and expert matrix
    stored as FP8 blocks of `block` x `block` plus `weight_scale_inv` (config:
    `quantization_config.quant_method: fp8`); returns its tensors dequantised (each
    element times its block's scale; the others as they were)."""
    from safetensors.torch import load_file, save_file

    out, dequantised = {}, {}
    for name, t in load_file(os.path.join(path, "model.safetensors")).items():
        if t.dim() == 2 and ("proj" in name or "experts" in name):
            q, scales = quantize_fp8_blocks(t, block)
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = q, scales
            rows = torch.arange(t.shape[0])[:, None] // block
            cols = torch.arange(t.shape[1])[None, :] // block
            dequantised[name] = q.float() * scales[rows, cols]
        else:
            out[name] = dequantised[name] = t
    shutil.copytree(path, folder)
    save_file(out, os.path.join(folder, "model.safetensors"))
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "weight_block_size": [block, block],
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
    }
    with open(config_path, "w") as f:
        json.dump(config, f)
    return dequantised
