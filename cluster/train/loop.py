"""What every draft-head trainer shares: cached sequences, batches, and the training loop.

`fit` runs epochs of AdamW (cosine schedule with warm-up, gradient clipping at 1) over
length-sorted, shuffled batches, shows the loss and each TTT step's accuracy in a progress
bar, measures held-out accuracy after every epoch, and checkpoints after every epoch
(resuming from the last one). The head-specific part is a `StepFn`: a batch -> (loss,
`StepCounts`). Deterministic given the seed (the caller seeds torch before building the
model).

Held-out figures are what greedy drafting would get on the same tokens: a label the draft
vocabulary lacks counts as a miss (`OUT_OF_VOCAB`), and the acceptance length is the mean
over rows of 1 + the number of leading TTT steps that are right (a chain of k =
`ttt_steps` drafts stops at its first wrong one).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from cluster.train.feature_store import load_shards
from cluster.train.ttt import row_window

__all__ = [
    "NO_LABEL",
    "OUT_OF_VOCAB",
    "Batch",
    "StepCounts",
    "StepFn",
    "TrainConfig",
    "collate",
    "evaluate",
    "fit",
    "load_shards",
]

NO_LABEL = -100  # a row with nothing to predict at this step (no loss, not counted)
OUT_OF_VOCAB = -1  # a label outside the draft vocabulary: no loss, counted as a miss


@dataclass(frozen=True)
class TrainConfig:
    draft_vocab_size: int = 4096  # EAGLE-3 only
    ttt_steps: int = 3
    epochs: int = 2
    lr: float = 1e-3
    batch_tokens: int = 4096
    seed: int = 0
    step_weight: float = 0.8
    freeze_lm_head: bool = False  # EAGLE-3: keep the target's LM head rows as they are
    compile: bool = False  # EAGLE-3: the step's forward under torch.compile (dynamic shapes)
    eval_every_tokens: int = 0  # > 0: also measure held-out accuracy every this many
    # trained answer tokens (the curve of accuracy against data in the history)
    regression_weight: float = 1.0  # EAGLE-1: smooth-L1 feature regression
    token_weight: float = 0.1  # EAGLE-1: token cross-entropy
    device: str = "auto"  # "auto": CUDA when available, else the CPU

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T] int64, zero-padded
    features: torch.Tensor  # [B, T, F] float32
    valid: torch.Tensor  # [B, T] bool: real tokens
    labels: list[torch.Tensor]  # per TTT step [B, T]: the class row p predicts, or NO_LABEL
    # (OUT_OF_VOCAB where the label map lacks the token)
    first_row: torch.Tensor  # [B] int64: the first row with a label at any step

    def to(self, device: torch.device) -> Batch:
        return Batch(
            self.ids.to(device),
            self.features.to(device),
            self.valid.to(device),
            [lab.to(device) for lab in self.labels],
            self.first_row.to(device),
        )

    def window(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(anchors [B, W], each step's labels [B, W]) of the rows that have a label at some
        step (`ttt.row_window`): what a head trained on labels alone needs to compute."""
        anchors = row_window(self.first_row, self.valid)
        return anchors, [lab.gather(1, anchors) for lab in self.labels]


@dataclass(frozen=True)
class StepCounts:
    """Top-1 counts over some rows, per TTT step."""

    hits: list[int]  # right predictions
    totals: list[int]  # labelled rows
    chain_hits: list[int]  # rows whose steps 0..j are all right (a greedy chain's acceptance)

    @staticmethod
    def of(predictions: list[torch.Tensor], labels: list[torch.Tensor]) -> StepCounts:
        """From each step's predicted classes and labels, [B, W] each, row p the same
        anchor at every step."""
        hits, totals, chain_hits = [], [], []
        chain = None
        for predicted, label in zip(predictions, labels, strict=True):
            right = (predicted == label) & (label >= 0)  # never at NO_LABEL or OUT_OF_VOCAB
            chain = right if chain is None else chain & right
            hits.append(int(right.sum()))
            totals.append(int((label != NO_LABEL).sum()))
            chain_hits.append(int(chain.sum()))
        return StepCounts(hits, totals, chain_hits)

    def __add__(self, other: StepCounts) -> StepCounts:
        def add(a: list[int], b: list[int]) -> list[int]:
            return [x + y for x, y in zip(a, b, strict=True)]

        return StepCounts(
            add(self.hits, other.hits),
            add(self.totals, other.totals),
            add(self.chain_hits, other.chain_hits),
        )

    @property
    def accuracy(self) -> list[float]:
        return [h / max(1, t) for h, t in zip(self.hits, self.totals, strict=True)]

    @property
    def acceptance_length(self) -> float:
        """1 + the mean number of leading right steps, over rows labelled at step 0."""
        return 1 + sum(self.chain_hits) / max(1, self.totals[0])


def loss_labels(labels: torch.Tensor) -> torch.Tensor:
    """`labels` with OUT_OF_VOCAB turned into NO_LABEL (cross-entropy's ignore_index)."""
    return labels.masked_fill(labels == OUT_OF_VOCAB, NO_LABEL)


# batch -> (loss, the batch's top-1 counts)
StepFn = Callable[[Batch], tuple[torch.Tensor, StepCounts]]


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
    sequences: list[dict[str, Any]], index: list[int], label_map: torch.Tensor | None, steps: int
) -> Batch:
    """Padded batch; row p of step j is labelled with token p + 2 + j when that is an answer
    token after the first, mapped through `label_map` (target id -> class, or OUT_OF_VOCAB)."""
    rows = [sequences[i] for i in index]
    length = max(len(r["token_ids"]) for r in rows)
    width = rows[0]["features"].shape[-1]
    ids = torch.zeros(len(rows), length, dtype=torch.int64)
    feats = torch.zeros(len(rows), length, width)
    valid = torch.zeros(len(rows), length, dtype=torch.bool)
    labels = [torch.full((len(rows), length), NO_LABEL, dtype=torch.int64) for _ in range(steps)]
    first_row = torch.tensor([max(0, r["answer_start"] - steps) for r in rows])
    for b, r in enumerate(rows):
        n = len(r["token_ids"])
        ids[b, :n] = torch.tensor(r["token_ids"])
        feats[b, :n] = r["features"].float()
        valid[b, :n] = True
        for step in range(steps):
            first = max(0, r["answer_start"] + 1 - 2 - step)
            last = n - 2 - step
            if last > first:
                tokens = ids[b, first + 2 + step : last + 2 + step]
                labels[step][b, first:last] = tokens if label_map is None else label_map[tokens]
    return Batch(ids, feats, valid, labels, first_row)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    step_fn: StepFn,
    sequences: list[dict[str, Any]],
    label_map: torch.Tensor | None,
    config: TrainConfig,
) -> dict[str, Any]:
    """Held-out top-1 accuracy of each TTT step (given the true earlier tokens) and the
    acceptance length of greedy chains of `ttt_steps` drafts."""
    model.eval()
    counts = StepCounts([0] * config.ttt_steps, [0] * config.ttt_steps, [0] * config.ttt_steps)
    for index in make_batches(sequences, config.batch_tokens, random.Random(0)):
        batch = collate(sequences, index, label_map, config.ttt_steps)
        counts = counts + step_fn(batch.to(config.torch_device))[1]
    model.train()
    return {
        "held_out_accuracy": counts.accuracy,
        "held_out_acceptance_length": counts.acceptance_length,
    }


def fit(
    model: nn.Module,
    step_fn: StepFn,
    train: list[dict[str, Any]],
    evals: list[dict[str, Any]],
    label_map: torch.Tensor | None,
    config: TrainConfig,
    checkpoint: str,
) -> list[dict[str, Any]]:
    """Train `model` for the epochs not yet in `checkpoint`; the history of those epochs.
    The model and every batch go to `config.torch_device`."""
    model.to(config.torch_device)
    rng = random.Random(config.seed)
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
    os.makedirs(os.path.dirname(os.path.abspath(checkpoint)), exist_ok=True)
    start_epoch = 0
    if os.path.isfile(checkpoint):
        state = torch.load(checkpoint, map_location=config.torch_device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        start_epoch = state["epoch"] + 1
        rng.setstate(state["rng"])
    history = []
    seen = 0  # answer tokens trained on in this run (step 0's labels)
    for epoch in range(start_epoch, config.epochs):
        bar = tqdm(
            make_batches(train, config.batch_tokens, rng), desc=f"epoch {epoch + 1}/{config.epochs}"
        )
        losses, curve, train_seconds, epoch_tokens = [], [], 0.0, 0
        next_eval = seen + config.eval_every_tokens
        for index in bar:
            started = time.perf_counter()
            batch = collate(train, index, label_map, config.ttt_steps)
            loss, counts = step_fn(batch.to(config.torch_device))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            train_seconds += time.perf_counter() - started
            seen, epoch_tokens = seen + counts.totals[0], epoch_tokens + counts.totals[0]
            accuracy = "/".join(f"{a:.2f}" for a in counts.accuracy)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=accuracy)
            if config.eval_every_tokens and evals and seen >= next_eval:
                next_eval = seen + config.eval_every_tokens
                held_out = evaluate(model, step_fn, evals, label_map, config)
                curve.append({"answer_tokens_seen": seen, **held_out})
        held_out = (
            evaluate(model, step_fn, evals, label_map, config)
            if evals
            else {"held_out_accuracy": [], "held_out_acceptance_length": None}
        )
        history.append(
            {
                "epoch": epoch + 1,
                "train_loss": sum(losses) / len(losses),
                **held_out,
                "answer_tokens_seen": seen,
                "answer_tokens_per_s": round(epoch_tokens / max(train_seconds, 1e-9)),
                **({"curve": curve} if curve else {}),
            }
        )
        print(
            f"epoch {epoch + 1}: held-out accuracy per step "
            f"{[round(a, 3) for a in held_out['held_out_accuracy']]}, acceptance length "
            f"{held_out['held_out_acceptance_length']}"
        )
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
    return history
