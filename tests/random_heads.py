"""Random (untrained) draft checkpoints in the layouts public checkpoints use.

For plumbing tests and overhead benchmarks: speculation must stay lossless with any
draft, and a random head measures what drafting costs when nothing is accepted.

EAGLE (`fc.weight`, `layers.N.*`), the normalised-fusion EAGLE (`enorm`, `hnorm`,
`eh_proj`, `layers.0.*`, `norm`), EAGLE-3 (`fc.weight` [H, 3H], `midlayer.*`, `norm`,
`lm_head` over `draft_vocab_size`, `d2t`, `t2d`), MTP heads inside a copy of the target
checkpoint (DeepSeek: `model.layers.{L+i}.{enorm,hnorm,eh_proj,shared_head.*}` plus the
block, a perturbed copy of the target's last layer unless the target is Llama;
Qwen3-Next: `mtp.*`), and a separate small draft LM.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def _cfg(target_path: str) -> dict[str, Any]:
    with open(os.path.join(target_path, "config.json")) as f:
        return json.load(f)


def _layer(
    prefix: str,
    cfg: dict[str, Any],
    g: torch.Generator,
    qkv_in: int | None = None,
    input_norm: bool = True,
) -> dict[str, torch.Tensor]:
    """Llama decoder-layer tensors (HF names) under `prefix`."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
    )
    d = cfg.get("head_dim") or h // heads
    qkv_in = qkv_in or h

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * (1.0 / shape[-1] ** 0.5)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=g)

    out = {
        f"{prefix}self_attn.q_proj.weight": w(heads * d, qkv_in),
        f"{prefix}self_attn.k_proj.weight": w(kv * d, qkv_in),
        f"{prefix}self_attn.v_proj.weight": w(kv * d, qkv_in),
        f"{prefix}self_attn.o_proj.weight": w(h, heads * d),
        f"{prefix}mlp.gate_proj.weight": w(inter, h),
        f"{prefix}mlp.up_proj.weight": w(inter, h),
        f"{prefix}mlp.down_proj.weight": w(h, inter),
        f"{prefix}post_attention_layernorm.weight": norm(),
    }
    if input_norm:
        out[f"{prefix}input_layernorm.weight"] = norm()
    return out


def _norm(h: int, g: torch.Generator) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(h, generator=g)


def _write(
    path: str,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    name: str = "model.safetensors",
) -> str:
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, name))
    # (a target's per-layer list would not match the head's own layer count)
    config = {k: v for k, v in config.items() if k != "layer_types"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def write_eagle(path: str, target_path: str, seed: int = 0, num_layers: int = 1) -> str:
    cfg, g = _cfg(target_path), torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    tensors = {"fc.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5}
    for i in range(num_layers):
        tensors |= _layer(f"layers.{i}.", cfg, g, input_norm=i > 0)
    config = {**cfg, "architectures": ["EagleLlamaForCausalLM"], "num_hidden_layers": num_layers}
    return _write(path, tensors, config)


def write_eagle_norm_fusion(path: str, target_path: str, seed: int = 0) -> str:
    cfg, g = _cfg(target_path), torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    tensors = {
        "enorm.weight": _norm(h, g),
        "hnorm.weight": _norm(h, g),
        "eh_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
        "norm.weight": _norm(h, g),
        **_layer("layers.0.", cfg, g),
    }
    return _write(
        path, tensors, {**cfg, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    )


def write_eagle3(path: str, target_path: str, draft_vocab_size: int, seed: int = 0) -> str:
    """`d2t` maps draft id i to target id i + d2t[i]: here a random increasing subset."""
    cfg, g = _cfg(target_path), torch.Generator().manual_seed(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    targets = torch.randperm(vocab, generator=g)[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    tensors = {
        "fc.weight": torch.randn(h, 3 * h, generator=g) / (3 * h) ** 0.5,
        "norm.weight": _norm(h, g),
        "lm_head.weight": torch.randn(draft_vocab_size, h, generator=g) / h**0.5,
        "d2t": targets - torch.arange(draft_vocab_size),
        "t2d": t2d,
        "midlayer.hidden_norm.weight": _norm(h, g),
        **_layer("midlayer.", cfg, g, qkv_in=2 * h),
    }
    config = {
        **cfg,
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": h,
    }
    return _write(path, tensors, config)


def _with_target(
    path: str, target_path: str, extra: dict[str, torch.Tensor], config_update: dict[str, Any]
) -> str:
    """A folder holding the target's checkpoint (linked) plus `extra` tensors in a second file."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(target_path):
        if name != "config.json":
            os.symlink(os.path.join(target_path, name), os.path.join(path, name))
    return _write(path, extra, {**_cfg(target_path), **config_update}, name="mtp.safetensors")


def _target_block(target_path: str, layer: int, prefix: str, g: torch.Generator) -> dict:
    """The target's decoder layer `layer`, slightly perturbed, under `prefix`: a block of
    the target's own architecture (DeepSeek-V3's MTP block is MLA + MoE)."""
    source = f"model.layers.{layer}."
    block = {}
    for file in sorted(glob.glob(os.path.join(target_path, "*.safetensors"))):
        for name, t in load_file(file).items():
            if name.startswith(source):
                noise = 0.01 * torch.randn(t.shape, generator=g) if t.is_floating_point() else 0
                block[prefix + name[len(source) :]] = t + noise
    return block


def write_deepseek_mtp(path: str, target_path: str, num_layers: int = 2, seed: int = 0) -> str:
    cfg, g = _cfg(target_path), torch.Generator().manual_seed(seed)
    h, first = cfg["hidden_size"], cfg["num_hidden_layers"]
    llama = cfg.get("architectures") == ["LlamaForCausalLM"]
    extra: dict[str, torch.Tensor] = {}
    for i in range(first, first + num_layers):
        p = f"model.layers.{i}."
        extra |= {
            p + "enorm.weight": _norm(h, g),
            p + "hnorm.weight": _norm(h, g),
            p + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
            p + "shared_head.norm.weight": _norm(h, g),
            **(_layer(p, cfg, g) if llama else _target_block(target_path, first - 1, p, g)),
        }
    return _with_target(path, target_path, extra, {"num_nextn_predict_layers": num_layers})


def write_qwen3_next_mtp(path: str, target_path: str, num_layers: int = 1, seed: int = 0) -> str:
    cfg, g = _cfg(target_path), torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    extra = {
        "mtp.pre_fc_norm_embedding.weight": _norm(h, g),
        "mtp.pre_fc_norm_hidden.weight": _norm(h, g),
        "mtp.fc.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
        "mtp.norm.weight": _norm(h, g),
    }
    for i in range(num_layers):
        prefix = f"mtp.layers.{i}."
        if cfg.get("architectures") == ["Qwen3NextForCausalLM"]:
            # a gated full-attention layer with the target's MLP kind (MoE or dense)
            extra |= _target_block(target_path, _qwen3_next_template(cfg, i), prefix, g)
        else:
            extra |= _layer(prefix, cfg, g)
    return _with_target(path, target_path, extra, {"num_nextn_predict_layers": num_layers})


def _qwen3_next_template(cfg: dict[str, Any], mtp_index: int) -> int:
    """A full-attention target layer whose MLP is of the kind MTP layer `mtp_index` has
    (MoE unless `mlp_only_layers` / `decoder_sparse_step` say dense; MTP layers count
    from 0)."""

    def sparse(i: int) -> bool:
        return (
            i not in (cfg.get("mlp_only_layers") or [])
            and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0
        )

    for i in reversed(range(cfg["num_hidden_layers"])):
        if cfg["layer_types"][i] == "full_attention" and sparse(i) == sparse(mtp_index):
            return i
    raise ValueError("the target has no full-attention layer to base an MTP layer on")


def write_draft_lm(path: str, target_path: str, seed: int = 0) -> str:
    """A 1-layer random Llama with the target's vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = _cfg(target_path)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def write_all(root: str, target_path: str, seed: int = 0) -> dict[str, dict[str, Any]]:
    """name -> speculative_config (without num_speculative_tokens) for every draft kind."""
    vocab = _cfg(target_path)["vocab_size"]
    return {
        "eagle": {"method": "eagle", "model": write_eagle(f"{root}/eagle", target_path, seed)},
        "eagle_norm_fusion": {
            "model": write_eagle_norm_fusion(f"{root}/eagle_nf", target_path, seed)
        },
        "eagle3": {
            "method": "eagle3",
            "model": write_eagle3(f"{root}/eagle3", target_path, max(2, vocab // 4), seed),
        },
        "mtp_deepseek": {
            "method": "mtp",
            "model": write_deepseek_mtp(f"{root}/mtp_ds", target_path, seed=seed),
        },
        "mtp_qwen3_next": {
            "method": "mtp",
            "model": write_qwen3_next_mtp(f"{root}/mtp_qn", target_path, seed=seed),
        },
        # any re-occurring token drafts (vLLM's default window is 5..5)
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4},
        "draft_model": {
            "method": "draft_model",
            "model": write_draft_lm(f"{root}/draft_lm", target_path, seed),
        },
    }
