"""The EAGLE-3 trainer: its model is the engine's head (same layout, same maths, TTT
attention matching inference), and a short training run lowers the loss and exports a
head the engine loads and keeps lossless."""

import pytest
import torch
from forward_helpers import draft_prefill, prefill, store_in_parts
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams
from cluster.config import ModelConfig
from cluster.config.speculative import SpeculativeConfig
from cluster.models.eagle3 import eagle3_aux_layers
from cluster.models.loader import load_model
from cluster.parallel import ParallelState
from cluster.train.dataset import Sample, cache_features
from cluster.train.eagle3_model import Eagle3Trainable
from cluster.train.loop import collate
from cluster.train.trainer import (
    TrainConfig,
    draft_vocabulary,
    eagle3_step,
    export_eagle3,
    import_eagle3,
    load_shards,
    train_eagle3,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("train")
    target = str(root / "target")
    hf = make_tiny_chat_model(target, smollm2_path, num_hidden_layers=6, seed=2, vocab_size=300)
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(torch.randint(0, 300, (n,), generator=g).tolist(), answer_start=4)
        for n in (12, 20, 9, 16)
    ]
    aux = eagle3_aux_layers(6)
    store = store_in_parts(str(root / "answers"), samples, part_size=2)
    cache_features(target, store, aux, str(root / "features"), dtype="float32")
    return target, hf, root, samples


def test_features_are_the_engines_aux_states(setup):
    """As the engine's own model computes them (float32 here, stored as float16; bfloat16
    parts keep their bits: tests/test_train_resume.py)."""
    target, _, root, samples = setup
    shards = load_shards(str(root / "features"))
    config = ModelConfig(path=target, dtype="float32")  # the dtype the fixture's cache used
    model = load_model(config, ParallelState.single(), show_progress=False)
    ids = torch.tensor(samples[1].token_ids)
    with torch.no_grad():
        _, aux = prefill(model, ids, [len(ids)], eagle3_aux_layers(6))
    expected = torch.cat(aux, -1)
    if config.torch_dtype != torch.bfloat16:
        expected = expected.half()
    assert shards[1]["features"].dtype == expected.dtype
    torch.testing.assert_close(shards[1]["features"], expected)


def test_trainable_equals_the_inference_head_with_teacher_forcing(setup):
    """TTT step j at row p must equal the engine's draft run as a chain from anchor p whose
    step-s input token is the true token (teacher forcing)."""
    target, hf, root, _samples = setup
    shards = load_shards(str(root / "features"))
    d2t, t2d = draft_vocabulary(shards, 64, 300)
    torch.manual_seed(1)
    trainable = Eagle3Trainable(hf.config, 64, hf.model.embed_tokens.weight.detach())
    with torch.no_grad():
        for p in trainable.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    out = root / "exported"
    out.mkdir()
    export_eagle3(trainable, hf.config, d2t, t2d, str(out), dtype=torch.float32)
    state = ParallelState.single()
    model_config = ModelConfig(path=target, dtype="float32")
    engine_target = load_model(model_config, state, show_progress=False)
    spec = SpeculativeConfig(model=str(out), num_speculative_tokens=3)
    head = spec.draft_method.load_draft(
        spec,
        model_config,
        engine_target,
        state,
    )

    seq = shards[1]
    ids, feats = torch.tensor(seq["token_ids"]), seq["features"].float()
    steps = 3
    with torch.no_grad():
        train_logits = trainable(
            ids[None], feats[None], torch.ones(1, len(ids), dtype=torch.bool), steps
        )
        for anchor in (3, 8, 12):
            hidden_in = head.combine_target_hidden(feats[: anchor + 1])
            tokens = ids[1 : anchor + 2].tolist()
            for step in range(steps):
                lh, nh = draft_prefill(head, torch.tensor(tokens), hidden_in, step)
                draft_logits = head.lm_head(lh[-1:])[0]  # draft vocabulary
                torch.testing.assert_close(
                    draft_logits, train_logits[step][0, anchor], atol=2e-4, rtol=1e-4
                )
                tokens.append(int(ids[anchor + 2 + step]))  # teacher forcing, as in training
                hidden_in = torch.cat([hidden_in, nh[-1:]])


def test_a_window_of_rows_computes_exactly_those_rows_of_the_full_forward(setup):
    """Training computes only rows with labels (prompt rows give step-0 keys alone): their
    logits must be the full forward's, for sequences of different lengths and prompts."""
    _, hf, root, _ = setup
    shards = load_shards(str(root / "features"))
    torch.manual_seed(3)
    trainable = Eagle3Trainable(hf.config, 300, hf.model.embed_tokens.weight.detach())
    batch = collate(shards, [0, 1, 2], None, 3)
    batch = type(batch)(*list(batch.__dict__.values())[:4], torch.tensor([2, 9, 5]))
    anchors, labels = batch.window()
    assert anchors[1, 0] == 9 and anchors.shape[1] == 20 - 9
    with torch.no_grad():
        full = trainable(batch.ids, batch.features, batch.valid, 3)
        window = trainable(batch.ids, batch.features, batch.valid, 3, anchors)
    for step in range(3):
        assert torch.equal(labels[step], batch.labels[step].gather(1, anchors))
        for b, n in enumerate(batch.valid.sum(1).tolist()):
            rows = anchors[b][anchors[b] < n].unique()
            torch.testing.assert_close(
                window[step][b, : len(rows)], full[step][b, rows], atol=1e-5, rtol=1e-5
            )


@pytest.mark.slow
def test_the_compiled_training_step_equals_the_eager_one(setup):
    _, hf, root, _ = setup
    shards = load_shards(str(root / "features"))
    torch.manual_seed(5)
    model = Eagle3Trainable(hf.config, 300, hf.model.embed_tokens.weight.detach())
    # two TTT steps: step 1 has every op a later step has (its own keys), at 2/3 the compile
    config = TrainConfig(ttt_steps=2)
    batch = collate(shards, [0, 1, 2, 3], None, 2)
    eager, eager_counts = eagle3_step(model, config)(batch)
    eager.backward()
    eager_grad = model.fc.weight.grad.clone()
    model.zero_grad()
    compiled, counts = eagle3_step(torch.compile(model, dynamic=True), config)(batch)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.fc.weight.grad, eager_grad, atol=1e-4, rtol=1e-3)
    assert counts == eager_counts


def test_short_training_lowers_the_loss_and_stays_lossless(setup):
    target, hf, root, _ = setup
    out = str(root / "trained")
    config = TrainConfig(
        draft_vocab_size=128, ttt_steps=2, epochs=20, lr=3e-3, batch_tokens=64, eval_every_tokens=20
    )
    embed = hf.model.embed_tokens.weight.detach()
    result = train_eagle3(
        hf.config,
        embed,
        hf.lm_head.weight.detach(),
        str(root / "features"),
        str(root / "features"),
        out,
        config,
    )
    first, last = result["history"][0], result["history"][-1]
    assert last["train_loss"] < first["train_loss"] - 1.0  # it learns (here: memorises) the data
    assert last["held_out_accuracy"][0] > first["held_out_accuracy"][0]
    # chains of 2 drafts: 1 + (rows right at step 0 + rows right at steps 0 and 1) / rows
    assert 1 < last["held_out_acceptance_length"] <= 1 + sum(last["held_out_accuracy"])
    assert last["held_out_acceptance_length"] > first["held_out_acceptance_length"]
    # the curve of held-out accuracy against trained answer tokens, within each epoch
    curve = [p for epoch in result["history"] for p in epoch["curve"]]
    seen = [p["answer_tokens_seen"] for p in curve]
    assert len(curve) >= 20 and seen == sorted(seen) and seen[-1] <= last["answer_tokens_seen"]
    assert last["answer_tokens_seen"] == 20 * first["answer_tokens_seen"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = dict(dtype="float32", max_model_len=64, num_kv_blocks=32)
    with LLM(target, **engine) as llm:
        base = (
            llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, greedy, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
    with LLM(
        target, speculative_config={"model": out, "num_speculative_tokens": 3}, **engine
    ) as llm:
        assert (
            llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, greedy, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
            == base
        )
    # resuming from the last checkpoint trains no further epochs and exports the same head
    # without resume=True the finished run's checkpoint is refused, not overwritten
    with pytest.raises(ValueError, match="--resume"):
        train_eagle3(
            hf.config, embed, hf.lm_head.weight.detach(), str(root / "features"), None, out, config
        )
    again = train_eagle3(
        hf.config, embed, hf.lm_head.weight.detach(), str(root / "features"), None, out, config,
        resume=True,
    )  # fmt: skip
    assert again["history"] == result["history"]  # no epoch left: the stored history


def test_an_exported_head_imports_back_to_the_same_weights(setup, tmp_path):
    _, hf, _, _ = setup
    torch.manual_seed(3)
    embed = hf.model.embed_tokens.weight.detach()
    model = Eagle3Trainable(hf.config, 300, embed)
    d2t = torch.zeros(300, dtype=torch.int64)  # the identity: draft id i is target id i
    t2d = torch.ones(300, dtype=torch.bool)
    (tmp_path / "a").mkdir()
    export_eagle3(model, hf.config, d2t, t2d, str(tmp_path / "a"), dtype=torch.float32)
    imported, imported_d2t = import_eagle3(str(tmp_path / "a"), hf.config, embed)
    assert torch.equal(imported_d2t, d2t)
    theirs, ours = imported.state_dict(), model.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    # a folder without the fuse layer is refused by name, not loaded half-random
    state = load_file(str(tmp_path / "a" / "model.safetensors"))
    del state["fc.weight"]
    (tmp_path / "b").mkdir()
    save_file(state, str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        import_eagle3(str(tmp_path / "b"), hf.config, embed)
