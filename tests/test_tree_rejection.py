"""Tree verification (`cluster.kernels.rejection`; a chain is a tree of width one) is exact.

- The Triton kernel, the vectorised torch path and the per-request loop return the same
  tokens and accepted nodes for the same draws (random trees, full and point-mass drafts,
  greedy and random requests, leaf rows or a given bonus).
- 200,000-trial chi-square tests: the first token, and the first two tokens jointly, have
  the target's distribution, for children drawn from the draft without replacement and
  for deterministic top-k children; a plausible wrong rule (siblings treated as drawn with
  replacement) is rejected by the same test.
- Greedy: the longest path of argmax tokens, then the argmax.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the Triton kernel then runs under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from rejection_oracle import rejection_sample_loop
from scipy.stats import chisquare

from cluster.draft_tree import DraftTree
from cluster.kernels import rejection
from cluster.kernels.rejection import rejection_sample_ref
from cluster.kernels.rejection_inputs import RejectionInputs
from cluster.kernels.rejection_triton import rejection_sample_triton

VOCAB = 5
TRIALS = 200_000
# root: 3 children; the first two have 2 children each; one grandchild has a child
SHAPE = (-1, -1, -1, 0, 0, 1, 1, 3)


def tree_inputs(
    trees: list[DraftTree],
    target: torch.Tensor,  # [sum(n_i + 1), vocab]: each request's root row, then its nodes'
    draft: torch.Tensor | None,  # same rows: the distribution each node's children came from
    uniforms: torch.Tensor,  # [batch, max_nodes] float64
    inv_exponentials: torch.Tensor,  # [batch, vocab]
    greedy: torch.Tensor | None = None,
    has_draft_probs: torch.Tensor | None = None,
    bonus: torch.Tensor | None = None,
) -> RejectionInputs:
    """The kernel's inputs from per-request trees and rows (drafts' rows from their parents')."""
    n = [t.num_nodes for t in trees]
    cu = torch.tensor([0, *n]).cumsum(0)
    starts = cu[:-1] + torch.arange(len(trees))
    parents = torch.tensor([p for t in trees for p in t.parents], dtype=torch.int64)
    parent_rows = torch.cat([starts[i] + parents[cu[i] : cu[i + 1]] + 1 for i in range(len(trees))])
    return RejectionInputs(
        draft_token_ids=torch.tensor([x for t in trees for x in t.tokens], dtype=torch.int64),
        cu_num_draft_tokens=cu,
        draft_parents=parents,
        target_probs=target,
        target_row_starts=starts,
        draft_probs=None if draft is None else draft[parent_rows].contiguous(),
        has_draft_probs=has_draft_probs,
        bonus_token_ids=bonus,
        is_greedy=torch.zeros(len(trees), dtype=torch.bool) if greedy is None else greedy,
        uniforms=torch.cat([uniforms[i, :k] for i, k in enumerate(n)]),
        inv_exponentials=inv_exponentials,
        max_depth=max(t.depth for t in trees),
        all_chains=all(t.is_chain() for t in trees),
    )


def _random_tree(gen, n, vocab):
    parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    return DraftTree(tuple(tokens), tuple(parents))


@pytest.mark.parametrize("vocab", [3, 7, 4099])
def test_kernel_vectorised_path_and_loop_agree(vocab):
    gen = torch.Generator().manual_seed(vocab)
    folds = 0
    for trial in range(6):
        full_q = trial % 2 == 0
        trees = [_random_tree(gen, n, vocab) for n in (1, 4, 9, 6, 0, 3)]
        rows = sum(t.num_nodes + 1 for t in trees)
        p = torch.rand(rows, vocab, generator=gen) ** 3
        p = p / p.sum(-1, keepdim=True)
        greedy = torch.tensor([False, True, False, False, True, False])
        q = torch.softmax(2 * torch.randn(rows, vocab, generator=gen), -1) if full_q else None
        uniforms = torch.rand(len(trees), 9, generator=gen, dtype=torch.float64)
        inv_exp = 1 / torch.empty(len(trees), vocab).exponential_(generator=gen)
        # with full drafts, some requests' children are point masses all the same
        mixed = torch.tensor([True, False, True, False, True, True]) if trial % 3 == 2 else None
        x = tree_inputs(trees, p, q, uniforms, inv_exp, greedy, mixed if full_q else None)
        ref = rejection_sample_ref(x)
        for other in (rejection_sample_loop(x), rejection_sample_triton(x)):
            assert torch.equal(other.token_ids, ref.token_ids)
            assert torch.equal(other.accepted_nodes, ref.accepted_nodes)
        # guard: random requests rejected a child and then tried one of its siblings
        for i, tree in enumerate(trees):
            if not greedy[i] and int((ref.accepted_nodes[i] >= 0).sum()) < tree.depth:
                path = [n for n in ref.accepted_nodes[i].tolist() if n >= 0]
                end = path[-1] if path else -1
                folds += len(tree.children(end)) > 1
    assert folds > 0


def test_greedy_takes_the_longest_argmax_path():
    # root's argmax is 3 (the second child), then node 1's argmax is 4 (its child 3)
    tree = DraftTree((2, 3, 3, 4, 1), (-1, -1, 0, 1, 1))
    argmax = [3, 0, 4, 2, 0, 1]
    p = torch.nn.functional.one_hot(torch.tensor(argmax), VOCAB).float()
    x = tree_inputs(
        [tree],
        p,
        None,
        torch.zeros(1, 5, dtype=torch.float64),
        torch.ones(1, VOCAB),
        greedy=torch.tensor([True]),
    )
    for implementation in (rejection_sample_ref, rejection_sample_loop, rejection_sample_triton):
        out = implementation(x)
        assert out.accepted_nodes.tolist() == [[1, 3]]
        assert out.token_ids.tolist() == [[3, 4, 0]]  # then node 3's argmax: the bonus


def _markov(seed):
    """A first-order target M (next token given the last) and root distribution, and a
    different draft Q, q0."""
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, -1)
    m = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 1.5, -1)
    q0 = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 1.5, -1)
    return p0, m, q0, q


def _run(sampled: bool, seed: int):
    """TRIALS requests with trees of SHAPE whose tokens the draft chose (drawn without
    replacement, or its top-k); returns the first two output tokens (the second drawn
    from the target after a one-token step, as the next step would)."""
    p0, m, q0, q = _markov(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    n = len(SHAPE)
    tree = DraftTree((0,) * n, SHAPE)
    tokens = torch.zeros(TRIALS, n, dtype=torch.int64)
    for node in range(-1, n):
        kids = tree.children(node)
        if not kids:
            continue
        dist = q0.expand(TRIALS, VOCAB) if node < 0 else q[tokens[:, node]]
        if sampled:  # Gumbel top-k: sequential draws without replacement
            keys = dist.log() - torch.empty(TRIALS, VOCAB).exponential_(generator=gen).log()
        else:
            keys = dist
        tokens[:, kids] = keys.topk(len(kids), dim=-1).indices
    trees = [DraftTree(tuple(r), SHAPE) for r in tokens.tolist()]
    target = torch.cat([p0.expand(TRIALS, 1, VOCAB), m[tokens]], dim=1).reshape(-1, VOCAB)
    draft = torch.cat([q0.expand(TRIALS, 1, VOCAB), q[tokens]], dim=1).reshape(-1, VOCAB)
    x = tree_inputs(
        trees,
        target.contiguous(),
        draft.contiguous() if sampled else None,
        torch.rand(TRIALS, n, generator=gen, dtype=torch.float64),
        1 / torch.empty(TRIALS, VOCAB).exponential_(generator=gen),
    )
    out = rejection_sample_ref(x).token_ids
    first = out[:, 0]
    fresh = torch.multinomial(m[first], 1, generator=gen)[:, 0]
    second = torch.where(out[:, 1] >= 0, out[:, 1], fresh)
    return first, second, p0, m


def _pvalues(first, second, p0, m):
    counts1 = torch.bincount(first, minlength=VOCAB).double()
    joint = torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB).double()
    expected1 = p0.double() / p0.double().sum()
    expected = (p0.double()[:, None] * m.double()).reshape(-1)
    expected = expected / expected.sum()
    return (
        chisquare(counts1.numpy(), (expected1 * TRIALS).numpy()).pvalue,
        chisquare(joint.numpy(), (expected * TRIALS).numpy()).pvalue,
    )


@pytest.mark.parametrize("sampled", [True, False], ids=["without_replacement", "top_k"])
def test_first_tokens_have_the_target_distribution(sampled):
    first_p, joint_p = _pvalues(*_run(sampled, seed=3))
    assert first_p > 1e-3 and joint_p > 1e-3


def test_a_wrong_rule_is_rejected(monkeypatch):
    """Siblings drawn without replacement but verified as if drawn with replacement (q
    kept after a rejection): the joint test sees it."""
    right = rejection.after_rejection

    def keep_q(p, q, full, token):
        return right(p, q, full, token)[0], q

    monkeypatch.setattr(rejection, "after_rejection", keep_q)
    first_p, joint_p = _pvalues(*_run(True, seed=3))
    assert min(first_p, joint_p) < 1e-6
