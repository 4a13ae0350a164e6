"""Training an EAGLE-3 head on cached target features.

Reduced draft vocabulary: the `draft_vocab_size` most frequent answer tokens (`d2t` maps
draft id i to target id i + d2t[i]; `t2d` marks target ids in the draft vocabulary).
Loss: cross-entropy of every TTT step's logits against the target's own next tokens (the
data are the target's greedy answers), weighted 0.8^step; positions whose label lies
outside the draft vocabulary or the answer are ignored. Deterministic given the seed;
checkpoints every epoch and resumes from the last one.
"""

from __future__ import annotations

import glob
import json
import math
import os
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from cluster.train.eagle3_model import Eagle3Trainable


@dataclass(frozen=True)
class TrainConfig:
    draft_vocab_size: int = 4096
    ttt_steps: int = 3
    epochs: int = 2
    lr: float = 1e-3
    batch_tokens: int = 4096
    seed: int = 0
    step_weight: float = 0.8


def load_shards(feature_dir: str) -> list[dict[str, Any]]:
    sequences = []
    for path in sorted(glob.glob(os.path.join(feature_dir, "shard_*.pt"))):
        shard = torch.load(path)
        for ids, start, feats in zip(
            shard["token_ids"], shard["answer_start"], shard["features"], strict=True
        ):
            sequences.append({"token_ids": ids, "answer_start": start, "features": feats})
    return sequences


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


def make_batches(
    sequences: list[dict[str, Any]], batch_tokens: int, rng: random.Random
) -> list[list[int]]:
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]["token_ids"]))
    batches, current, longest = [], [], 0
    for i in order:
        n = len(sequences[i]["token_ids"])
        if current and max(longest, n) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(
    sequences: list[dict[str, Any]], index: list[int], target_to_draft: torch.Tensor, steps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(ids [B, T], features [B, T, 3H], valid [B, T], labels per step [B, T] with -100)."""
    rows = [sequences[i] for i in index]
    length = max(len(r["token_ids"]) for r in rows)
    width = rows[0]["features"].shape[-1]
    ids = torch.zeros(len(rows), length, dtype=torch.int64)
    feats = torch.zeros(len(rows), length, width)
    valid = torch.zeros(len(rows), length, dtype=torch.bool)
    labels = [torch.full((len(rows), length), -100, dtype=torch.int64) for _ in range(steps)]
    for b, r in enumerate(rows):
        n = len(r["token_ids"])
        ids[b, :n] = torch.tensor(r["token_ids"])
        feats[b, :n] = r["features"].float()
        valid[b, :n] = True
        for step in range(steps):
            # row p predicts token p + 2 + step; keep answer tokens after the first
            first = max(0, r["answer_start"] + 1 - 2 - step)
            last = n - 2 - step
            if last > first:
                mapped = target_to_draft[ids[b, first + 2 + step : last + 2 + step]]
                labels[step][b, first:last] = mapped
    return ids, feats, valid, labels


def _loss(
    outputs: list[torch.Tensor], labels: list[torch.Tensor], weight: float
) -> tuple[torch.Tensor, list[float]]:
    total, accuracies = 0.0, []
    for step, (logits, lab) in enumerate(zip(outputs, labels, strict=True)):
        total = total + weight**step * F.cross_entropy(
            logits.flatten(0, 1), lab.flatten(), ignore_index=-100
        )
        mask = lab != -100
        accuracies.append(
            float((logits.argmax(-1)[mask] == lab[mask]).float().mean()) if mask.any() else 0.0
        )
    return total, accuracies


@torch.no_grad()
def evaluate(
    model: Eagle3Trainable, sequences, target_to_draft, config: TrainConfig
) -> list[float]:
    """Held-out top-1 accuracy of each TTT step (each step's acceptance, given the earlier ones)."""
    model.eval()
    hits = [0] * config.ttt_steps
    totals = [0] * config.ttt_steps
    for index in make_batches(sequences, config.batch_tokens, random.Random(0)):
        ids, feats, valid, labels = collate(sequences, index, target_to_draft, config.ttt_steps)
        for step, logits in enumerate(model(ids, feats, valid, config.ttt_steps)):
            mask = labels[step] != -100
            hits[step] += int((logits.argmax(-1)[mask] == labels[step][mask]).sum())
            totals[step] += int(mask.sum())
    model.train()
    return [h / max(1, t) for h, t in zip(hits, totals, strict=True)]


def train_eagle3(
    target_config: Any,
    embed_weight: torch.Tensor,  # [vocab, hidden] the target's embedding (= LM head when tied)
    head_weight: torch.Tensor,  # [vocab, hidden] the target's LM head
    train_dir: str,
    eval_dir: str | None,
    out_dir: str,
    config: TrainConfig,
    checkpoint_dir: str | None = None,
) -> dict[str, Any]:
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    train = load_shards(train_dir)
    evals = load_shards(eval_dir) if eval_dir else []
    vocab = int(target_config.vocab_size)
    d2t, t2d = draft_vocabulary(train, config.draft_vocab_size, vocab)
    draft_ids = torch.arange(len(d2t)) + d2t  # target id of each draft id
    target_to_draft = torch.full((vocab,), -100, dtype=torch.int64)
    target_to_draft[draft_ids] = torch.arange(len(d2t))

    model = Eagle3Trainable(target_config, len(d2t), embed_weight)
    with torch.no_grad():
        model.lm_head.weight.copy_(head_weight[draft_ids])  # start from the target's head rows
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=config.lr, weight_decay=0.0
    )
    batches_per_epoch = len(make_batches(train, config.batch_tokens, random.Random(0)))
    total_steps = batches_per_epoch * config.epochs
    warmup = max(1, min(50, total_steps // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(s, total_steps) / total_steps))
        ),
    )
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(checkpoint_dir or out_dir, exist_ok=True)
    checkpoint = os.path.join(checkpoint_dir or out_dir, "train_state.pt")
    start_epoch = 0
    if os.path.isfile(checkpoint):
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        start_epoch = state["epoch"] + 1
        rng.setstate(state["rng"])
    history = []
    for epoch in range(start_epoch, config.epochs):
        bar = tqdm(
            make_batches(train, config.batch_tokens, rng), desc=f"epoch {epoch + 1}/{config.epochs}"
        )
        losses = []
        for index in bar:
            ids, feats, valid, labels = collate(train, index, target_to_draft, config.ttt_steps)
            loss, accuracies = _loss(
                model(ids, feats, valid, config.ttt_steps), labels, config.step_weight
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in accuracies))
        held_out = evaluate(model, evals, target_to_draft, config) if evals else []
        history.append(
            {
                "epoch": epoch + 1,
                "train_loss": sum(losses) / len(losses),
                "held_out_accuracy": held_out,
            }
        )
        print(f"epoch {epoch + 1}: held-out accuracy per step {[round(a, 3) for a in held_out]}")
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(),
                "epoch": epoch,
                "rng": rng.getstate(),
            },
            checkpoint,
        )
    export_eagle3(model, target_config, d2t, t2d, out_dir)
    return {"history": history, "draft_vocab_size": len(d2t)}


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
    state = model.export_state(d2t, t2d)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    config = target_config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    config.update(
        architectures=["LlamaForCausalLMEagle3"],
        num_hidden_layers=1,
        draft_vocab_size=len(d2t),
        target_hidden_size=int(target_config.hidden_size),
        tie_word_embeddings=False,
    )
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
