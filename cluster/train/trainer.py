"""Training an EAGLE-3 head on cached target features (the loop: `cluster/train/loop.py`).

Reduced draft vocabulary: the `draft_vocab_size` most frequent answer tokens (`d2t` maps
draft id i to target id i + d2t[i]; `t2d` marks target ids in the draft vocabulary).
Loss: cross-entropy of every TTT step's logits against the target's own next tokens (the
data are the target's greedy answers), weighted 0.8^step; positions whose label lies
outside the draft vocabulary or the answer have no loss (the former count as misses in
the accuracy). Deterministic given the seed; checkpoints and resumes as `fit` does.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from cluster.train.eagle3_model import Eagle3Trainable
from cluster.train.loop import (
    NO_LABEL,
    OUT_OF_VOCAB,
    Batch,
    StepCounts,
    StepFn,
    TrainConfig,
    fit,
    load_shards,
    loss_labels,
    make_batches,
)

__all__ = [
    "TrainConfig",
    "draft_classes",
    "draft_vocabulary",
    "eagle3_step",
    "export_eagle3",
    "import_eagle3",
    "load_shards",
    "make_batches",
    "save_state",
    "train_eagle3",
    "write_head_config",
]


def draft_vocabulary(
    sequences: list[dict[str, Any]], size: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [size] int64, t2d [vocab] bool) from the answer tokens' frequencies."""
    counts = Counter(t for s in sequences for t in s["token_ids"][s["answer_start"] :])
    ranked = [t for t, _ in counts.most_common(size)]
    ranked += [t for t in range(vocab_size) if t not in counts][: size - len(ranked)]
    targets = torch.tensor(sorted(ranked[:size]), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[targets] = True
    return targets - torch.arange(len(targets)), t2d


def draft_classes(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab] the draft id of every target id (OUT_OF_VOCAB for ids the head lacks): the
    label map of `collate`."""
    classes = torch.full((vocab_size,), OUT_OF_VOCAB, dtype=torch.int64)
    classes[torch.arange(len(d2t)) + d2t] = torch.arange(len(d2t))
    return classes


def eagle3_step(model: torch.nn.Module, config: TrainConfig, window: bool = True) -> StepFn:
    """The EAGLE-3 `StepFn`: weighted cross-entropy of every TTT step (draft vocabulary).
    `window`: compute only rows with labels (prompt rows give keys only); False computes
    every row, the reference the training benchmark times it against."""

    def step(batch: Batch) -> tuple[torch.Tensor, StepCounts]:
        anchors, labels = batch.window() if window else (None, batch.labels)
        outputs = model(batch.ids, batch.features, batch.valid, config.ttt_steps, anchors)
        total = 0.0
        for j, (logits, lab) in enumerate(zip(outputs, labels, strict=True)):
            total = total + config.step_weight**j * F.cross_entropy(
                logits.flatten(0, 1), loss_labels(lab).flatten(), ignore_index=NO_LABEL
            )
        return total, StepCounts.of([out.argmax(-1) for out in outputs], labels)

    return step


def train_eagle3(
    target_config: Any,
    embed_weight: torch.Tensor,  # [vocab, hidden] the target's embedding (= LM head when tied)
    head_weight: torch.Tensor,  # [vocab, hidden] the target's LM head
    train_dir: str | list[str],  # feature folders (`feature_store`)
    eval_dir: str | list[str] | None,
    out_dir: str,
    config: TrainConfig,
    checkpoint_dir: str | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    torch.manual_seed(config.seed)
    train = load_shards(train_dir)
    evals = load_shards(eval_dir) if eval_dir else []
    vocab = int(target_config.vocab_size)
    d2t, t2d = draft_vocabulary(train, config.draft_vocab_size, vocab)
    draft_ids = torch.arange(len(d2t)) + d2t  # target id of each draft id
    model = Eagle3Trainable(target_config, len(d2t), embed_weight)
    with torch.no_grad():
        model.lm_head.weight.copy_(head_weight[draft_ids])  # start from the target's head rows
    model.lm_head.weight.requires_grad_(not config.freeze_lm_head)
    os.makedirs(out_dir, exist_ok=True)
    checkpoint = os.path.join(checkpoint_dir or out_dir, "train_state.pt")
    runner = torch.compile(model, dynamic=True) if config.compile else model
    history = fit(
        model,
        eagle3_step(runner, config),
        train,
        evals,
        draft_classes(d2t, vocab),
        config,
        checkpoint,
        resume,
    )
    export_eagle3(model, target_config, d2t, t2d, out_dir)
    return {"history": history, "draft_vocab_size": len(d2t)}


def write_head_config(target_config: Any, out_dir: str, **updates: Any) -> None:
    """`config.json`: the target's config (less loader-irrelevant keys) with `updates`."""
    config = target_config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    config.update(updates)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def save_state(state: dict[str, torch.Tensor], path: str, dtype: torch.dtype) -> None:
    """Floating tensors in `dtype`, others as they are, to one safetensors file."""
    state = {k: (v.to(dtype) if v.is_floating_point() else v).cpu() for k, v in state.items()}
    save_file(state, path)


def export_eagle3(
    model: Eagle3Trainable,
    target_config: Any,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    out_dir: str,
    dtype: torch.dtype = torch.float16,
) -> None:
    """Write `model.safetensors` + `config.json` in the public EAGLE-3 layout (weights in
    `dtype`, float16 by default to keep shipped heads small)."""
    save_state(model.export_state(d2t, t2d), os.path.join(out_dir, "model.safetensors"), dtype)
    write_head_config(
        target_config,
        out_dir,
        architectures=["LlamaForCausalLMEagle3"],
        num_hidden_layers=1,
        draft_vocab_size=len(d2t),
        target_hidden_size=int(target_config.hidden_size),
        tie_word_embeddings=False,
    )


def import_eagle3(
    head_dir: str, target_config: Any, embed_weight: torch.Tensor
) -> tuple[Eagle3Trainable, torch.Tensor]:
    """(the trainable head, d2t) of an exported head (`export_eagle3`), in float32: to
    measure a shipped head the way training does, or to train it further."""
    state = load_file(os.path.join(head_dir, "model.safetensors"))
    d2t = state.pop("d2t")
    state.pop("t2d", None)
    model = Eagle3Trainable(target_config, len(d2t), embed_weight)
    missing, unexpected = model.load_state_dict(
        {k: v.float() for k, v in state.items()}, strict=False
    )
    if unexpected or [k for k in missing if not k.startswith("embed.")]:
        raise ValueError(f"{head_dir}: not an EAGLE-3 head of this shape ({missing, unexpected})")
    return model, d2t
