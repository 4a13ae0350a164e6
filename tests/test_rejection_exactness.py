"""Rejection sampling is lossless: output tokens follow the target distribution exactly.

Each test runs one batched call of 200,000 requests (one trial per request) with fixed seeds
and applies a chi-square goodness-of-fit test; a sample is accepted when its p-value exceeds
ALPHA = 1e-3. Each test also checks its own power: the same counts must reject a nearby
wrong distribution with p-value < 1e-6, so a pass means something.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the Triton kernels then run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from scipy.stats import chisquare

from cluster.sample.rejection import rejection_sample

TRIALS = 200_000
ALPHA = 1e-3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fits(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of `counts` against `probs` (tokens with zero probability must be
    absent, and are left out of the test)."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    support = probs > 0
    assert int(counts[~support].sum()) == 0, "a token with zero probability was sampled"
    expected = probs[support] / probs[support].sum() * counts.sum()
    return chisquare(counts[support].numpy(), expected.numpy()).pvalue


def nearby_wrong(probs: torch.Tensor) -> torch.Tensor:
    """`probs` with 0.01 of mass moved from its largest to its smallest positive entry."""
    wrong = probs.clone()
    positive = torch.where(probs > 0, probs, torch.inf)
    wrong[probs.argmax()] -= 0.01
    wrong[positive.argmin()] += 0.01
    return wrong


def assert_follows(counts: torch.Tensor, probs: torch.Tensor) -> None:
    assert fits(counts, probs) > ALPHA
    assert fits(counts, nearby_wrong(probs)) < 1e-6  # the test has the power to notice


def run(p_rows, q_rows, drafts_from, seed: int):
    """One call: TRIALS requests, each with the drafts and distributions of `p_rows`.

    p_rows, q_rows: [k, vocab] per draft position (q_rows None = delta drafts);
    drafts_from: [k, vocab] what the drafts are sampled from. Returns [TRIALS, k + 1] tokens
    and [TRIALS, k] drafts.
    """
    k = p_rows.shape[0]
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(drafts_from, TRIALS, replacement=True, generator=gen).T
    torch.manual_seed(seed + 1000)  # a stream unrelated to the drafts' (same seed = same numbers)
    out = rejection_sample(
        draft_token_ids=drafts.reshape(-1).to(DEVICE),
        num_draft_tokens=[k] * TRIALS,
        draft_probs=None if q_rows is None else q_rows.repeat(TRIALS, 1).to(DEVICE),
        target_probs=p_rows.repeat(TRIALS, 1).to(DEVICE),
        bonus_token_ids=torch.zeros(TRIALS, dtype=torch.int64, device=DEVICE),
        is_greedy=torch.zeros(TRIALS, dtype=torch.bool, device=DEVICE),
    )
    return out.cpu(), drafts


def random_distributions(seed: int, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k, vocab, generator=gen), dim=1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen), dim=1)
    return p, q


def test_first_token_follows_p_with_draft_probabilities():
    p, q = random_distributions(seed=0, k=2, vocab=6)
    out, _ = run(p, q, drafts_from=q, seed=1)
    assert_follows(torch.bincount(out[:, 0], minlength=6), p[0])


def test_second_token_follows_p_given_the_first_draft_was_accepted():
    p, q = random_distributions(seed=2, k=2, vocab=6)
    out, drafts = run(p, q, drafts_from=q, seed=3)
    accepted = out[:, 0] == drafts[:, 0]
    assert int(accepted.sum()) > TRIALS // 4
    assert_follows(torch.bincount(out[accepted, 1], minlength=6), p[1])


def test_first_token_follows_p_with_delta_drafts():
    p, _ = random_distributions(seed=4, k=2, vocab=6)
    drafter = torch.softmax(torch.arange(6.0), dim=0).repeat(2, 1)  # unrelated to p
    out, _ = run(p, None, drafts_from=drafter, seed=5)
    assert_follows(torch.bincount(out[:, 0], minlength=6), p[0])


def test_second_token_follows_p_with_delta_drafts_given_acceptance():
    p, _ = random_distributions(seed=6, k=2, vocab=6)
    out, drafts = run(p, None, drafts_from=p, seed=7)
    accepted = out[:, 0] == drafts[:, 0]
    assert_follows(torch.bincount(out[accepted, 1], minlength=6), p[1])


def acceptance_tolerance(rate: float) -> float:
    return 4 * (rate * (1 - rate) / TRIALS) ** 0.5  # four standard deviations


def test_worked_example_with_draft_probabilities():
    """The textbook case: q = (A .5, B .1, C .4), p = (.5, .3, .2): acceptance 0.8, and every
    rejection recovers B, so P(B) = 0.1 + 0.2 = 0.3."""
    q = torch.tensor([[0.5, 0.1, 0.4]])
    p = torch.tensor([[0.5, 0.3, 0.2]])
    out, drafts = run(p, q, drafts_from=q, seed=8)
    accepted = out[:, 0] == drafts[:, 0]
    assert abs(accepted.double().mean().item() - 0.8) < acceptance_tolerance(0.8)
    assert bool((out[~accepted, 0] == 1).all())  # residual = {B: 1}
    assert bool((out[accepted, 1] == 0).all()) and bool((out[~accepted, 1] == -1).all())
    assert_follows(torch.bincount(out[:, 0], minlength=3), p[0])


def test_worked_example_with_delta_draft():
    """No draft probabilities: p = (A .1, B .2, C .3, D .4), draft B with no q: acceptance 0.2, and the
    recovered token follows {A .125, C .375, D .5}."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    always_b = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    out, _ = run(p, None, drafts_from=always_b, seed=9)
    accepted = out[:, 0] == 1
    assert abs(accepted.double().mean().item() - 0.2) < acceptance_tolerance(0.2)
    recovered = torch.bincount(out[~accepted, 0], minlength=4)
    assert_follows(recovered, torch.tensor([0.125, 0.0, 0.375, 0.5]))
    assert_follows(torch.bincount(out[:, 0], minlength=4), p[0])
