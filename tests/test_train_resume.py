"""A training run stopped part-way and resumed ends where one uninterrupted run ends (same
weights, bit for bit, same held-out history); features keep the target's bfloat16."""

import pytest
import torch
from torch import nn

from cluster.train.answer_store import Sample
from cluster.train.feature_store import load_shards, write_part
from cluster.train.loop import Batch, StepCounts, TrainConfig, fit

VOCAB = WIDTH = 16


def sequences(seed: int, count: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(6, 20, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        # features that say something about the tokens two ahead, so the toy head learns
        features = torch.nn.functional.one_hot(ids.roll(-2), VOCAB).float()
        features = features + 0.1 * torch.randn(n, WIDTH, generator=g)
        out.append({"token_ids": ids.tolist(), "answer_start": 2, "features": features})
    return out


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, VOCAB)


def toy_step(model: Toy, stop_after: int | None = None):
    calls = {"n": 0}

    def step(batch: Batch):
        if model.training:
            calls["n"] += 1
            if stop_after is not None and calls["n"] > stop_after:
                raise KeyboardInterrupt  # a run stopped part-way
        logits = model.proj(batch.features)  # [B, T, VOCAB]
        labels = batch.labels[0]
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(-100))
        return loss, StepCounts.of([logits.argmax(-1)], [labels])

    return step


CONFIG = TrainConfig(ttt_steps=1, epochs=3, lr=0.1, batch_tokens=64, checkpoint_every=2)


def run(tmp_path, name: str, stop_after: int | None = None, config: TrainConfig = CONFIG):
    torch.manual_seed(0)
    model = Toy()
    train, evals = sequences(0, 40), sequences(1, 8)
    checkpoint = str(tmp_path / name / "state.pt")
    try:
        history = fit(model, toy_step(model, stop_after), train, evals, None, config, checkpoint)
    except KeyboardInterrupt:
        torch.manual_seed(0)
        model = Toy()  # a new process: nothing survives but the checkpoint
        with pytest.raises(ValueError, match="--resume"):
            fit(model, toy_step(model), train, evals, None, config, checkpoint)
        other = TrainConfig(**{**CONFIG.__dict__, "lr": 0.2})
        with pytest.raises(ValueError, match="same settings"):
            fit(model, toy_step(model), train, evals, None, other, checkpoint, resume=True)
        history = fit(model, toy_step(model), train, evals, None, config, checkpoint, resume=True)
    return model, history


def timeless(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in ("answer_tokens_per_s", "train_seconds")}
            for h in history]  # fmt: skip


@pytest.mark.parametrize("stop_after", [3, 9])  # mid-epoch right after / between checkpoints
def test_a_stopped_and_resumed_run_equals_an_uninterrupted_one(tmp_path, stop_after):
    whole, history = run(tmp_path, "whole")
    resumed, resumed_history = run(tmp_path, "resumed", stop_after)
    assert len(history) == 3 and history[-1]["held_out_accuracy"][0] > 0.5  # it learned
    assert timeless(resumed_history) == timeless(history)
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_bfloat16_autocast_trains_float32_master_weights(tmp_path):
    config = TrainConfig(**{**CONFIG.__dict__, "precision": "bfloat16"})
    model, history = run(tmp_path, "bf16", config=config)
    assert config.autocast_bf16 and model.proj.weight.dtype == torch.float32
    assert history[-1]["held_out_accuracy"][0] > 0.5
    assert not TrainConfig(precision="float32").autocast_bf16
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp8")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_feature_parts_keep_bfloat16_bits(tmp_path, dtype):
    samples = [Sample([1, 2, 3], 1), Sample([4, 5], 1)]
    rows = [torch.randn(3, 4).to(dtype) * 300, torch.randn(2, 4).to(dtype)]
    write_part(str(tmp_path), 0, samples, rows)
    loaded = load_shards(str(tmp_path))
    stored = torch.float16 if dtype == torch.float32 else torch.bfloat16
    for sequence, row in zip(loaded, rows, strict=True):
        assert sequence["features"].dtype == stored
        assert torch.equal(sequence["features"], row.to(stored))
