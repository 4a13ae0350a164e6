"""Lossless verification of draft trees (`cluster.draft_tree.DraftTree`).

Walking down from the root, at each node the target's distribution `p` there decides
among the node's children, tried in order (the recursive rule of SpecInfer / EAGLE /
"Recursive Speculative Decoding", Jeon et al. 2024):

- child x (drawn from the draft's `q` at the node, without replacement among its
  siblings; or chosen deterministically: then q is a point mass on x) is accepted when
  `u * q(x) < p(x)`, `u ~ U[0, 1)`, i.e. with probability min(1, p(x) / q(x));
- on rejection, `p <- normalise(max(p - q, 0))` (for a point mass: p without x) and
  `q <- normalise(q without x)`, and the next child is tried against those;
- when a child is accepted, the walk continues from it; when every child is rejected,
  the recovered token is drawn from the current p; at a leaf, the bonus token is drawn
  from the leaf's p. Either way the step ends with one token drawn from a p.

Each stage is an ordinary speculative step whose target is the p it starts from and
whose draft is a genuine draw from the q it uses, so the token emitted at every depth has
exactly the target's distribution given the tokens before it. Greedy requests (p a point
mass on the argmax, u = 0) accept the first child equal to the argmax and otherwise emit
the argmax. If rounding leaves a residual without mass, p is kept as it was.

Randomness is an input (`uniforms`: one per node, each node is tried at most once;
`inv_exponentials`: one race per request, `argmax(p / E)` with E ~ Exp(1)), so the
vectorised path and the per-request loop below return the same tokens for the same draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.draft_tree import DraftTree

PLACEHOLDER = -1


@dataclass(frozen=True)
class TreeRejectionInputs:
    trees: list[DraftTree]  # [batch]
    # [sum(n_i + 1), vocab] float32: request i's rows start at `row_starts[i]`; row 0 of a
    # request is the root's (the distribution of its first token), row j + 1 node j's
    target_probs: torch.Tensor
    # same rows: the draft distribution each node's children were drawn from; None when
    # every child was chosen deterministically (point masses)
    draft_probs: torch.Tensor | None
    uniforms: torch.Tensor  # [batch, max_nodes] float64 in [0, 1); 0 for greedy requests
    inv_exponentials: torch.Tensor  # [batch, vocab] float32, 1 / E; 1 for greedy requests
    # [batch] bool: whose children were drawn from `draft_probs` (the others' are point
    # masses); None: every request's, when `draft_probs` is given
    has_draft_probs: torch.Tensor | None = None

    @property
    def row_starts(self) -> list[int]:
        starts, row = [], 0
        for tree in self.trees:
            starts.append(row)
            row += tree.num_nodes + 1
        return starts


@dataclass(frozen=True)
class TreeVerification:
    token_ids: torch.Tensor  # [batch, max_depth + 1] output tokens, PLACEHOLDER after the last
    accepted_nodes: list[list[int]]  # [batch][num accepted] the accepted path's nodes

    @property
    def num_output_tokens(self) -> list[int]:
        return [len(path) + 1 for path in self.accepted_nodes]


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(p - q, 0)) per row, or p where that leaves no mass."""
    r = (p - q).clamp(min=0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def _without(q: torch.Tensor, point: torch.Tensor) -> torch.Tensor:
    """q with the point mass's token removed, renormalised (the siblings after a rejected
    child were drawn without it); q itself where nothing would be left."""
    rest = q * (1 - point)
    total = rest.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, rest / total.clamp(min=1e-30), q)


def _children_table(trees: list[DraftTree], max_nodes: int) -> torch.Tensor:
    """[batch, max_nodes + 1, max_children]: the c-th child of row r (node r - 1), -1
    if none; computed once per tree shape."""
    shapes: dict[tuple[int, ...], list[list[int]]] = {}
    for tree in trees:
        if tree.parents not in shapes:
            shapes[tree.parents] = [tree.children(n) for n in range(-1, tree.num_nodes)]
    slots = max((len(k) for kids in shapes.values() for k in kids), default=0)
    tables = {}
    for parents, kids in shapes.items():
        table = torch.full((max_nodes + 1, max(slots, 1)), -1, dtype=torch.int64)
        for row, row_kids in enumerate(kids):
            table[row, : len(row_kids)] = torch.tensor(row_kids, dtype=torch.int64)
        tables[parents] = table
    return torch.stack([tables[t.parents] for t in trees])


def tree_rejection_sample(x: TreeRejectionInputs) -> TreeVerification:
    """Vectorised over requests: depth by depth, each request's current node tries its
    children slot by slot."""
    batch, device = len(x.trees), x.target_probs.device
    vocab = x.target_probs.shape[1]
    starts = torch.tensor(x.row_starts, dtype=torch.int64, device=device)
    max_nodes = max(t.num_nodes for t in x.trees)
    children = _children_table(x.trees, max_nodes).to(device)  # [batch, max_nodes + 1, slots]
    width = max(max_nodes, 1)
    tokens = (
        torch.tensor(
            [list(t.tokens) + [0] * (width - t.num_nodes) for t in x.trees], dtype=torch.int64
        )
        .reshape(batch, width)
        .to(device)
    )
    rows = torch.arange(batch, device=device)
    current = torch.zeros(batch, dtype=torch.int64, device=device)  # row: node + 1
    p = x.target_probs[starts]  # [batch, vocab]
    q = x.draft_probs[starts] if x.draft_probs is not None else None
    full_q = x.has_draft_probs
    if q is not None and full_q is None:
        full_q = torch.ones(batch, dtype=torch.bool, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    final = torch.full((batch,), PLACEHOLDER, dtype=torch.int64, device=device)
    path: list[torch.Tensor] = []  # per depth: [batch] accepted node or -1
    for _ in range(max(t.depth for t in x.trees) + 1):
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        step = torch.full((batch,), -1, dtype=torch.int64, device=device)
        for c in range(children.shape[2]):
            kid = children[rows, current, c]
            trying = ~done & ~moved & (kid >= 0)
            if not bool(trying.any()):
                break
            kid_safe = kid.clamp(min=0)
            token = tokens[rows, kid_safe]
            u = x.uniforms[rows, kid_safe].float()
            point = torch.nn.functional.one_hot(token, vocab).to(p.dtype)
            q_now = point if q is None else torch.where(full_q[:, None], q, point)
            accept = trying & (u * q_now[rows, token] < p[rows, token])
            reject = trying & ~accept
            p = torch.where(reject[:, None], _residual(p, q_now), p)
            if q is not None:
                q = torch.where((reject & full_q)[:, None], _without(q, point), q)
            moved |= accept
            step = torch.where(accept, kid, step)
        ending = ~done & ~moved
        drawn = (p * x.inv_exponentials).argmax(dim=-1)
        final = torch.where(ending, drawn, final)
        done |= ending
        path.append(step)
        if bool(done.all()):
            break
        current = torch.where(moved, step + 1, current)
        p = torch.where(moved[:, None], x.target_probs[starts + current], p)
        if q is not None:
            q = torch.where(moved[:, None], x.draft_probs[starts + current], q)
    steps = torch.stack(path, dim=1)  # [batch, depth + 1]: accepted node per depth, or -1
    num_accepted = (steps >= 0).sum(dim=1)
    width = max(t.depth for t in x.trees) + 1
    if steps.shape[1] < width:
        steps = torch.cat([steps, steps.new_full((batch, width - steps.shape[1]), -1)], 1)
    out = torch.where(steps >= 0, tokens.gather(1, steps.clamp(min=0)), PLACEHOLDER)
    out[rows, num_accepted] = final
    return TreeVerification(out, [[n for n in r if n >= 0] for r in steps.tolist()])


def tree_rejection_sample_loop(x: TreeRejectionInputs) -> TreeVerification:
    """The same rule, one request and one child at a time: the oracle of the vectorised
    path."""
    outputs, paths = [], []
    for b, (tree, start) in enumerate(zip(x.trees, x.row_starts, strict=True)):
        node, nodes = -1, []
        while True:
            p = x.target_probs[start + node + 1]
            q = x.draft_probs[start + node + 1] if x.draft_probs is not None else None
            if x.has_draft_probs is not None and not bool(x.has_draft_probs[b]):
                q = None
            moved = False
            for kid in tree.children(node):
                token = tree.tokens[kid]
                q_token = q[token] if q is not None else 1.0
                if float(x.uniforms[b, kid]) * q_token < p[token]:
                    nodes.append(kid)
                    node, moved = kid, True
                    break
                point = torch.nn.functional.one_hot(torch.tensor(token), p.shape[0]).to(p.dtype)
                p = _residual(p[None], (q if q is not None else point)[None])[0]
                if q is not None:
                    q = _without(q[None], point[None])[0]
            if not moved:
                final = int((p * x.inv_exponentials[b]).argmax())
                break
        paths.append(nodes)
        outputs.append([tree.tokens[n] for n in nodes] + [final])
    width = max(t.depth for t in x.trees) + 1
    out = torch.full((len(outputs), width), PLACEHOLDER, dtype=torch.int64)
    for b, tokens in enumerate(outputs):
        out[b, : len(tokens)] = torch.tensor(tokens)
    return TreeVerification(out.to(x.target_probs.device), paths)
