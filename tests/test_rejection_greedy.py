"""Greedy verification: the longest prefix where draft == argmax, then the argmax; bonus only
when every draft matched; -1 after. Runs on both backends (Triton under the interpreter on
CPU). Also: greedy requests consume no random numbers."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the Triton kernels then run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from cluster.sample.rejection import rejection_sample

VOCAB = 11
BACKENDS = ["torch", "triton"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def probs_with_argmax(argmax: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """[len(argmax), vocab] random distributions whose argmax is the given token."""
    gen = torch.Generator().manual_seed(len(argmax))
    probs = torch.rand(len(argmax), vocab, generator=gen) * 0.5
    probs[torch.arange(len(argmax)), torch.tensor(argmax, dtype=torch.int64)] = 1.0
    return (probs / probs.sum(dim=1, keepdim=True)).to(DEVICE)


def greedy_sample(drafts: list[list[int]], argmax: list[list[int]], bonus: list[int], backend: str):
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=DEVICE)
    return rejection_sample(
        draft_token_ids=flat,
        num_draft_tokens=[len(d) for d in drafts],
        draft_probs=None,
        target_probs=probs_with_argmax([t for a in argmax for t in a]),
        bonus_token_ids=torch.tensor(bonus, dtype=torch.int64, device=DEVICE),
        is_greedy=torch.ones(len(drafts), dtype=torch.bool, device=DEVICE),
        backend=backend,
    ).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("drafts", "argmax", "bonus", "expected"),
    [
        pytest.param([[1, 2, 3]], [[1, 2, 3]], [4], [[1, 2, 3, 4]], id="perfect_match"),
        pytest.param([[1, 2, 3]], [[1, 5, 3]], [4], [[1, 5, -1, -1]], id="early_mismatch"),
        pytest.param([[1, 2, 3]], [[9, 2, 3]], [4], [[9, -1, -1, -1]], id="first_mismatch"),
        pytest.param([[1, 2, 3]], [[1, 2, 7]], [4], [[1, 2, 7, -1]], id="last_mismatch"),
        pytest.param([[]], [[]], [5], [[5]], id="no_drafts"),
        pytest.param([[1, 2], [3]], [[1, 2], [4]], [5, 6], [[1, 2, 5], [4, -1, -1]], id="ragged"),
        pytest.param(
            [[], [1], [], [2, 3]],
            [[], [1], [], [2, 4]],
            [7, 8, 9, 10],
            [[7, -1, -1], [1, 8, -1], [9, -1, -1], [2, 4, -1]],
            id="some_without_drafts",
        ),
        pytest.param([], [], [], [], id="empty_batch"),
    ],
)
def test_greedy_cases(drafts, argmax, bonus, expected, backend):
    assert greedy_sample(drafts, argmax, bonus, backend) == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_property_on_random_batches(backend):
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        num_draft = torch.randint(0, 6, (24,), generator=gen).tolist()
        probs = torch.rand(sum(num_draft), 37, generator=gen).to(DEVICE)  # vocab 37
        argmax = probs.argmax(dim=1).cpu()
        # Each draft matches the argmax with probability 0.8, so long prefixes occur.
        noise = torch.randint(0, 37, argmax.shape, generator=gen)
        drafts = torch.where(torch.rand(argmax.shape, generator=gen) < 0.8, argmax, noise)
        bonus = torch.randint(0, 37, (24,), generator=gen)
        greedy = torch.ones(24, dtype=torch.bool, device=DEVICE)
        drafts_d, bonus_d = drafts.to(DEVICE), bonus.to(DEVICE)
        out = rejection_sample(drafts_d, num_draft, None, probs, bonus_d, greedy, None, backend)
        out = out.tolist()
        start = 0
        for i, n in enumerate(num_draft):
            d, a = drafts[start : start + n].tolist(), argmax[start : start + n].tolist()
            start += n
            matched = next((j for j in range(n) if d[j] != a[j]), n)
            want = d[:matched] + ([a[matched]] if matched < n else [int(bonus[i])])
            assert out[i] == want + [-1] * (max(num_draft) + 1 - len(want))


def random_request_inputs(num_draft: list[int], vocab: int = VOCAB):
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(sum(num_draft), vocab, generator=gen), dim=1)
    drafts = torch.randint(0, vocab, (sum(num_draft),), generator=gen)
    bonus = torch.randint(0, vocab, (len(num_draft),), generator=gen)
    return drafts.to(DEVICE), probs.to(DEVICE), bonus.to(DEVICE)


def global_rng_states() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    return states + ([torch.cuda.get_rng_state()] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_greedy_batch_consumes_no_random_numbers(backend):
    num_draft = [3, 0, 2]
    drafts, probs, bonus = random_request_inputs(num_draft)
    generators = {i: torch.Generator(device=DEVICE).manual_seed(i) for i in range(3)}
    states = {i: g.get_state() for i, g in generators.items()}
    global_states = global_rng_states()
    greedy = torch.ones(3, dtype=torch.bool, device=DEVICE)
    rejection_sample(drafts, num_draft, None, probs, bonus, greedy, generators, backend)
    assert all(map(torch.equal, global_rng_states(), global_states))
    for i, g in generators.items():
        assert torch.equal(g.get_state(), states[i])


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_batch_advances_only_random_generators_with_drafts(backend):
    num_draft = [3, 2, 0, 2]
    drafts, probs, bonus = random_request_inputs(num_draft)
    greedy = torch.tensor([True, False, False, True], device=DEVICE)
    generators = {i: torch.Generator(device=DEVICE).manual_seed(i) for i in range(4)}
    states = {i: g.get_state() for i, g in generators.items()}
    global_states = global_rng_states()
    rejection_sample(drafts, num_draft, None, probs, bonus, greedy, generators, backend)
    changed = {i: not torch.equal(g.get_state(), states[i]) for i, g in generators.items()}
    # Request 1 is random with drafts; 2 is random without drafts; 0 and 3 are greedy.
    assert changed == {0: False, 1: True, 2: False, 3: False}
    # Every random request is seeded, so the global generators are untouched too.
    assert all(map(torch.equal, global_rng_states(), global_states))
