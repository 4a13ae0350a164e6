"""Rejection sampling of draft trees (a chain is a tree of width one): the maths in plain
torch (the vectorised CPU path and the oracle of the Triton kernel in
`rejection_triton.py`), and `run_rejection`, which runs one or the other. The sampler that
builds the inputs is `cluster/sample/rejection.py`; the per-request walk written as the
glossary says it (the tests' oracle) is `tests/rejection_oracle.py`.

Glossary (Leviathan et al., arXiv:2211.17192; the recursive rule for trees of SpecInfer /
EAGLE / Jeon et al. 2024):
- draft tokens: proposed by the drafter, as a tree per request (`rejection_inputs.py`).
- the walk: from the root, the target's distribution `P` at the current node tries the
  node's children in order. A random request accepts child x when `q(x) > 0` and
  `u * q(x) < P(x)`, `u ~ U[0, 1)` (`q` the distribution x was drawn from, or a point mass
  on x for delta drafts), i.e. with probability `min(1, P(x) / q(x))`. On rejection,
  `P <- normalise(max(P - q, 0))` (delta: `P` without x) and `q <- normalise(q without x)`,
  and the next sibling is tried against those. An accepted child becomes the current node.
  A greedy request accepts the first child equal to the argmax of its target row.
- recovered token: when every child of the current node is rejected, a draw from `P` as it
  stands (the residual), taken as `argmax(P / E)` with `E ~ Exp(1)` per token (the
  exponential race: no normalisation needed). Greedy: the argmax. If rounding leaves a
  residual without mass, the draw falls back to `P` before it.
- bonus token: at a leaf (no child to try), a draw from the leaf's row; or, when the caller
  sampled it already (`bonus_token_ids`), that token.
- output tokens: accepted + (recovered | bonus), then PLACEHOLDER_TOKEN_ID to the row's end.

Sums over the vocabulary (the residual's normaliser) are float64, so the torch path and the
kernel, which add in different orders, agree except within ~1e-16 of a decision. Randomness
is an input (`uniforms`, `inv_exponentials`), so this module, the tests' per-request walk and
the Triton kernel return the same tokens for the same draws.
"""

from __future__ import annotations

import torch

from cluster.kernels.backend import use_triton
from cluster.kernels.rejection_inputs import PLACEHOLDER_TOKEN_ID, RejectionInputs, RejectionOutput

_RACE_BLOCK_ELEMENTS = 2**18  # floats per block of rows in the race (1 MiB)


def residual(
    p: torch.Tensor,  # [n, vocab] float32, the current target distributions
    q: torch.Tensor | None,  # [n, vocab] float32 the drafts' distributions, None: deltas
    full: torch.Tensor,  # [n] bool: whose row of q is real (the others are point masses)
    token: torch.Tensor,  # [n] int64 the rejected draft
) -> torch.Tensor:
    """[n, vocab] float32, unnormalised: max(p - q, 0), or p without `token` for deltas."""
    without = p.scatter(1, token[:, None], 0.0)
    if q is None:
        return without
    return torch.where(full[:, None], (p - q).clamp_min(0.0), without)


def after_rejection(
    p: torch.Tensor, q: torch.Tensor | None, full: torch.Tensor, token: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (p, q) the next sibling is tried against: both renormalised (float64 sums),
    each kept as it was where nothing would be left."""
    r = residual(p, q, full, token)
    total = r.double().sum(dim=1, keepdim=True)
    p_next = torch.where(total > 0, (r.double() / total).float(), p)
    if q is None:
        return p_next, None
    rest = q.scatter(1, token[:, None], 0.0)
    left = rest.double().sum(dim=1, keepdim=True)
    return p_next, torch.where(left > 0, (rest.double() / left).float(), q)


def race(
    p: torch.Tensor,  # [n, vocab] float32, the current target distributions
    r: torch.Tensor,  # [n, vocab] float32, what to draw from (p, or a residual of it)
    inv_exponentials: torch.Tensor,  # [n, vocab] float32 1 / E
) -> torch.Tensor:
    """[n] argmax(r / E), or argmax(p / E) where r has no mass (first maximum wins)."""
    best, token = (r * inv_exponentials).max(dim=1)
    empty = best <= 0
    if bool(empty.any()):
        token = torch.where(empty, (p * inv_exponentials).argmax(dim=1), token)
    return token


def rejection_sample_ref(x: RejectionInputs) -> RejectionOutput:
    """Vectorised over requests; one pass over node indices (a child comes after its parent,
    so the walk visits every node it needs in index order). Host reads do not grow with the
    number of drafts or requests for chains (a GPU stalls at each)."""
    batch, device, vocab = x.batch_size, x.target_probs.device, x.vocab_size
    starts = x.cu_num_draft_tokens[:-1]
    greedy = x.is_greedy
    full = x.request_has_draft_probs()
    argmax = _target_argmax(x)
    cur = torch.full((batch,), -1, dtype=torch.int64, device=device)  # the current node
    tried = torch.zeros(batch, dtype=torch.bool, device=device)  # a child of cur was rejected
    pending = torch.full_like(cur, -1)  # a rejected child whose residual is not yet in p
    in_scratch = torch.zeros_like(tried)  # p (and q) of cur are the scratch rows
    scratch_p = scratch_q = None
    depth = torch.zeros_like(cur)
    accepted = torch.full((batch, x.max_depth), -1, dtype=torch.int64, device=device)
    out = torch.full(
        (batch, x.max_depth + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device
    )
    rows = torch.arange(batch, device=device)
    last_row = max(x.target_probs.shape[0] - 1, 0)
    max_nodes = int(x.num_draft_tokens.max()) if x.num_tokens else 0
    for j in range(max_nodes):
        node = (starts + j).clamp(max=x.num_tokens - 1)  # [batch] flat node index
        active = (x.num_draft_tokens > j) & (x.draft_parents[node] == cur)
        token = x.draft_token_ids[node]
        row = (x.target_row_starts + cur + 1).clamp(max=last_row)  # (valid where active)
        accept = active & greedy & (token == argmax[row])
        if x.uniforms is not None:  # some random request has drafts
            chance = active & ~greedy
            late = chance & (pending >= 0)
            if not x.all_chains and bool(late.any()):  # a sibling after a rejection
                if scratch_p is None:
                    scratch_p = torch.zeros(batch, vocab, device=device)
                    scratch_q = None if x.draft_probs is None else torch.zeros_like(scratch_p)
                b = late.nonzero().squeeze(1)
                p, q = _current(x, b, row, pending, in_scratch, scratch_p, scratch_q)
                p, q = after_rejection(p, q, full[b], x.draft_token_ids[pending[b]])
                scratch_p[b] = p
                if q is not None:
                    scratch_q[b] = q
                in_scratch[b], pending[b] = True, -1
            p_x = x.target_probs[row, token]
            if scratch_p is not None:
                p_x = torch.where(in_scratch, _at(scratch_p, token), p_x)
            q_x = torch.ones_like(p_x, dtype=torch.float64)
            if x.draft_probs is not None:
                q_now = x.draft_probs[node, token]
                if scratch_q is not None:
                    q_now = torch.where(in_scratch, _at(scratch_q, token), q_now)
                q_x = torch.where(full, q_now.double(), q_x)
            accept |= chance & (q_x > 0) & (x.uniforms[node] * q_x < p_x.double())
        at = depth.clamp(max=max(x.max_depth - 1, 0))
        accepted[rows, at] = torch.where(accept, j, accepted[rows, at])
        out[rows, depth] = torch.where(accept, token, out[rows, depth])
        depth += accept.long()
        cur = torch.where(accept, j, cur)
        rejected = active & ~accept
        tried = (tried | rejected) & ~accept
        pending = torch.where(accept, -1, torch.where(rejected & ~greedy, node, pending))
        in_scratch &= ~accept
    out[rows, depth] = _final(x, cur, tried, pending, in_scratch, scratch_p, scratch_q, argmax)
    return RejectionOutput(out, accepted)


def _target_argmax(x: RejectionInputs) -> torch.Tensor:
    """[max(num_rows, 1)] the argmax of every target row when some request is greedy (else
    zeros)."""
    if bool(x.is_greedy.any()) and x.target_probs.shape[0]:
        return x.target_probs.argmax(dim=1)
    return torch.zeros(
        max(x.target_probs.shape[0], 1), dtype=torch.int64, device=x.target_probs.device
    )


def _at(table: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    return table.gather(1, token[:, None]).squeeze(1)


def _current(x, b, row, pending, in_scratch, scratch_p, scratch_q):
    """The (p, q) rows requests `b` stand at: their scratch rows, or the target row of their
    current node and the draft row of its children."""
    base_p = x.target_probs.index_select(0, row[b])
    stored = in_scratch[b][:, None]
    p = base_p if scratch_p is None else torch.where(stored, scratch_p[b], base_p)
    if x.draft_probs is None or x.num_tokens == 0:
        return p, None
    base_q = x.draft_probs.index_select(0, pending[b])
    q = base_q if scratch_q is None else torch.where(stored, scratch_q[b], base_q)
    return p, q


def _final(x, cur, tried, pending, in_scratch, scratch_p, scratch_q, argmax) -> torch.Tensor:
    """[batch] the token after the accepted path: bonus, recovered or drawn at a leaf."""
    row = (x.target_row_starts + cur + 1).clamp(max=max(x.target_probs.shape[0] - 1, 0))
    leaf_bonus = ~tried & (x.bonus_token_ids is not None)  # (then the leaf's row may not exist)
    final = torch.where(leaf_bonus, _bonus_or_zero(x), argmax[row.clamp(max=argmax.shape[0] - 1)])
    if x.inv_exponentials is None:  # no random request draws here
        return final
    random = (~x.is_greedy & ~leaf_bonus).nonzero().squeeze(1)
    full = x.request_has_draft_probs()
    step = max(1, _RACE_BLOCK_ELEMENTS // x.vocab_size)  # rows per block: stays in cache
    for lo in range(0, random.numel(), step):
        b = random[lo : lo + step]
        pend = pending[b]
        p, q = _current(x, b, row, pending.clamp(min=0), in_scratch, scratch_p, scratch_q)
        r = p
        if x.num_tokens:
            token = x.draft_token_ids[pend.clamp(min=0)]
            r = torch.where((pend >= 0)[:, None], residual(p, q, full[b], token), p)
        final[b] = race(p, r, x.inv_exponentials.index_select(0, b))
    return final


def _bonus_or_zero(x: RejectionInputs) -> torch.Tensor:
    if x.bonus_token_ids is None:
        return torch.zeros_like(x.cu_num_draft_tokens[1:])
    return x.bonus_token_ids


def run_rejection(inputs: RejectionInputs, backend: str = "auto") -> RejectionOutput:
    """Verify every request's drafts with the Triton kernel or the torch path."""
    if use_triton(backend, inputs.target_probs.device):
        from cluster.kernels.rejection_triton import rejection_sample_triton

        return rejection_sample_triton(inputs)
    return rejection_sample_ref(inputs)
