"""Tiny random Llama checkpoints written by the tests (transformers config + save_pretrained)."""

from __future__ import annotations

import os
from typing import Any

import torch
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


def make_tiny_llama(path: str, seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """Write a random tiny Llama checkpoint to `path` (float32) and return the HF model."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**BASE, **overrides})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms, so a wrong norm path cannot hide behind ones
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return model


def hf_logits(model: LlamaForCausalLM, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """transformers' logits for each sequence alone: list of [len, vocab]."""
    with torch.no_grad():
        return [model(s[None]).logits[0] for s in seqs]


def make_tiny_chat_model(
    path: str, tokenizer_path: str, seed: int = 0, **overrides: Any
) -> LlamaForCausalLM:
    """A tiny random Llama sharing the default model's tokenizer (vocab 49152), so the
    engine's text paths (chat template, detokenization, stop strings) run on it."""
    from transformers import AutoTokenizer

    overrides.setdefault("vocab_size", 49152)
    overrides.setdefault("eos_token_id", 2)
    model = make_tiny_llama(path, seed=seed, **overrides)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(path)
    return model
