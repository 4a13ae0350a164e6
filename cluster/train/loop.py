"""What every draft-head trainer shares: cached sequences, batches, and the training loop.

`fit` runs epochs of AdamW (cosine schedule with warm-up, gradient clipping at 1) over
length-sorted, shuffled batches, shows the loss and each TTT step's accuracy in a progress
bar and measures held-out accuracy after every epoch. Forwards run under bfloat16
autocast where the device computes bfloat16 products in hardware (`TrainConfig.precision`),
with float32 master weights and optimiser state. A checkpoint is written every
`checkpoint_every` steps and after every epoch; `resume=True` continues a stopped run from
its last checkpoint, mid-epoch included, on the same batches in the same order. The
head-specific part is a `StepFn`: a batch -> (loss, `StepCounts`). Deterministic given the
seed (the caller seeds torch before building the model).

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

from cluster.train.batches import NO_LABEL, OUT_OF_VOCAB, Batch, collate, make_batches
from cluster.train.feature_store import load_shards
from cluster.train.train_config import TrainConfig

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
        return self.acceptance_lengths[-1]

    @property
    def acceptance_lengths(self) -> list[float]:
        """The acceptance length of chains of k = 1, 2, ... drafts."""
        hits = [sum(self.chain_hits[:k]) for k in range(1, len(self.chain_hits) + 1)]
        return [1 + h / max(1, self.totals[0]) for h in hits]


def loss_labels(labels: torch.Tensor) -> torch.Tensor:
    """`labels` with OUT_OF_VOCAB turned into NO_LABEL (cross-entropy's ignore_index)."""
    return labels.masked_fill(labels == OUT_OF_VOCAB, NO_LABEL)


# batch -> (loss, the batch's top-1 counts)
StepFn = Callable[[Batch], tuple[torch.Tensor, StepCounts]]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    step_fn: StepFn,
    sequences: list[dict[str, Any]],
    label_map: torch.Tensor | None,
    config: TrainConfig,
) -> dict[str, Any]:
    """Held-out top-1 accuracy of each TTT step (given the true earlier tokens) and the
    acceptance length of greedy chains of `ttt_steps` drafts (and of 1, 2, ... drafts)."""
    model.eval()
    counts = StepCounts([0] * config.ttt_steps, [0] * config.ttt_steps, [0] * config.ttt_steps)
    for index in make_batches(sequences, config.batch_tokens, random.Random(0)):
        batch = collate(sequences, index, label_map, config.ttt_steps)
        with config.autocast():
            counts = counts + step_fn(batch.to(config.torch_device))[1]
    model.train()
    return {
        "held_out_accuracy": counts.accuracy,
        "held_out_acceptance_length": counts.acceptance_length,
        "held_out_acceptance_by_k": counts.acceptance_lengths,
    }


def fit(
    model: nn.Module,
    step_fn: StepFn,
    train: list[dict[str, Any]],
    evals: list[dict[str, Any]],
    label_map: torch.Tensor | None,
    config: TrainConfig,
    checkpoint: str,
    resume: bool = False,
) -> list[dict[str, Any]]:
    """Train `model` for `config.epochs`; the history of every epoch (those of an earlier,
    resumed run included). An existing `checkpoint` is continued with `resume=True` (a
    ValueError if its settings differ) and refused without it. The model and every batch go
    to `config.torch_device`."""
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
    progress = _Progress(0, 0, rng.getstate(), next_eval=config.eval_every_tokens)
    if os.path.isfile(checkpoint):
        if not resume:
            raise ValueError(
                f"{checkpoint} holds a stopped run: pass --resume to continue it, or remove it"
            )
        state = torch.load(checkpoint, map_location=config.torch_device, weights_only=False)
        if state["config"] != config.identity():
            raise ValueError(
                f"{checkpoint} was made with {state['config']}, not {config.identity()}; "
                "resume with the same settings or remove it"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        progress = state["progress"]
        print(f"resuming {checkpoint}: epoch {progress.epoch + 1}, batch {progress.next_batch}")

    def save() -> None:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict(),
            "progress": progress,
            "config": config.identity(),
        }
        torch.save(state, checkpoint + ".tmp")
        os.replace(checkpoint + ".tmp", checkpoint)

    while progress.epoch < config.epochs:
        rng.setstate(progress.epoch_rng)
        batches = make_batches(train, config.batch_tokens, rng)
        bar = tqdm(
            batches[progress.next_batch :],
            desc=f"epoch {progress.epoch + 1}/{config.epochs}",
            initial=progress.next_batch,
            total=len(batches),
        )
        for index in bar:
            started = time.perf_counter()
            batch = collate(train, index, label_map, config.ttt_steps)
            with config.autocast():
                loss, counts = step_fn(batch.to(config.torch_device))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            progress.add_step(loss.item(), counts.totals[0], time.perf_counter() - started)
            bar.set_postfix(
                loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in counts.accuracy)
            )
            if config.eval_every_tokens and evals and progress.seen >= progress.next_eval:
                progress.next_eval = progress.seen + config.eval_every_tokens
                held_out = evaluate(model, step_fn, evals, label_map, config)
                progress.curve.append({"answer_tokens_seen": progress.seen, **held_out})
            if progress.next_batch % config.checkpoint_every == 0:
                save()
        held_out = (
            evaluate(model, step_fn, evals, label_map, config)
            if evals
            else {"held_out_accuracy": [], "held_out_acceptance_length": None}
        )
        progress.end_epoch(held_out, rng.getstate())
        print(
            f"epoch {progress.epoch}: held-out accuracy per step "
            f"{[round(a, 3) for a in held_out['held_out_accuracy']]}, acceptance length "
            f"{held_out['held_out_acceptance_length']}"
        )
        save()
    return progress.history


@dataclass
class _Progress:
    """Where a run stands (saved in its checkpoints): the epoch and batch to run next, the
    rng state its batch order is drawn from, and the figures so far."""

    epoch: int
    next_batch: int
    epoch_rng: Any
    seen: int = 0  # answer tokens trained on (step 0's labels), all epochs
    next_eval: int = 0
    loss_sum: float = 0.0
    epoch_tokens: int = 0
    train_seconds: float = 0.0
    curve: list | None = None
    history: list | None = None

    def __post_init__(self) -> None:
        self.curve = self.curve or []
        self.history = self.history or []

    def add_step(self, loss: float, tokens: int, seconds: float) -> None:
        self.next_batch += 1
        self.loss_sum += loss
        self.seen += tokens
        self.epoch_tokens += tokens
        self.train_seconds += seconds

    def end_epoch(self, held_out: dict[str, Any], next_rng: Any) -> None:
        assert self.history is not None
        self.history.append(
            {
                "epoch": self.epoch + 1,
                "train_loss": self.loss_sum / max(1, self.next_batch),
                **held_out,
                "answer_tokens_seen": self.seen,
                "answer_tokens_per_s": round(self.epoch_tokens / max(self.train_seconds, 1e-9)),
                "train_seconds": round(self.train_seconds),
                **({"curve": self.curve} if self.curve else {}),
            }
        )
        self.epoch, self.next_batch, self.epoch_rng = self.epoch + 1, 0, next_rng
        self.loss_sum, self.epoch_tokens, self.train_seconds, self.curve = 0.0, 0, 0.0, []
