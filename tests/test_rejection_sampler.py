"""RejectionSampler: every verified position is processed as the plain Sampler would process
it, the output follows the plain Sampler's distribution, mixed batches stay finite, seeded
requests ignore the rest of the batch, greedy requests draw nothing, and every output token
gets its logprobs.

The distribution test draws 200,000 requests in one call and accepts chi-square p-values
> 1e-3 (fixed seeds).
"""

from __future__ import annotations

import os

import torch
from sampling_helpers import make_generators

if not torch.cuda.is_available():  # the Triton kernels then run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
from scipy.stats import chi2_contingency, chisquare

from cluster.sample import (
    LogitsRows,
    RejectionSampler,
    Sampler,
    SamplingMetadata,
    SpecDecodeMetadata,
)
from cluster.sample.processing import process_logits
from cluster.sampling_params import SamplingParams

# These tests hold their tensors on the CPU, where the Triton backend needs the
# interpreter; on a CUDA host the kernels are checked on the GPU by
# tests/test_rejection_backends.py instead.
BACKENDS = ["torch", "triton"] if os.environ.get("TRITON_INTERPRET") == "1" else ["torch"]


def metadata(params, vocab, outputs=None, prompts=None, generators=None) -> SamplingMetadata:
    return SamplingMetadata.from_params(
        params,
        vocab,
        prompt_token_ids=prompts or [[] for _ in params],
        output_token_ids=outputs or [[] for _ in params],
        generators=make_generators(params) if generators is None else generators,
    )


def test_penalties_see_the_drafts_before_each_position():
    """Greedy, frequency penalty 2 (vLLM ignored penalties on verified positions).

    Row 0 [5, 4.5, 0, 0] -> 0 = draft 0, accepted. Row 1, seeing draft 0: [3, 4.5, 0, 0]
    -> 1 = draft 1, accepted. Bonus row [5, 4.5, 4.4, 0], seeing 0 and 1: [3, 2.5, 4.4, 0]
    -> 2. Without the drafts in the history the output would be [0, 0, -1].
    """
    logits = torch.tensor([[5.0, 4.5, 0.0, 0.0], [5.0, 4.5, 0.0, 0.0], [5.0, 4.5, 4.4, 0.0]])
    spec = SpecDecodeMetadata.from_drafts([[0, 1]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    for backend in BACKENDS:
        out = RejectionSampler(backend=backend)(logits, spec, metadata(params, 4))
        assert out.token_ids.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_without_drafts_get_only_their_bonus_token(backend):
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(9))
    spec = SpecDecodeMetadata.from_drafts([[], [], []])
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=3), SamplingParams(seed=4)]
    out = RejectionSampler(backend=backend)(logits, spec, metadata(params, 20))
    assert out.token_ids.shape == (3, 1)
    assert int(out.token_ids[0, 0]) == int(logits[0].argmax())
    generators = make_generators(params)  # the bonus is the plain Sampler's draw
    plain = Sampler()(logits, metadata(params, 20, generators=generators))
    assert out.token_ids[:, 0].tolist() == plain.token_ids.tolist()


def random_batch(seed: int, batch: int, vocab: int):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    params = [
        SamplingParams(
            temperature=float(rng.choice([0.0, 0.7, 1.2])),
            top_k=int(rng.choice([-1, 5])),
            top_p=float(rng.choice([1.0, 0.85])),
            min_p=float(rng.choice([0.0, 0.05])),
            repetition_penalty=float(rng.choice([1.0, 1.3])),
            presence_penalty=float(rng.choice([0.0, 0.7])),
            frequency_penalty=float(rng.choice([0.0, 0.4])),
            logprobs=int(rng.choice([0, 2, 4])),
            seed=int(rng.integers(1000)),
        )
        for _ in range(batch)
    ]
    drafts = [torch.randint(0, vocab, (i % 4,), generator=gen).tolist() for i in range(batch)]
    prompts = [torch.randint(0, vocab, (3,), generator=gen).tolist() for _ in range(batch)]
    outputs = [torch.randint(0, vocab, (2,), generator=gen).tolist() for _ in range(batch)]
    spec = SpecDecodeMetadata.from_drafts(drafts)
    logits = 2 * torch.randn(sum(map(len, drafts)) + batch, vocab, generator=gen)
    return params, drafts, prompts, outputs, spec, logits


def request_rows(spec: SpecDecodeMetadata, i: int) -> list[int]:
    """Logits rows of request i (a chain): one per draft position, then its bonus position."""
    start = sum(n + 1 for n in spec.num_draft_tokens[:i])
    return list(range(start, start + spec.num_draft_tokens[i] + 1))


def plain_processed(logits_row, params, history, prompt) -> tuple[SamplingMetadata, torch.Tensor]:
    """The plain Sampler's metadata and processed logits for one position of one request."""
    alone = metadata([params], logits_row.shape[0], [history], [prompt])
    return alone, process_logits(logits_row[None], alone, LogitsRows.one_per_request(1, "cpu"))


def test_every_position_is_processed_like_the_plain_sampler():
    params, drafts, prompts, outputs, spec, logits = random_batch(0, batch=12, vocab=30)
    md = metadata(params, 30, outputs, prompts)
    processed = process_logits(logits, md, spec.tree_rows())
    start = 0
    for i, p in enumerate(params):
        n = len(drafts[i])
        ours = processed[start : start + n + 1]  # what the RejectionSampler uses
        start += n + 1
        for j, row in enumerate(request_rows(spec, i)):
            _, plain = plain_processed(logits[row], p, outputs[i] + drafts[i][:j], prompts[i])
            assert torch.equal(plain[0], ours[j])


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_of_every_output_token_match_the_plain_sampler(backend):
    params, drafts, prompts, outputs, spec, logits = random_batch(1, batch=10, vocab=30)
    for mode in ("raw", "processed"):
        md = metadata(params, 30, outputs, prompts)
        sampler = RejectionSampler(Sampler(logprobs_mode=mode), backend=backend)
        out = sampler(logits, spec, md)
        for i, p in enumerate(params):
            n = len(drafts[i])
            tokens = [t for t in out.token_ids[i].tolist() if t != -1]
            assert 1 <= len(tokens) <= n + 1
            for j, token in enumerate(tokens):
                row = logits[request_rows(spec, i)[j]]
                alone, processed = plain_processed(row, p, outputs[i] + drafts[i][:j], prompts[i])
                plain = Sampler(logprobs_mode=mode).logprobs(
                    row[None],
                    processed,
                    torch.tensor([token]),
                    alone,
                    LogitsRows.one_per_request(1, "cpu"),
                )
                width = p.logprobs + 1
                assert torch.equal(out.logprobs.token_ids[i, j, :width], plain.token_ids[0])
                assert torch.equal(out.logprobs.logprobs[i, j, :width], plain.logprobs[0])
                assert int(out.logprobs.ranks[i, j]) == int(plain.ranks[0])
                assert (out.logprobs.token_ids[i, j, width:] == -1).all()
            assert (out.logprobs.token_ids[i, len(tokens) :] == -1).all()  # past the end


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["delta", "draft_probs"])
def test_first_token_follows_the_plain_sampler_distribution(with_draft_probs):
    """temperature 0.8, top-k 6, top-p 0.9, min-p 0.03 over 10 tokens, 2 drafts each."""
    trials, vocab = 200_000, 10
    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.03)
    rows = torch.tensor([[2.0, 1.5, 1.2, 0.9, 0.4, 0.1, -0.3, -0.8, -1.5, -2.4]] * 3)
    rows[1] = rows[1].flip(0)  # the second and bonus positions differ from the first
    rows[2] = rows[2].roll(3)
    q = torch.softmax(torch.randn(2, vocab, generator=gen), dim=1)
    drafts = torch.multinomial(q, trials, replacement=True, generator=gen).T  # [trials, 2]
    spec = SpecDecodeMetadata.from_drafts(drafts.tolist())
    md = metadata([params] * trials, vocab)
    draft_probs = q.repeat(trials, 1) if with_draft_probs else None
    torch.manual_seed(3)
    out = RejectionSampler()(rows.repeat(trials, 1), spec, md, draft_probs)
    spec_counts = torch.bincount(out.token_ids[:, 0], minlength=vocab).numpy()

    torch.manual_seed(4)
    plain = Sampler()(rows[:1].repeat(trials, 1), metadata([params] * trials, vocab))
    plain_counts = torch.bincount(plain.token_ids, minlength=vocab).numpy()

    expected = torch.softmax(process_logits(rows[:1], md, LogitsRows.one_per_request(1, "cpu")), 1)
    expected = expected[0].double().numpy()
    support = expected > 0
    assert 2 <= support.sum() < vocab  # the filters do cut the vocabulary
    for counts in (spec_counts, plain_counts):
        assert counts[~support].sum() == 0
        share = expected[support] / expected[support].sum()
        assert chisquare(counts[support], share * trials).pvalue > 1e-3
    both = np.stack([spec_counts[support], plain_counts[support]])
    assert chi2_contingency(both).pvalue > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_greedy_and_random_batch_stays_finite_and_in_range(backend):
    """vLLM regression: greedy rows in a random batch divided logits by a temperature of 0."""
    gen = torch.Generator().manual_seed(5)
    temps = [0.0, 0.5, 0.0, 1.3, 0.0, 2.0, 0.0, 0.05]
    params = [SamplingParams(temperature=t, top_k=8 if t else -1) for t in temps]
    drafts = [torch.randint(0, 50, (i % 4,), generator=gen).tolist() for i in range(8)]
    spec = SpecDecodeMetadata.from_drafts(drafts)
    logits = 40 * torch.randn(sum(map(len, drafts)) + 8, 50, generator=gen)  # very peaked
    md = metadata(params, 50)
    probs = torch.softmax(process_logits(logits, md, spec.tree_rows()), 1)
    assert bool(torch.isfinite(probs).all())
    out = RejectionSampler(backend=backend)(logits, spec, md).token_ids
    for i, row in enumerate(out.tolist()):
        tokens = [t for t in row if t != -1]
        assert row == tokens + [-1] * (len(row) - len(tokens))  # -1 only after the tokens
        assert 1 <= len(tokens) <= len(drafts[i]) + 1
        assert all(0 <= t < 50 for t in tokens)
        if temps[i] == 0.0:  # greedy: no penalties, so the raw logits' argmax decides
            argmax = [int(logits[r].argmax()) for r in request_rows(spec, i)]
            matched = next((j for j, d in enumerate(drafts[i]) if d != argmax[j]), len(drafts[i]))
            assert tokens == [*drafts[i][:matched], argmax[matched]]


def seeded_outputs(params: list[SamplingParams], drafts: list[list[int]], index: int):
    """Output tokens of request `index` over three steps; generators persist across steps.

    Each request's logits rows depend only on its drafts and the step, so a request sees the
    same logits in every batch; unseeded requests get a different global stream per batch.
    """
    generators = make_generators(params)
    spec = SpecDecodeMetadata.from_drafts(drafts)
    results = []
    for step in range(3):
        logits = torch.cat(
            [
                torch.randn(
                    len(d) + 1, 12, generator=torch.Generator().manual_seed(hash((step, *d)))
                )
                for d in drafts
            ]
        )
        torch.manual_seed(50 + step + len(params))
        out = RejectionSampler()(logits, spec, metadata(params, 12, generators=generators))
        results.append(out.token_ids[index, : len(drafts[index]) + 1].tolist())
    return results


def test_seeded_request_is_independent_of_the_batch():
    seeded = SamplingParams(temperature=1.0, seed=77)
    alone = seeded_outputs([seeded], [[3, 1, 4]], index=0)
    others = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(seed=1)]
    crowded = seeded_outputs([*others, seeded], [[1, 5], [], [9, 2, 6, 8], [3, 1, 4]], index=3)
    assert alone == crowded
    other_seed = [SamplingParams(temperature=1.0, seed=78)]
    assert alone != seeded_outputs(other_seed, [[3, 1, 4]], index=0)


def test_greedy_requests_draw_no_random_numbers():
    params = [SamplingParams(temperature=0.0, seed=5), SamplingParams(temperature=0.0)]
    generators = make_generators(params)
    spec = SpecDecodeMetadata.from_drafts([[1, 2], [3]])
    logits = torch.randn(5, 10)
    state = generators[0].get_state()
    global_state = torch.get_rng_state()
    RejectionSampler()(logits, spec, metadata(params, 10, generators=generators))
    assert torch.equal(torch.get_rng_state(), global_state)
    assert torch.equal(generators[0].get_state(), state)


def test_batch_mismatch_between_spec_and_metadata_is_rejected():
    spec = SpecDecodeMetadata.from_drafts([[1], [2]])
    with pytest.raises(ValueError, match="spec has 2 requests but metadata has 1"):
        RejectionSampler()(torch.randn(4, 10), spec, metadata([SamplingParams()], 10))


def test_value_checks_name_the_bad_tensor():
    """With `check_values` (CLUSTER_DEBUG_CHECKS=1), bad ids and probabilities raise."""
    checked = RejectionSampler(check_values=True)
    params = [SamplingParams(temperature=1.0, seed=1)]
    with pytest.raises(ValueError, match="draft_token_ids must lie in"):
        checked(torch.randn(2, 10), SpecDecodeMetadata.from_drafts([[99]]), metadata(params, 10))
    bad_q = torch.full((1, 10), 0.1)
    bad_q[0, 3] = float("nan")
    spec = SpecDecodeMetadata.from_drafts([[3]])
    with pytest.raises(ValueError, match="draft_probs must be finite"):
        checked(torch.randn(2, 10), spec, metadata(params, 10), bad_q)
    out = RejectionSampler()(torch.randn(2, 10), spec, metadata(params, 10), bad_q.nan_to_num())
    assert out.token_ids.shape == (1, 2)  # unchecked by default
