"""Training batches of cached sequences: length-sorted, shuffled index lists and the
padded `Batch` with each TTT step's labels."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from cluster.train.ttt import row_window

NO_LABEL = -100  # a row with nothing to predict at this step (no loss, not counted)
OUT_OF_VOCAB = -1  # a label outside the draft vocabulary: no loss, counted as a miss


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
