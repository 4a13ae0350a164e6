"""The Triton kernel, the vectorised torch path and the per-request loop agree on chains
(the public `rejection_sample` layout: one row per draft, the bonus given); trees are in
`test_tree_rejection.py`.

Given the same random draws, all three must return identical tokens (greedy and random
rows alike), on vocabularies that are not powers of two, with requests without drafts,
and in all-greedy, all-random and mixed batches. Through the public function, the two
backends given the same seeds also agree exactly; with independent randomness their
outputs must be statistically indistinguishable.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the Triton kernels then run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
from rejection_oracle import rejection_sample_loop as oracle_loop
from scipy.stats import chi2_contingency

from cluster.kernels import rejection, rejection_triton
from cluster.kernels.backend import use_triton
from cluster.kernels.rejection_inputs import RejectionInputs
from cluster.sample.rejection import rejection_sample

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module", autouse=True)
def triton_runnable():
    try:
        use_triton("triton", DEVICE)
    except RuntimeError as error:
        pytest.fail(f"{error} (tests/conftest.py or the shell must set it)")


def to_device(inputs: RejectionInputs) -> RejectionInputs:
    moved = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in vars(inputs).items()}
    return RejectionInputs(**moved)


def chain_inputs(*, cu_num_draft_tokens, max_spec_len, **fields) -> RejectionInputs:
    """Chains in `rejection_sample`'s layout: request i's rows are its drafts' (cu[i] on)."""
    num_draft = (cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]).tolist()
    assert max(num_draft, default=0) == max_spec_len
    return RejectionInputs.for_chains(num_draft, **fields)


def rejection_sample_ref(inputs: RejectionInputs) -> torch.Tensor:
    return rejection.rejection_sample_ref(inputs).token_ids


def rejection_sample_loop(inputs: RejectionInputs) -> torch.Tensor:
    return oracle_loop(inputs).token_ids


def rejection_sample_triton(inputs: RejectionInputs) -> torch.Tensor:
    return rejection_triton.rejection_sample_triton(inputs).token_ids


def random_case(seed: int, batch: int, vocab: int, greedy: str, delta: bool) -> RejectionInputs:
    """Random drafts that often match the target's likely tokens, and random draws."""
    gen = torch.Generator().manual_seed(seed)
    num_draft = torch.randint(0, 6, (batch,), generator=gen)
    num_draft[0] = 0  # always at least one request without drafts
    num_tokens = int(num_draft.sum())
    # Peaked targets so acceptance is neither always nor never.
    target = torch.softmax(3 * torch.randn(num_tokens, vocab, generator=gen), dim=1)
    draft_probs = None
    if delta:
        drafts = target.argmax(dim=1)
        noise = torch.randint(0, vocab, (num_tokens,), generator=gen)
        drafts = torch.where(torch.rand(num_tokens, generator=gen) < 0.3, noise, drafts)
    else:
        draft_probs = torch.softmax(torch.log(target) + torch.randn(target.shape, generator=gen), 1)
        drafts = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)
    is_greedy = {
        "all_greedy": torch.ones(batch, dtype=torch.bool),
        "all_random": torch.zeros(batch, dtype=torch.bool),
        "mixed": torch.rand(batch, generator=gen) < 0.5,
    }[greedy]
    cu = torch.zeros(batch + 1, dtype=torch.int64)
    cu[1:] = num_draft.cumsum(0)
    inv_exponentials = torch.empty(batch, vocab).exponential_(generator=gen).reciprocal_()
    inputs = chain_inputs(
        draft_token_ids=drafts,
        cu_num_draft_tokens=cu,
        draft_probs=draft_probs,
        target_probs=target,
        bonus_token_ids=torch.randint(0, vocab, (batch,), generator=gen),
        is_greedy=is_greedy,
        uniforms=torch.rand(num_tokens, dtype=torch.float64, generator=gen),
        inv_exponentials=inv_exponentials,
        max_spec_len=int(num_draft.max()),
    )
    return to_device(inputs)


@pytest.mark.parametrize("greedy", ["all_greedy", "all_random", "mixed"])
@pytest.mark.parametrize("delta", [True, False], ids=["delta_drafts", "draft_probs"])
@pytest.mark.parametrize("vocab", [7, 1000, 4099, 9001])
def test_backends_identical_given_the_same_draws(vocab, delta, greedy):
    for seed in range(3):
        inputs = random_case(seed, batch=12, vocab=vocab, greedy=greedy, delta=delta)
        ref = rejection_sample_ref(inputs)
        assert torch.equal(rejection_sample_triton(inputs), ref)
        assert torch.equal(rejection_sample_loop(inputs), ref)


def test_cases_exercise_every_outcome():
    """Guard for the test above: its cases include accepts, rejections and full acceptance."""
    outputs, draft_counts = [], []
    for seed in range(3):
        inputs = random_case(seed, batch=12, vocab=1000, greedy="mixed", delta=False)
        outputs.append(rejection_sample_ref(inputs))
        draft_counts.append(inputs.num_draft_tokens)
    num_out = torch.cat([(o != -1).sum(dim=1) for o in outputs])
    num_draft = torch.cat(draft_counts)
    assert bool((num_out == num_draft + 1).any())  # every draft accepted, bonus written
    assert bool(((num_out > 1) & (num_out <= num_draft)).any())  # accepted, then recovered
    assert bool(((num_out == 1) & (num_draft > 0)).any())  # first draft rejected


def test_residual_without_mass_falls_back_to_the_target():
    """p == q makes the residual empty; a forced rejection must then draw from p itself."""
    p = torch.tensor([[0.0, 0.25, 0.75, 0.0]])
    inputs = chain_inputs(
        draft_token_ids=torch.tensor([2]),
        cu_num_draft_tokens=torch.tensor([0, 1]),
        draft_probs=p.clone(),
        target_probs=p,
        bonus_token_ids=torch.tensor([3]),
        is_greedy=torch.tensor([False]),
        uniforms=torch.tensor([1.0], dtype=torch.float64),  # u = 1 rejects even p(d) == q(d)
        inv_exponentials=torch.tensor([[1.0, 1.0, 2.0, 9.0]]),
        max_spec_len=1,
    )
    inputs = to_device(inputs)
    # Fallback race over p: scores [0, 0.25, 1.5, 0] -> token 2 (token 3 has no mass).
    for implementation in (rejection_sample_ref, rejection_sample_triton, rejection_sample_loop):
        assert implementation(inputs).tolist() == [[2, -1]]


@pytest.mark.parametrize("delta", [True, False], ids=["delta_drafts", "draft_probs"])
def test_accept_boundary_is_identical(delta):
    """A draft is accepted iff u * q(d) < p(d): exactly at the boundary it is rejected, one
    float64 step below it accepted, in every implementation."""
    p = torch.tensor([[0.1, 0.3, 0.6]])  # float32; p(d) = float64(float32(0.3)) exactly
    q = torch.tensor([[0.25, 0.5, 0.25]])
    ratio = float(p[0, 1]) if delta else float(p[0, 1]) / 0.5  # u at the boundary, exact
    below = float(np.nextafter(ratio, 0.0))
    inputs = to_device(
        chain_inputs(
            draft_token_ids=torch.tensor([1, 1]),
            cu_num_draft_tokens=torch.tensor([0, 1, 2]),
            draft_probs=None if delta else q.repeat(2, 1),
            target_probs=p.repeat(2, 1),
            bonus_token_ids=torch.tensor([2, 2]),
            is_greedy=torch.tensor([False, False]),
            uniforms=torch.tensor([ratio, below], dtype=torch.float64),
            inv_exponentials=torch.tensor([[1.0, 1.0, 1.0]]).repeat(2, 1),
            max_spec_len=1,
        )
    )
    # Request 0 is rejected and recovers the residual's best token; request 1 is accepted.
    recovered = 2
    for implementation in (rejection_sample_ref, rejection_sample_triton, rejection_sample_loop):
        assert implementation(inputs).tolist() == [[recovered, -1], [1, 2]]


def public_inputs(batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_draft = torch.randint(0, 4, (batch,), generator=gen).tolist()
    n = sum(num_draft)
    target = torch.softmax(2 * torch.randn(n, 257, generator=gen), dim=1)
    draft_probs = torch.softmax(2 * torch.randn(n, 257, generator=gen), dim=1)
    drafts = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)
    bonus = torch.randint(0, 257, (batch,), generator=gen)
    is_greedy = torch.rand(batch, generator=gen) < 0.3
    move = (drafts, draft_probs, target, bonus, is_greedy)
    return num_draft, *(t.to(DEVICE) for t in move)


def test_public_backends_identical_with_the_same_seeds():
    num_draft, drafts, draft_probs, target, bonus, is_greedy = public_inputs(16, seed=3)
    outputs = []
    for backend in ("torch", "triton"):
        generators = {i: torch.Generator(device=DEVICE).manual_seed(100 + i) for i in range(16)}
        outputs.append(
            rejection_sample(
                drafts, num_draft, draft_probs, target, bonus, is_greedy, generators, backend
            )
        )
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_seeded_request_output_ignores_batch_composition(backend):
    """A seeded random request alone, then moved into a batch with greedy, unseeded and other
    seeded requests: the same tokens, step after step (its generator persists)."""
    num_draft, drafts, draft_probs, target, bonus, is_greedy = public_inputs(8, seed=6)
    me = next(i for i in range(8) if num_draft[i] > 0 and not bool(is_greedy[i]))
    order = [i for i in range(8) if i != me]
    order.insert(2, me)  # the seeded request sits at index 2 of the crowd
    cu = [0, *torch.tensor(num_draft).cumsum(0).tolist()]
    # Half of q in its target: p(d) / q(d) >= 1/2, so every accept decision depends on u.
    mine = slice(cu[me], cu[me + 1])
    target[mine] = 0.5 * target[mine] + 0.5 * draft_probs[mine]

    def rows(t: torch.Tensor, requests: list[int]) -> torch.Tensor:
        return torch.cat([t[cu[i] : cu[i + 1]] for i in requests])

    alone_gen = torch.Generator(device=DEVICE).manual_seed(42)
    crowd_gens = {2: torch.Generator(device=DEVICE).manual_seed(42)}
    crowd_gens[5] = torch.Generator(device=DEVICE).manual_seed(7)
    for step in range(5):
        torch.manual_seed(step)
        alone = rejection_sample(
            *(rows(drafts, [me]), [num_draft[me]], rows(draft_probs, [me])),
            *(rows(target, [me]), bonus[me : me + 1], is_greedy[me : me + 1]),
            {0: alone_gen},
            backend,
        )
        torch.manual_seed(100 + step)  # the unseeded requests see other numbers
        crowd = rejection_sample(
            *(rows(drafts, order), [num_draft[i] for i in order], rows(draft_probs, order)),
            *(rows(target, order), bonus[order], is_greedy[order]),
            crowd_gens,
            backend,
        )
        assert alone[0].tolist() == crowd[2, : num_draft[me] + 1].tolist()


def test_auto_backend_gives_the_same_tokens():
    num_draft, drafts, draft_probs, target, bonus, is_greedy = public_inputs(8, seed=4)
    outputs = []
    for backend in ("torch", "auto"):
        generators = {i: torch.Generator(device=DEVICE).manual_seed(i) for i in range(8)}
        args = (drafts, num_draft, draft_probs, target, bonus, is_greedy, generators, backend)
        outputs.append(rejection_sample(*args))
    assert torch.equal(outputs[0], outputs[1])


def test_backends_statistically_indistinguishable_with_independent_draws():
    """Two-sample chi-square on (first token, number of output tokens) of independent runs.

    The interpreter is slow, so on CPU this uses 1,200 requests per backend; the exact
    agreement above is the strong check. Threshold: p-value > 1e-3 (fixed seeds)."""
    batch = 200_000 if DEVICE.type == "cuda" else 1_200
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(2, 4, generator=gen), dim=1)
    q = torch.softmax(torch.randn(2, 4, generator=gen), dim=1)
    target, draft_probs = p.repeat(batch, 1), q.repeat(batch, 1)
    drafts = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)
    bonus = torch.full((batch,), 3)
    is_greedy = torch.zeros(batch, dtype=torch.bool)
    args = [t.to(DEVICE) for t in (drafts, draft_probs, target, bonus, is_greedy)]
    table = []
    for seed, backend in ((11, "torch"), (12, "triton")):
        torch.manual_seed(seed)
        out = rejection_sample(args[0], [2] * batch, *args[1:], backend=backend)
        outcome = out[:, 0] * 3 + (out != -1).sum(dim=1) - 1  # 4 tokens x 3 lengths
        table.append(torch.bincount(outcome.cpu(), minlength=12).tolist())
    columns = [c for c in range(12) if table[0][c] + table[1][c] > 0]
    result = chi2_contingency([[row[c] for c in columns] for row in table])
    assert result.pvalue > 1e-3
