"""Training data: the prompt set (size, variety, a held-out split that never leaks) and the
compact answer store (round trip, resuming, refusing a store made from other prompts)."""

import json

import numpy as np
import pytest
import torch

from cluster.train.answer_store import AnswerStore, Sample, chat_key
from cluster.train.prompts import build_prompts, follow_up_chats, is_eval


@pytest.fixture(scope="module")
def prompts():
    return build_prompts()


def test_the_prompt_set_is_large_varied_and_reproducible(prompts):
    train, evals = prompts
    assert len(train) >= 10_000 and len(evals) >= 1000
    texts = [c[-1]["content"] for c in train]
    assert len(set(texts)) == len(texts)
    # every source contributes: chat, code, docs, rewriting, lists
    for marker in ("```python", "Write a Python function", "module", "Rewrite", "List five"):
        assert sum(marker in t for t in texts) >= 100, marker
    assert build_prompts()[0][:50] == train[:50]


def test_no_eval_prompt_reaches_training(prompts):
    train, evals = prompts
    assert not {c[0]["content"] for c in train} & {c[0]["content"] for c in evals}
    assert all(is_eval(c, 0.1) for c in evals) and not any(is_eval(c, 0.1) for c in train)
    assert 0.08 < len(evals) / (len(train) + len(evals)) < 0.12


def test_follow_ups_continue_the_targets_own_answer_and_keep_the_split(prompts):
    train, evals = prompts
    answered = [(c, f"answer {i}") for i, c in enumerate(train[:400])]
    chats = follow_up_chats(answered, fraction=0.5, seed=3)
    assert 150 < len(chats) < 250
    assert chats == follow_up_chats(answered, fraction=0.5, seed=3)
    answers = {c[0]["content"]: a for c, a in answered}
    for chat in chats:
        assert [m["role"] for m in chat] == ["user", "assistant", "user"]
        assert chat[1]["content"] == answers[chat[0]["content"]]
        assert not is_eval(chat, 0.1)  # a train chat's follow-up stays in training
    held_out = follow_up_chats([(c, "a") for c in evals[:50]], fraction=1.0)
    assert len(held_out) == 50 and all(is_eval(c, 0.1) for c in held_out)


def test_the_store_round_trips_compactly_and_resumes(tmp_path):
    store = AnswerStore(str(tmp_path / "answers"), {"max_tokens": 8})
    rng = np.random.default_rng(0)
    chats = [({"role": "user", "content": f"q{i}"},) for i in range(5)]
    keys = [chat_key(c) for c in chats]
    samples = [Sample(rng.integers(0, 49152, n).tolist(), 3) for n in (7, 12, 5, 9, 30)]
    assert store.check_prefix(keys) == 0
    store.append(samples[:3], keys[:3])
    assert store.check_prefix(keys) == 3  # a rerun resumes after the stored part
    store.append(samples[3:], keys[3:])
    again = AnswerStore(store.directory, {"max_tokens": 8})
    assert again.read() == samples and again.keys() == keys
    with np.load(tmp_path / "answers" / "part_00000.npz") as part:
        assert part["token_ids"].dtype == np.uint16 and part["token_ids"].size == 24
    assert again.check_prefix(keys[:2]) == 2  # fewer prompts: a prefix of the store


def test_the_store_refuses_other_prompts_or_settings(tmp_path):
    store = AnswerStore(str(tmp_path), {"max_tokens": 8})
    store.append([Sample([1, 2, 3], 1)], [chat_key("a")])
    with pytest.raises(ValueError, match="another prompt list"):
        store.check_prefix([chat_key("b")])
    with pytest.raises(ValueError, match="max_tokens"):
        AnswerStore(str(tmp_path), {"max_tokens": 16})
    with pytest.raises(ValueError, match="keys"):
        store.append([Sample([1], 0)], [])


def test_a_large_vocabulary_is_stored_without_wrapping(tmp_path):
    store = AnswerStore(str(tmp_path))
    store.append([Sample([5, 70_000, 151_000], 1)], [chat_key("x")])
    assert store.read()[0].token_ids == [5, 70_000, 151_000]


def test_train_draft_stores_answers_with_follow_ups_and_resumes(tmp_path, smollm2_path):
    """The whole pipeline on a tiny target: first-turn answers, then follow-up turns after
    the target's own answers, features, a head; a rerun generates nothing again, and its
    training (`resume=True`) finds the run complete."""
    from tiny_models import make_tiny_chat_model

    from cluster.train.loop import TrainConfig
    from cluster.train.pipeline import train_draft

    target = str(tmp_path / "target")
    make_tiny_chat_model(target, smollm2_path, num_hidden_layers=4, seed=1)
    config = TrainConfig(draft_vocab_size=64, epochs=1, batch_tokens=512, device="cpu")
    run = dict(
        max_tokens=6, num_prompts=10, config=config, num_eval_prompts=4, follow_up_fraction=0.5
    )
    recipe = train_draft(target, str(tmp_path / "head"), str(tmp_path / "work"), **run)
    answers = tmp_path / "work" / "answers"
    first = AnswerStore(str(answers / "train"), {"target": "target", "max_tokens": 6}).read()
    follow = AnswerStore(str(answers / "train_follow_ups"), {"target": "target", "max_tokens": 6})
    assert len(first) == 10 and 0 < len(follow.read()) < 10
    assert recipe["train_prompts"] == 10 + len(follow.read())
    assert recipe["train_answer_tokens"] == sum(
        len(s.token_ids) - s.answer_start for s in first + follow.read()
    )
    # a follow-up's prompt holds a first turn and its answer, so it is longer than both
    assert min(s.answer_start for s in follow.read()) > min(len(s.token_ids) for s in first)
    parts = sorted(p.name for p in answers.rglob("part_*.npz"))
    with pytest.raises(ValueError, match="--resume"):
        train_draft(target, str(tmp_path / "head"), str(tmp_path / "work"), **run)
    again = train_draft(target, str(tmp_path / "head"), str(tmp_path / "work"), **run, resume=True)
    assert again["history"] == recipe["history"]
    assert set(again["stage_seconds"]) == {"answers", "features", "train"}
    assert sorted(p.name for p in answers.rglob("part_*.npz")) == parts
    assert again["train_answer_tokens"] == recipe["train_answer_tokens"]


def test_features_recorded_while_answering_equal_a_second_forward(tmp_path, smollm2_path):
    """The recorder's rows (every position but the never-fed last one) are what a separate
    forward of the finished sequences computes, for the EAGLE-3 and the final states."""
    from tiny_models import make_tiny_chat_model

    from cluster.models.eagle3 import eagle3_aux_layers
    from cluster.train.dataset import cache_features, generate_answers
    from cluster.train.feature_store import load_shards

    target = str(tmp_path / "target")
    make_tiny_chat_model(target, smollm2_path, num_hidden_layers=6, seed=4)
    chats = build_prompts()[0][:7]
    dirs = (str(tmp_path / "rec_aux"), str(tmp_path / "rec_final"))
    store = str(tmp_path / "answers")
    samples = generate_answers(target, chats, 9, store, dirs, max_num_seqs=4, chunk=3)
    assert len(samples) == 7
    for recorded_dir, aux in zip(dirs, (eagle3_aux_layers(6), ()), strict=True):
        again = cache_features(target, store, aux, str(tmp_path / f"again_{len(aux)}"))
        recorded, computed = load_shards(recorded_dir), load_shards(again)
        assert [r["token_ids"] for r in recorded] == [s.token_ids for s in samples]
        for r, c in zip(recorded, computed, strict=True):
            assert r["features"].shape == c["features"].shape
            assert not r["features"][-1].any()  # the last token is never fed back
            assert r["features"].dtype == c["features"].dtype
            got, want = r["features"][:-1].float(), c["features"][:-1].float()
            if r["features"].dtype == torch.bfloat16:
                # decode steps and one prefill round differently in bfloat16: each row
                # within 2% of its norm (a row of another position is ~100% off)
                error = (got - want).norm(dim=-1) / want.norm(dim=-1)
                assert error.max() < 2e-2, error.max()
            else:
                torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_train_draft_takes_a_chat_dataset(tmp_path, smollm2_path):
    """`--dataset chats.jsonl`: the user's chats (OpenAI's format, a final assistant turn
    dropped), split by the hash rule, answered by the target; bad lines name their line."""
    from tiny_models import make_tiny_chat_model

    from cluster.train.loop import TrainConfig
    from cluster.train.pipeline import train_draft
    from cluster.train.prompts import read_chats

    lines = [
        {"messages": [{"role": "user", "content": f"Tell me about topic {i}."}]} for i in range(40)
    ]
    lines.append(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
        ]
    )
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    train, evals = read_chats(str(path))
    assert len(train) + len(evals) == 41 and evals  # about 10% held out
    assert not {c[-1]["content"] for c in train} & {c[-1]["content"] for c in evals}
    assert (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ) in train + evals
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        read_chats(str(tmp_path / "bad.jsonl"))

    target = str(tmp_path / "target")
    make_tiny_chat_model(target, smollm2_path, num_hidden_layers=4, seed=3)
    config = TrainConfig(epochs=1, device="cpu")
    result = train_draft(
        target, str(tmp_path / "head"), str(tmp_path / "work"), max_tokens=4, num_prompts=None,
        config=config, follow_up_fraction=0, data_only=True, dataset=str(path),
    )  # fmt: skip
    assert result["prompts_and_answer_tokens"]["train"][0] == len(train)
    assert result["prompts_and_answer_tokens"]["eval"][0] == len(evals)
