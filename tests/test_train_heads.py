"""The EAGLE-1 and DeepSeek-MTP trainers: features are what the engine feeds the heads, each
trainable model is the engine's head (teacher-forced chain, step by step), and a short
seeded training run lowers the loss, is reproducible, and exports a head the engine loads
and keeps lossless."""

import pytest
import torch
from forward_helpers import draft_prefill, prefill, store_in_parts
from safetensors.torch import load_file
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams
from cluster.config import ModelConfig
from cluster.config.speculative import SpeculativeConfig
from cluster.models.loader import load_model
from cluster.parallel import ParallelState
from cluster.train.dataset import Sample, cache_features
from cluster.train.eagle_model import EagleTrainable
from cluster.train.eagle_mtp_trainer import (
    chain_step,
    export_eagle,
    export_mtp,
    train_chain_head,
)
from cluster.train.loop import TrainConfig, collate, load_shards
from cluster.train.mtp_model import DeepSeekMTPTrainable
from cluster.train.ttt import gather_rows

METHODS = ("eagle", "mtp")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=64, num_kv_blocks=32)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}
CONFIG = TrainConfig(ttt_steps=2, epochs=20, lr=3e-3, batch_tokens=64)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tensors here are tiny: a second thread only adds synchronisation, which stalls
    badly (seconds per step) when the cores are busy with other work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("train_heads")
    target = str(root / "target")
    hf = make_tiny_chat_model(target, smollm2_path, num_hidden_layers=2, seed=3, vocab_size=300)
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in (4, 10, 3, 8):  # a random prompt and the target's greedy answer, as in the pipeline
        ids = torch.randint(0, 300, (n,), generator=g).tolist()
        with torch.no_grad():
            for _ in range(12):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        samples.append(Sample(ids, answer_start=n))
    store = store_in_parts(str(root / "answers"), samples, part_size=2)
    cache_features(target, store, (), str(root / "final"), dtype="float32")
    return target, hf, root, samples


def _trainable(method: str, hf):
    embed, head = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()
    if method == "eagle":
        return EagleTrainable(hf.config, embed, head)
    return DeepSeekMTPTrainable(hf.config, embed, head, hf.model.norm.weight.detach())


def _train(method: str, hf, root, out: str, eval_dir: str | None, resume: bool = False) -> dict:
    embed, head = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()
    norm = hf.model.norm.weight.detach()
    final = str(root / "final")
    return train_chain_head(
        method, hf.config, embed, head, norm, final, eval_dir, out, CONFIG, resume=resume
    )


def test_features_are_what_the_engine_feeds_the_head(setup):
    """Without aux layers the cache holds the target's final (post-norm) hidden state: the
    `target_hidden` the engine hands EAGLE-1 and MTP heads in pass 0."""
    target, _, root, samples = setup
    shards = load_shards(str(root / "final"))
    model = load_model(
        ModelConfig(path=target, dtype="float32"), ParallelState.single(), show_progress=False
    )
    ids = torch.tensor(samples[1].token_ids)
    with torch.no_grad():
        hidden = prefill(model, ids, [len(ids)])
    torch.testing.assert_close(shards[1]["features"].float(), hidden.half().float())


def test_eagle_loss_targets_are_the_next_hidden_state_and_token(setup):
    """A head that outputs exactly the target's hidden state at p + 1 + j has no regression
    loss, and the target's LM head on it predicts every label (the target's greedy answer)."""
    _, hf, root, _ = setup
    head = hf.lm_head.weight.detach()

    class Oracle(torch.nn.Module):
        def outputs(self, ids, feats, valid, steps, anchors=None):
            rolled = [torch.roll(feats, -(1 + j), dims=1) for j in range(steps)]
            return rolled if anchors is None else [gather_rows(r, anchors) for r in rolled]

        def logits(self, output):
            return output @ head.T

    sequences = load_shards(str(root / "final"))
    batch = collate(sequences, list(range(len(sequences))), None, 3)
    loss, counts = chain_step(Oracle(), TrainConfig(ttt_steps=3), 1.0, 0.0)(batch)
    assert float(loss) == 0.0
    assert counts.totals == [4 * 11] * 3  # every answer token after the first, at every step
    assert counts.hits == counts.totals
    # a chain from the row of a sequence's last step-0 label has no token left to draft at
    # step 1, and so on: each step's chains lose one row per sequence
    assert counts.chain_hits == [44, 40, 36]
    assert counts.acceptance_length == 1 + (44 + 40 + 36) / 44
    # the token loss alone (MTP) computes only the labelled rows: the same labels line up
    _, counts = chain_step(Oracle(), TrainConfig(ttt_steps=3), 0.0, 1.0)(batch)
    assert counts.totals == [4 * 11] * 3 and counts.hits == counts.totals


@pytest.mark.parametrize("method", METHODS)
def test_trainable_equals_the_inference_head_with_teacher_forcing(setup, method):
    """TTT step j at row p equals the engine's head run as a chain from anchor p whose
    step-s input token is the true token (teacher forcing), in the target vocabulary."""
    target, hf, root, _ = setup
    shards = load_shards(str(root / "final"))
    torch.manual_seed(1)
    trainable = _trainable(method, hf)
    with torch.no_grad():  # random norms too, so a misplaced norm cannot hide behind ones
        for p in trainable.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = root / f"exported_{method}"
    out.mkdir()
    export = export_eagle if method == "eagle" else export_mtp
    export(trainable, hf.config, str(out), dtype=torch.float32)
    state = ParallelState.single()
    model_config = ModelConfig(path=target, dtype="float32")
    spec = SpeculativeConfig(method=method, model=str(out), num_speculative_tokens=3)
    head = spec.draft_method.load_draft(
        spec,
        model_config,
        load_model(model_config, state, show_progress=False),
        state,
    )
    assert type(head).__name__ == ("EagleLlama" if method == "eagle" else "DeepSeekMTP")

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
                torch.testing.assert_close(
                    head.compute_logits(lh[-1:], step)[0],
                    train_logits[step][0, anchor],
                    atol=2e-4,
                    rtol=1e-4,
                )
                tokens.append(int(ids[anchor + 2 + step]))  # teacher forcing, as in training
                hidden_in = torch.cat([hidden_in, nh[-1:]])


@pytest.fixture(scope="module")
def greedy_base(setup):
    with LLM(setup[0], **ENGINE) as llm:
        return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _without_timing(history: list[dict]) -> list[dict]:
    """A run's history less its wall-clock throughput, which no seed fixes."""
    timing = ("answer_tokens_per_s", "train_seconds")
    return [{k: v for k, v in epoch.items() if k not in timing} for epoch in history]


@pytest.mark.parametrize("method", METHODS)
def test_short_training_lowers_the_loss_is_seeded_and_stays_lossless(setup, greedy_base, method):
    target, hf, root, _ = setup
    out = str(root / f"trained_{method}")
    result = _train(method, hf, root, out, str(root / "final"))
    first, last = result["history"][0], result["history"][-1]
    # it learns (memorises) the data; the tiny target's LM head keeps logits near uniform, so
    # the token loss falls slowly even when the top-1 prediction is right
    assert last["train_loss"] < 0.9 * first["train_loss"]
    assert last["held_out_accuracy"][0] > first["held_out_accuracy"][0] + 0.3

    speculative = {"method": method, "model": out, "num_speculative_tokens": 3}
    with LLM(target, speculative_config=speculative, **ENGINE) as llm:
        tokens = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens == greedy_base

    # the same seed gives the same run and the same head, bit for bit
    again_dir = str(root / f"again_{method}")
    again = _train(method, hf, root, again_dir, str(root / "final"))
    assert _without_timing(again["history"]) == _without_timing(result["history"])
    name = "model.safetensors" if method == "eagle" else "mtp.safetensors"
    a, b = load_file(f"{out}/{name}"), load_file(f"{again_dir}/{name}")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # resuming the finished run trains no further epochs (its stored history comes back)
    assert _train(method, hf, root, out, None, resume=True)["history"] == result["history"]
