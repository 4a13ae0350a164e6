"""Rejection sampling: the maths in plain torch (the vectorised CPU path
and the oracle for the Triton kernels in `rejection_triton.py`), and `run_rejection`,
which runs one or the other. The sampler that builds the inputs is
`cluster/sample/rejection.py`.

Glossary (Leviathan et al., arXiv:2211.17192, Algorithm 1 and Appendix A.1):
- draft tokens: proposed by the drafter; request `i` owns `draft_token_ids[cu[i]:cu[i + 1]]`.
- accepted tokens: the longest prefix of a request's drafts that passes verification. A
  greedy draft passes when it equals the target argmax; a random draft `d` passes when
  `u * q(d) < p(d)` with `u ~ U[0, 1)` and `q(d) > 0` (`q(d) = 1` when drafts are deltas),
  i.e. with probability `min(1, p(d) / q(d))`.
- recovered token: written at the first rejected position. Greedy: the target argmax.
  Random: a draw from the residual `max(p - q, 0)` (delta drafts: `p` with the draft
  removed), taken as `argmax(residual / E)` with `E ~ Exp(1)` per token, which samples
  proportionally to the residual without normalising it. If rounding leaves the residual
  without mass, the draw falls back to `p` itself.
- bonus token: sampled elsewhere from the position after the last draft; written only when
  every draft of the request was accepted.
- output tokens: accepted + (recovered | bonus), then PLACEHOLDER_TOKEN_ID to the row's end.

Randomness is an input (`RejectionInputs.uniforms`, `.inv_exponentials`), so this module,
the per-request loop below and the Triton kernels return identical tokens for the same draws.
"""

from __future__ import annotations

import torch

from cluster.kernels.backend import use_triton
from cluster.kernels.rejection_inputs import PLACEHOLDER_TOKEN_ID, RejectionInputs

_BLOCK_ELEMENTS = 2**18  # floats per block of rows in the race (1 MiB)


def rejection_sample_ref(inputs: RejectionInputs) -> torch.Tensor:
    """Vectorised torch rejection sampling -> [batch, max_spec_len + 1] int64."""
    x = inputs
    batch, width, device = x.batch_size, x.max_spec_len + 1, x.target_probs.device
    out = torch.full((batch, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    if x.num_tokens == 0:
        out[:, 0] = x.bonus_token_ids
        return out
    num_draft = x.num_draft_tokens  # [batch]
    request = torch.repeat_interleave(torch.arange(batch, device=device), num_draft)
    position = torch.arange(x.num_tokens, device=device) - x.cu_num_draft_tokens[request]

    accepted = _accepted_mask(x, request)  # [num_tokens]
    # Mark every rejection, plus a sentinel just past each request's last draft: the first
    # mark in a row is the number of accepted drafts.
    rejected = torch.zeros(batch, width, dtype=torch.int8, device=device)
    rejected[request, position] = (~accepted).to(torch.int8)
    rows = torch.arange(batch, device=device)
    rejected[rows, num_draft] = 1
    num_accepted = rejected.argmax(dim=1)  # [batch]; argmax returns the first maximum

    drafts = torch.full_like(out, PLACEHOLDER_TOKEN_ID)
    drafts[request, position] = x.draft_token_ids
    columns = torch.arange(width, device=device)
    out = torch.where(columns < num_accepted[:, None], drafts, out)
    last = torch.where(num_accepted < num_draft, _recovered(x, num_accepted), x.bonus_token_ids)
    out[rows, num_accepted] = last
    return out


def _accepted_mask(x: RejectionInputs, request: torch.Tensor) -> torch.Tensor:
    """[num_tokens] bool: whether each draft passes its own test (greedy or random)."""
    token_is_greedy = x.is_greedy[request]  # [num_tokens]
    accepted = torch.zeros_like(token_is_greedy)
    if bool(token_is_greedy.any()):
        accepted = token_is_greedy & (x.draft_token_ids == x.target_probs.argmax(dim=1))
    if x.has_random_drafts():
        assert x.uniforms is not None, "random drafts need uniforms"
        draft = x.draft_token_ids[:, None]  # [num_tokens, 1]
        p = x.target_probs.gather(1, draft).squeeze(1).double()
        if x.draft_probs is None:
            q = torch.ones_like(p)
        else:
            q = x.draft_probs.gather(1, draft).squeeze(1).double()
        passes = (q > 0) & (x.uniforms * q < p)
        accepted = torch.where(token_is_greedy, accepted, passes)
    return accepted


def _recovered(x: RejectionInputs, num_accepted: torch.Tensor) -> torch.Tensor:
    """[batch] the recovered token of each request with a rejection (others: a placeholder).

    Reads one row per rejecting request: the target (and draft) row of its first rejection.
    """
    rejected = num_accepted < x.num_draft_tokens  # [batch]
    recovered = torch.full_like(num_accepted, PLACEHOLDER_TOKEN_ID)
    row = x.cu_num_draft_tokens[:-1] + num_accepted  # [batch], valid where rejected
    greedy = (rejected & x.is_greedy).nonzero().squeeze(1)
    if greedy.numel():
        recovered[greedy] = x.target_probs.index_select(0, row[greedy]).argmax(dim=1)
    random = (rejected & ~x.is_greedy).nonzero().squeeze(1)
    if random.numel() == 0:
        return recovered
    assert x.inv_exponentials is not None, "random drafts need exponentials"
    # Rows are gathered with index_select: advanced indexing is several times slower on CPU.
    everyone = random.numel() == x.batch_size  # common with many drafts: no copy of the draws
    inv = x.inv_exponentials if everyone else x.inv_exponentials.index_select(0, random)
    step = max(1, _BLOCK_ELEMENTS // x.vocab_size)  # rows per block: temporaries stay in cache
    for start in range(0, random.numel(), step):
        block = random[start : start + step]
        rows = row[block]
        p = x.target_probs.index_select(0, rows)
        q = None if x.draft_probs is None else x.draft_probs.index_select(0, rows)
        race = exponential_race(p, x.draft_token_ids[rows], q, inv[start : start + step])
        recovered[block] = race
    return recovered


def exponential_race(
    p: torch.Tensor,  # [n, vocab] target probabilities at the rejected positions
    draft: torch.Tensor,  # [n] the rejected draft tokens
    q: torch.Tensor | None,  # [n, vocab] draft probabilities, None for delta drafts
    inv_exponentials: torch.Tensor,  # [n, vocab] 1 / E, E ~ Exp(1)
) -> torch.Tensor:
    """[n] a draw from the residual of each row (`p` itself where the residual is empty)."""
    if q is None:  # residual = p without the draft: zero the draft's score
        scores = (p * inv_exponentials).scatter_(1, draft[:, None], 0.0)
    else:
        scores = (p - q).clamp_min_(0.0).mul_(inv_exponentials)
    best, token = scores.max(dim=1)  # max returns the first maximum, like argmax
    empty = best <= 0
    if bool(empty.any()):  # rounding left no residual mass: race over p instead
        token = torch.where(empty, (p * inv_exponentials).argmax(dim=1), token)
    return token


def rejection_sample_loop(inputs: RejectionInputs) -> torch.Tensor:
    """The per-request Python loop: the readable specification and the benchmark's baseline."""
    x = inputs
    out = torch.full((x.batch_size, x.max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    cu = x.cu_num_draft_tokens.tolist()
    drafts = x.draft_token_ids.tolist()
    for i in range(x.batch_size):
        greedy = bool(x.is_greedy[i])
        for j, t in enumerate(range(cu[i], cu[i + 1])):
            p = x.target_probs[t]  # [vocab]
            if greedy:
                token = int(p.argmax())
                out[i, j] = token
                if token != drafts[t]:
                    break
                continue
            q = 1.0 if x.draft_probs is None else float(x.draft_probs[t, drafts[t]])
            if q > 0 and float(x.uniforms[t]) * q < float(p[drafts[t]]):
                out[i, j] = drafts[t]
                continue
            q_row = None if x.draft_probs is None else x.draft_probs[t : t + 1]
            draft = x.draft_token_ids[t : t + 1]
            inv = x.inv_exponentials[i : i + 1]
            out[i, j] = int(exponential_race(p[None], draft, q_row, inv)[0])
            break
        else:
            out[i, cu[i + 1] - cu[i]] = int(x.bonus_token_ids[i])
    return out.to(x.target_probs.device)


def run_rejection(inputs: RejectionInputs, backend: str = "auto") -> torch.Tensor:
    """[batch, max_spec_len + 1] int64 output tokens, PLACEHOLDER_TOKEN_ID after the last."""
    if use_triton(backend, inputs.target_probs.device):
        from cluster.kernels.rejection_triton import rejection_sample_triton

        return rejection_sample_triton(inputs)
    return rejection_sample_ref(inputs)
