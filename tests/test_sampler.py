"""Sampler: greedy, temperature, top-k, top-p, min-p, penalties, seeds and logprobs.

Distribution tests draw 200,000 rows in one call and accept a chi-square p-value > 1e-3
(fixed seeds); each also shows it can reject a nearby wrong distribution (p < 1e-6).
"""

from __future__ import annotations

import os

import torch
from sampling_helpers import make_generators

if not torch.cuda.is_available():  # the Triton kernels then run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
from scipy.stats import chisquare

from cluster.sample import LogitsRows, Sampler, SamplingMetadata
from cluster.sample.processing import process_logits
from cluster.sampling_params import SamplingParams

TRIALS = 200_000


def metadata(params, vocab, prompts=None, outputs=None, generators=None) -> SamplingMetadata:
    if prompts is None:
        prompts = [[] for _ in params]
    if outputs is None:
        outputs = [[] for _ in params]
    if generators is None:
        generators = make_generators(params)
    return SamplingMetadata.from_params(
        params,
        vocab,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        generators=generators,
    )


def processed(logits: torch.Tensor, params, **kwargs) -> torch.Tensor:
    md = metadata(params, logits.shape[1], **kwargs)
    return process_logits(logits, md, LogitsRows.one_per_request(len(params), logits.device))


def expected_distribution(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """Independent float64 statement of the pipeline: temperature, min-p, top-k, top-p."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    if top_k > 0:
        keep &= z >= np.sort(z[keep])[::-1][min(top_k, keep.sum()) - 1]
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    dropped = order[mass_before >= top_p] if top_p < 1 else []
    probs[dropped] = 0.0
    return probs / probs.sum()


def assert_follows(counts: np.ndarray, probs: np.ndarray) -> None:
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the allowed set"
    expected = probs[support] * counts.sum()
    assert chisquare(counts[support], expected).pvalue > 1e-3
    wrong = probs[support].copy()
    wrong[wrong.argmax()] -= 0.01
    wrong[wrong.argmin()] += 0.01
    assert chisquare(counts[support], wrong * counts.sum()).pvalue < 1e-6


def sample_counts(logits_row: torch.Tensor, params: SamplingParams, seed: int) -> np.ndarray:
    torch.manual_seed(seed)
    vocab = logits_row.shape[0]
    out = Sampler()(logits_row.repeat(TRIALS, 1), metadata([params] * TRIALS, vocab))
    return torch.bincount(out.token_ids, minlength=vocab).numpy()


LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.4, 0.1, -0.3, -0.8, -1.5, -2.4])


def test_temperature_distribution():
    counts = sample_counts(LOGITS, SamplingParams(temperature=0.7), seed=0)
    assert_follows(counts, expected_distribution(LOGITS, temperature=0.7))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1.3, "top_k": 4},
        {"temperature": 0.9, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.2},
        {"temperature": 0.8, "top_k": 7, "top_p": 0.9, "min_p": 0.05},
    ],
)
def test_filtered_distribution(kwargs):
    counts = sample_counts(LOGITS, SamplingParams(**kwargs), seed=1)
    assert_follows(counts, expected_distribution(LOGITS, **kwargs))


def test_greedy_takes_the_argmax_and_ignores_filters():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5)] * 16
    out = Sampler()(logits, metadata(params, 50))
    assert torch.equal(out.token_ids, logits.argmax(dim=1))


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    out = processed(logits, [SamplingParams(top_k=2)])
    assert torch.isfinite(out).tolist() == [[True, True, True, False, False]]


@pytest.mark.parametrize(("top_p", "kept"), [(0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (1.0, 4)])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    out = processed(logits, [SamplingParams(top_p=top_p)])
    assert int(torch.isfinite(out).sum()) == kept


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-8])
def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token(top_p):
    """5e-324 is a legal top_p that rounds to 0 in float32: it must leave the argmax, not
    an empty distribution (which once made the rejection sampler kill the engine)."""
    logits = torch.tensor([[0.1, 0.5, 0.3, 0.1]]).log()
    out = processed(logits, [SamplingParams(temperature=1.0, top_p=top_p)])
    assert torch.isfinite(out).tolist() == [[False, True, False, False]]
    tokens = Sampler()(logits, metadata([SamplingParams(temperature=1.0, top_p=top_p)], 4))
    assert tokens.token_ids.tolist() == [1]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    out = processed(logits, [SamplingParams(min_p=0.31)])  # threshold 0.155
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(
        repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, temperature=0.0
    )
    out = processed(logits, [params], prompts=[[0, 1]], outputs=[[3, 3, 4]])
    # Repetition on prompt + output tokens (0, 1, 3, 4): positive / 2, negative * 2.
    # Then output counts (3: 2, 4: 1): -0.25 * count - 0.5 * present.
    expected = [[1.0, -2.0, 0.5, 1.5 - 0.5 - 0.5, -4.0 - 0.25 - 0.5]]
    assert out.tolist() == expected


def random_params(n: int, seed: int) -> list[SamplingParams]:
    rng = np.random.default_rng(seed)
    return [
        SamplingParams(
            temperature=float(rng.choice([0.0, 0.5, 1.0, 1.7])),
            top_k=int(rng.choice([-1, 1, 3, 20])),
            top_p=float(rng.choice([1.0, 0.9, 0.5])),
            min_p=float(rng.choice([0.0, 0.1])),
            repetition_penalty=float(rng.choice([1.0, 1.2])),
            presence_penalty=float(rng.choice([0.0, -0.5, 1.0])),
            frequency_penalty=float(rng.choice([0.0, 0.3])),
        )
        for _ in range(n)
    ]


def test_vectorised_batch_equals_each_request_alone():
    gen = torch.Generator().manual_seed(3)
    params = random_params(24, seed=3)
    logits = 3 * torch.randn(24, 40, generator=gen)
    prompts = [torch.randint(0, 40, (5,), generator=gen).tolist() for _ in params]
    outputs = [torch.randint(0, 40, (i % 4,), generator=gen).tolist() for i in range(24)]
    batch = processed(logits, params, prompts=prompts, outputs=outputs)
    for i, p in enumerate(params):
        alone = processed(logits[i : i + 1], [p], prompts=[prompts[i]], outputs=[outputs[i]])
        assert torch.equal(batch[i : i + 1], alone)


def run_steps(params, index, batch_params, steps=4):
    """Tokens of request `index` over several steps, generators kept across steps."""
    generators = make_generators(batch_params)
    logits = torch.randn(steps, 64, generator=torch.Generator().manual_seed(4))
    tokens = []
    for step in range(steps):
        torch.manual_seed(100 + step + len(batch_params))  # unseeded rows differ per batch
        md = metadata(batch_params, 64, generators=generators)
        out = Sampler()(logits[step].repeat(len(batch_params), 1), md)
        tokens.append(int(out.token_ids[index]))
    return tokens


def test_seeded_request_is_independent_of_the_batch():
    seeded = SamplingParams(temperature=1.5, seed=1234)
    alone = run_steps(seeded, 0, [seeded])
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    crowded = run_steps(seeded, 2, [*others, seeded, SamplingParams(seed=9)])
    assert alone == crowded
    assert alone != run_steps(seeded, 0, [SamplingParams(temperature=1.5, seed=4321)])


def test_greedy_rows_consume_no_random_numbers():
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=0.0, seed=1), SamplingParams(seed=2)]
    generators = make_generators(params)
    greedy_state = generators[0].get_state()
    global_state = torch.get_rng_state()
    Sampler()(logits[:2], metadata(params, 20, generators=generators))
    assert torch.equal(generators[0].get_state(), greedy_state)
    assert torch.equal(torch.get_rng_state(), global_state)  # the random row is seeded
    Sampler()(logits[:1], metadata([SamplingParams(temperature=0.0)], 20))
    assert torch.equal(torch.get_rng_state(), global_state)


def test_raw_logprobs_values_ranks_and_top_n():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 30, generator=gen)
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(logprobs=0)]
    out = Sampler()(logits, metadata(params, 30))
    lp = out.logprobs
    reference = logits.log_softmax(dim=1)
    for row in (0, 2):
        token = int(out.token_ids[row])
        assert int(lp.token_ids[row, 0]) == token
        assert float(lp.logprobs[row, 0]) == float(reference[row, token])
        assert int(lp.ranks[row]) == int((reference[row] > reference[row, token]).sum()) + 1
    top = reference[0].topk(3)
    assert lp.token_ids[0, 1:].tolist() == top.indices.tolist()
    assert torch.equal(lp.logprobs[0, 1:], top.values)
    assert lp.token_ids[1].tolist() == [-1] * 4 and int(lp.ranks[1]) == -1  # not requested
    assert lp.token_ids[2, 1:].tolist() == [-1] * 3  # logprobs=0: the sampled token only


def test_processed_logprobs_use_the_processed_distribution():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=0.5, top_k=5, logprobs=2)] * 2
    out = Sampler(logprobs_mode="processed")(logits, metadata(params, 30))
    reference = processed(logits, params).log_softmax(dim=1)
    chosen = reference.gather(1, out.token_ids[:, None]).squeeze(1)
    assert torch.equal(out.logprobs.logprobs[:, 0], chosen)
    assert bool(torch.isfinite(out.logprobs.logprobs).all())  # sampled and top-2 lie in top-5


def test_metadata_rejects_inconsistent_inputs():
    seeded = SamplingParams(seed=3)
    with pytest.raises(ValueError, match="generators: request 0 has seed=3"):
        SamplingMetadata.from_params([seeded], 10)
    penalised = SamplingParams(presence_penalty=1.0)
    with pytest.raises(ValueError, match="prompt_token_ids: one list per request"):
        SamplingMetadata.from_params([penalised], 10)
    with pytest.raises(ValueError, match=r"output_token_ids must lie in \[0, 10\)"):
        SamplingMetadata.from_params(
            [penalised], 10, prompt_token_ids=[[1]], output_token_ids=[[10]]
        )
    with pytest.raises(ValueError, match=r"params\[0\].logprobs must be <= vocab_size"):
        SamplingMetadata.from_params([SamplingParams(logprobs=11)], 10)
    with pytest.raises(ValueError, match="logprobs_mode must be"):
        Sampler(logprobs_mode="final")
