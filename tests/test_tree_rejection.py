"""Tree verification (`cluster.sample.tree_rejection`) is exact.

- The vectorised path equals the per-request loop for the same draws (random trees, full
  and point-mass drafts, greedy and random requests).
- 200,000-trial chi-square tests: the first token, and the first two tokens jointly, have
  the target's distribution, for children drawn from the draft without replacement and
  for deterministic top-k children; a plausible wrong rule (siblings treated as drawn with
  replacement) is rejected by the same test.
- Greedy: the longest path of argmax tokens, then the argmax.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from cluster.draft_tree import DraftTree
from cluster.sample import tree_rejection
from cluster.sample.tree_rejection import (
    TreeRejectionInputs,
    tree_rejection_sample,
    tree_rejection_sample_loop,
)

VOCAB = 5
TRIALS = 200_000
# root: 3 children; the first two have 2 children each; one grandchild has a child
SHAPE = (-1, -1, -1, 0, 0, 1, 1, 3)


def _random_tree(gen, n, vocab):
    parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    return DraftTree(tuple(tokens), tuple(parents))


def test_vectorised_path_equals_the_loop():
    gen = torch.Generator().manual_seed(0)
    vocab = 7
    for full_q in (True, False):
        trees = [_random_tree(gen, n, vocab) for n in (1, 4, 9, 6, 0, 3)]
        rows = sum(t.num_nodes + 1 for t in trees)
        p = torch.rand(rows, vocab, generator=gen) ** 3
        p = p / p.sum(-1, keepdim=True)
        greedy = torch.tensor([False, True, False, False, True, False])
        start = 0
        for t, g in zip(trees, greedy.tolist(), strict=True):
            if g:  # greedy requests verify against point masses on the argmax
                block = p[start : start + t.num_nodes + 1]
                p[start : start + t.num_nodes + 1] = torch.nn.functional.one_hot(
                    block.argmax(-1), vocab
                ).float()
            start += t.num_nodes + 1
        q = torch.softmax(torch.randn(rows, vocab, generator=gen), -1) if full_q else None
        uniforms = torch.rand(len(trees), 9, generator=gen, dtype=torch.float64)
        uniforms[greedy] = 0
        inv_exp = 1 / torch.empty(len(trees), vocab).exponential_(generator=gen)
        inv_exp[greedy] = 1
        # with full drafts, some requests' children are point masses all the same
        mixed = torch.tensor([True, False, True, False, True, True]) if full_q else None
        for has_q in (None, mixed):
            x = TreeRejectionInputs(trees, p, q, uniforms, inv_exp, has_q)
            fast, slow = tree_rejection_sample(x), tree_rejection_sample_loop(x)
            assert torch.equal(fast.token_ids, slow.token_ids)
            assert fast.accepted_nodes == slow.accepted_nodes


def test_greedy_takes_the_longest_argmax_path():
    # root's argmax is 3 (the second child), then node 1's argmax is 4 (its child 3)
    tree = DraftTree((2, 3, 3, 4, 1), (-1, -1, 0, 1, 1))
    argmax = [3, 0, 4, 2, 0, 1]
    p = torch.nn.functional.one_hot(torch.tensor(argmax), VOCAB).float()
    x = TreeRejectionInputs(
        [tree], p, None, torch.zeros(1, 5, dtype=torch.float64), torch.ones(1, VOCAB)
    )
    out = tree_rejection_sample(x)
    assert out.accepted_nodes == [[1, 3]]
    assert out.token_ids.tolist() == [[3, 4, 0]]  # then node 3's argmax (row 4): the bonus


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
    x = TreeRejectionInputs(
        trees,
        target.contiguous(),
        draft.contiguous() if sampled else None,
        torch.rand(TRIALS, n, generator=gen, dtype=torch.float64),
        1 / torch.empty(TRIALS, VOCAB).exponential_(generator=gen),
    )
    out = tree_rejection_sample(x).token_ids
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
    monkeypatch.setattr(tree_rejection, "_without", lambda q, point: q)
    first_p, joint_p = _pvalues(*_run(True, seed=3))
    assert min(first_p, joint_p) < 1e-6
