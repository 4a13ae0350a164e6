"""Penalty statistics kept between steps (`PenaltyTables`) against recounting every
request's whole history: the same processed logits on random workloads (rows reused,
tables grown), and through the engine the same tokens as transformers' repetition
penalty, with speculation changing nothing."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams
from cluster.sample.metadata import LogitsRows, SamplingMetadata
from cluster.sample.processing import process_logits
from cluster.spec_decode.batch import DraftProposal
from cluster.worker.penalty_tables import PenaltyTables

VOCAB = 64


@pytest.mark.parametrize("seed", range(4))
def test_kept_tables_equal_recounted_histories(seed):
    rng = random.Random(seed)
    tables = PenaltyTables(VOCAB, torch.device("cpu"), rows=1)
    live: dict[str, tuple[SamplingParams, list[int], list[int]]] = {}
    checked = 0
    for step in range(40):
        if len(live) < 7 and rng.random() < 0.5:
            params = rng.choice(
                [
                    SamplingParams(temperature=0),  # no penalty: no row
                    SamplingParams(temperature=0.7, repetition_penalty=1.3),
                    SamplingParams(presence_penalty=0.5, frequency_penalty=-0.4),
                    SamplingParams(temperature=0, frequency_penalty=1.1),
                ]
            )
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
            resumed = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 5]))]
            live[f"r{step}"] = (params, prompt, list(resumed))
            tables.add(f"r{step}", params, prompt, resumed)
        if live and rng.random() < 0.2:
            gone = rng.choice(sorted(live))
            del live[gone]
            tables.remove(gone)
        news = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))] for _ in live]
        for (_, _, outputs), new in zip(live.values(), news, strict=True):
            outputs += new
        tables.append(list(live), news)
        if not live:
            continue
        ids = sorted(live)
        params = [live[i][0] for i in ids]
        logits = torch.randn(len(ids), VOCAB)
        rows = LogitsRows.one_per_request(len(ids), "cpu")
        recounted = SamplingMetadata.from_params(
            params,
            VOCAB,
            prompt_token_ids=[live[i][1] for i in ids],
            output_token_ids=[live[i][2] for i in ids],
        )
        kept = SamplingMetadata.from_params(
            params,
            VOCAB,
            penalty_tables=(tables.prompt_mask, tables.output_counts, tables.rows(ids)),
        )
        assert torch.equal(
            process_logits(logits, kept, rows), process_logits(logits, recounted, rows)
        )
        checked += int(recounted.penalties is not None)
    assert checked > 20
    assert tables.prompt_mask.shape[0] > 1  # the tables grew


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    path = str(tmp_path_factory.mktemp("tiny_penalties") / "m")
    hf = make_tiny_chat_model(path, smollm2_path, num_hidden_layers=2)
    return path, hf


def test_engine_repetition_penalty_matches_transformers(tiny):
    """Greedy decoding with a repetition penalty: the engine's tokens are transformers'
    `generate(repetition_penalty=...)`; with n-gram speculation, and with presence and
    frequency penalties too, speculation changes no token."""
    path, hf = tiny
    prompts = [[5, 9, 9, 31, 7, 9, 2], [40, 41, 42, 40, 41]]
    new_tokens = 24
    penalised = SamplingParams(
        temperature=0, max_tokens=new_tokens, ignore_eos=True, repetition_penalty=1.8
    )
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            max_new_tokens=new_tokens,
            do_sample=False,
            repetition_penalty=1.8,
            attention_mask=torch.ones_like(ids),
            pad_token_id=0,
        )
        expected.append(out[0, len(prompt) :].tolist())
    engine = dict(dtype="float32", max_model_len=128, block_size=8, num_kv_blocks=128)
    requests = [{"prompt_token_ids": p} for p in prompts]
    additive = penalised.model_copy(update={"presence_penalty": 0.7, "frequency_penalty": 0.9})
    with LLM(path, **engine) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(requests, penalised, use_tqdm=False)]
        plain_additive = llm.generate(requests, additive, use_tqdm=False)
        unpenalised = llm.generate(
            requests, penalised.model_copy(update={"repetition_penalty": 1.0}), use_tqdm=False
        )
    assert plain == expected
    # the penalty is felt (else this would test nothing)
    assert plain != [o.outputs[0].token_ids for o in unpenalised]
    # drafts from the known continuation, every third one wrong: accepted runs and
    # rejections, so verifying rows must count the drafts before them
    continuations = {
        tuple(p): [t, a]
        for p, t, a in zip(
            prompts, plain, [o.outputs[0].token_ids for o in plain_additive], strict=True
        )
    }
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(path, speculative_config=ngram, **engine) as llm:
        runner = llm.engine.core.executor.worker.runner
        runner.proposer = _KnownContinuation(continuations, 0, hf.config.vocab_size)
        spec = llm.generate(requests, penalised, use_tqdm=False)
        runner.proposer = _KnownContinuation(continuations, 1, hf.config.vocab_size)
        spec_additive = llm.generate(requests, additive, use_tqdm=False)
        metrics = llm.get_metrics()
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]
    assert [o.outputs[0].token_ids for o in spec] == plain
    assert [o.outputs[0].token_ids for o in spec_additive] == [
        o.outputs[0].token_ids for o in plain_additive
    ]


class _KnownContinuation:
    """Drafts the next 3 tokens of continuation `which` of the prompt, every third wrong."""

    needs_token_history = True

    def __init__(self, continuations: dict, which: int, vocab: int) -> None:
        self.continuations, self.which, self.vocab = continuations, which, vocab

    def propose(self, batch):
        drafts = []
        for history, sampled in zip(batch.token_history, batch.sampled, strict=True):
            prompt = next(p for p in self.continuations if tuple(history[: len(p)]) == p)
            done = len(history) - len(prompt)
            right = self.continuations[prompt][self.which][done : done + 3] if sampled else []
            drafts.append(
                [(t + 1) % self.vocab if (done + j) % 3 == 2 else t for j, t in enumerate(right)]
            )
        return DraftProposal(drafts, [None] * len(drafts))
