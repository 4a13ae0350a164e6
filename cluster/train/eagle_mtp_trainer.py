"""Training an EAGLE-1 head or a DeepSeek-style MTP module on the target's final hidden states.

Both heads take, at row p, the target's final hidden state at p (after its final norm:
what the engine feeds them) and the embedding of token p + 1, and predict token p + 2;
TTT steps j >= 1 run the head on its own output (`cluster/train/ttt.py`), weighted
`step_weight`^j. Labels are the target's own greedy answer tokens; logits go through the
target's frozen LM head (full vocabulary), computed only at labelled rows.

- EAGLE-1 (the EAGLE paper's loss): `regression_weight` (1.0) * smooth L1 between the
  head's output and the target's hidden state at p + 1 + j (every real position), plus
  `token_weight` (0.1) * the token cross-entropy.
- MTP (DeepSeek-V3's loss): the token cross-entropy alone.

The loop (AdamW, schedule, checkpoints, held-out accuracy) is `cluster/train/loop.py`.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch
import torch.nn.functional as F

from cluster.train.eagle_model import EagleTrainable
from cluster.train.loop import NO_LABEL, Batch, StepCounts, StepFn, TrainConfig, fit, load_shards
from cluster.train.mtp_model import DeepSeekMTPTrainable
from cluster.train.trainer import save_state, write_head_config
from cluster.train.ttt import TTTHead

Method = Literal["eagle", "mtp"]


def chain_step(
    model: TTTHead, config: TrainConfig, regression_weight: float, token_weight: float
) -> StepFn:
    """The `StepFn` of a head predicting (and, with `regression_weight`, regressing onto)
    the target's next hidden state."""

    def step(batch: Batch) -> tuple[torch.Tensor, StepCounts]:
        # the regression needs every position; the token loss only the labelled rows
        anchors, step_labels = (None, batch.labels) if regression_weight else batch.window()
        outputs = model.outputs(
            batch.ids, batch.features, batch.valid, config.ttt_steps, anchors=anchors
        )
        lengths = batch.valid.sum(1)
        rows = torch.arange(batch.ids.shape[1], device=batch.ids.device)
        total = outputs[0].sum() * 0.0  # keeps the graph when a batch has no labels
        predictions = []
        for j, (out, labels) in enumerate(zip(outputs, step_labels, strict=True)):
            loss = out.new_zeros(())
            if regression_weight:
                has_next = rows[None] < (lengths - 1 - j)[:, None]  # the target state at p+1+j
                nxt = torch.roll(batch.features, shifts=-(1 + j), dims=1)
                if has_next.any():
                    loss = loss + regression_weight * F.smooth_l1_loss(out[has_next], nxt[has_next])
            mask = labels != NO_LABEL
            logits = model.logits(out[mask])  # [n, vocab] at labelled rows only
            if mask.any():
                loss = loss + token_weight * F.cross_entropy(logits, labels[mask])
            predicted = torch.full_like(labels, NO_LABEL)  # [B, W]
            predicted[mask] = logits.argmax(-1)
            predictions.append(predicted)
            total = total + config.step_weight**j * loss
        return total, StepCounts.of(predictions, step_labels)

    return step


def train_chain_head(
    method: Method,
    target_config: Any,
    embed_weight: torch.Tensor,  # [vocab, hidden] the target's embedding
    head_weight: torch.Tensor,  # [vocab, hidden] the target's LM head
    final_norm_weight: torch.Tensor | None,  # [hidden] the target's final norm (MTP init)
    train_dir: str | list[str],  # feature folders (`feature_store`)
    eval_dir: str | list[str] | None,
    out_dir: str,
    config: TrainConfig,
    checkpoint_dir: str | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Train an EAGLE-1 head (`method="eagle"`) or an MTP module (`"mtp"`) on cached final
    hidden states and export it to `out_dir`."""
    torch.manual_seed(config.seed)
    train = load_shards(train_dir)
    evals = load_shards(eval_dir) if eval_dir else []
    model: EagleTrainable | DeepSeekMTPTrainable
    if method == "eagle":
        model = EagleTrainable(target_config, embed_weight, head_weight)
        step = chain_step(model, config, config.regression_weight, config.token_weight)
    elif method == "mtp":
        model = DeepSeekMTPTrainable(target_config, embed_weight, head_weight, final_norm_weight)
        step = chain_step(model, config, 0.0, 1.0)
    else:
        raise ValueError(f"unknown method {method!r}")
    os.makedirs(out_dir, exist_ok=True)
    checkpoint = os.path.join(checkpoint_dir or out_dir, f"train_state_{method}.pt")
    history = fit(model, step, train, evals, None, config, checkpoint, resume)
    export = export_eagle if isinstance(model, EagleTrainable) else export_mtp
    export(model, target_config, out_dir)
    return {"history": history}


def export_eagle(
    model: EagleTrainable, target_config: Any, out_dir: str, dtype: torch.dtype = torch.float16
) -> None:
    """`model.safetensors` (`fc.weight`, `layers.0.*`) + `config.json` in the public EAGLE-1
    layout: load with `speculative_config={"method": "eagle", "model": out_dir}`."""
    save_state(model.export_state(), os.path.join(out_dir, "model.safetensors"), dtype)
    write_head_config(
        target_config, out_dir, architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1
    )


def export_mtp(
    model: DeepSeekMTPTrainable,
    target_config: Any,
    out_dir: str,
    dtype: torch.dtype = torch.float16,
) -> None:
    """`mtp.safetensors` (`model.layers.{L}.*`) + the target's `config.json` with
    `num_nextn_predict_layers=1`: load with `speculative_config={"method": "mtp", "model":
    out_dir}`, or put `mtp.safetensors` beside the target's own files for the one-checkpoint
    layout of public MTP models."""
    save_state(model.export_state(), os.path.join(out_dir, "mtp.safetensors"), dtype)
    write_head_config(target_config, out_dir, num_nextn_predict_layers=1)
