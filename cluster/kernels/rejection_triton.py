"""Rejection sampling as Triton kernels; `rejection.py` holds the same maths in torch.

Four kernels, one job each (the glossary is in `rejection.py`):
- `_greedy_verify_kernel`, one program per request: writes the target argmax while it
  equals the draft, stops at the first mismatch (the argmax there is the recovered token)
  and writes the bonus token when every draft matched.
- `_random_verify_kernel`, one program per request: the accept test
  `q(d) > 0 and u * q(d) < p(d)` (`q(d) = 1` for delta drafts); writes accepted drafts, the
  number accepted, and the bonus token when nothing was rejected.
- `_recover_partial_kernel`, one program per (request, vocab chunk): the exponential race
  `argmax(residual / E)` over one chunk of the first rejected position's row.
- `_recover_place_kernel`, one program per request: reduces the chunks and writes the
  recovered token at the rejected position.

Greedy programs never touch the random inputs, and the race reads one row per request (not
one per draft), so random requests cost `O(num_drafts + vocab)` reads each.

On CPU tensors the kernels run under the Triton interpreter, which must be switched on with
`TRITON_INTERPRET=1` before `triton` is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.kernels.backend import use_triton
from cluster.kernels.rejection_inputs import PLACEHOLDER_TOKEN_ID, RejectionInputs

_MAX_CHUNK = 4096  # vocab entries one race program reads


@triton.jit
def _greedy_verify_kernel(
    out_ptr,  # [batch, max_spec_len + 1] int64
    out_stride,
    cu_num_draft_ptr,  # [batch + 1] int64
    draft_ptr,  # [num_tokens] int64
    target_argmax_ptr,  # [num_tokens] int64
    bonus_ptr,  # [batch] int64
    is_greedy_ptr,  # [batch] bool
):
    req = tl.program_id(0)
    if not tl.load(is_greedy_ptr + req):
        return
    start = tl.load(cu_num_draft_ptr + req)
    num_draft = tl.load(cu_num_draft_ptr + req + 1) - start
    rejected = False
    for pos in range(num_draft):
        if not rejected:
            best = tl.load(target_argmax_ptr + start + pos)
            tl.store(out_ptr + req * out_stride + pos, best)
            rejected = tl.load(draft_ptr + start + pos) != best
    if not rejected:
        tl.store(out_ptr + req * out_stride + num_draft, tl.load(bonus_ptr + req))


@triton.jit
def _random_verify_kernel(
    out_ptr,  # [batch, max_spec_len + 1] int64
    out_stride,
    num_accepted_ptr,  # [batch] int64, written for random requests
    cu_num_draft_ptr,  # [batch + 1] int64
    draft_ptr,  # [num_tokens] int64
    draft_probs_ptr,  # [num_tokens, vocab] float32 (unused when NO_DRAFT_PROBS)
    draft_stride,
    target_probs_ptr,  # [num_tokens, vocab] float32
    target_stride,
    uniforms_ptr,  # [num_tokens] float64
    bonus_ptr,  # [batch] int64
    is_greedy_ptr,  # [batch] bool
    NO_DRAFT_PROBS: tl.constexpr,
):
    req = tl.program_id(0)
    if tl.load(is_greedy_ptr + req):
        return
    start = tl.load(cu_num_draft_ptr + req)
    num_draft = tl.load(cu_num_draft_ptr + req + 1) - start
    tl.store(num_accepted_ptr + req, num_draft)
    rejected = False
    for pos in range(num_draft):
        if not rejected:
            token = start + pos
            draft = tl.load(draft_ptr + token)
            p = tl.load(target_probs_ptr + token * target_stride + draft).to(tl.float64)
            u = tl.load(uniforms_ptr + token)
            if NO_DRAFT_PROBS:
                rejected = u >= p
            else:
                q = tl.load(draft_probs_ptr + token * draft_stride + draft).to(tl.float64)
                rejected = (q <= 0) | (u * q >= p)
            if rejected:
                tl.store(num_accepted_ptr + req, pos)
            else:
                tl.store(out_ptr + req * out_stride + pos, draft)
    if not rejected:
        tl.store(out_ptr + req * out_stride + num_draft, tl.load(bonus_ptr + req))


@triton.jit
def _recover_partial_kernel(
    score_ptr,  # [batch, num_chunks] float32: best residual score in the chunk
    token_ptr,  # [batch, num_chunks] int64: its token
    fallback_score_ptr,  # [batch, num_chunks] float32: best score of p itself
    fallback_token_ptr,  # [batch, num_chunks] int64
    num_accepted_ptr,  # [batch] int64
    cu_num_draft_ptr,  # [batch + 1] int64
    draft_ptr,  # [num_tokens] int64
    draft_probs_ptr,  # [num_tokens, vocab] float32 (unused when NO_DRAFT_PROBS)
    draft_stride,
    target_probs_ptr,  # [num_tokens, vocab] float32
    target_stride,
    inv_exp_ptr,  # [batch, vocab] float32
    inv_exp_stride,
    is_greedy_ptr,  # [batch] bool
    vocab_size,
    num_chunks,
    NO_DRAFT_PROBS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    req = tl.program_id(0)
    chunk = tl.program_id(1)
    if tl.load(is_greedy_ptr + req):
        return
    start = tl.load(cu_num_draft_ptr + req)
    num_accepted = tl.load(num_accepted_ptr + req)
    if num_accepted == tl.load(cu_num_draft_ptr + req + 1) - start:
        return
    row = start + num_accepted
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < vocab_size
    # Masked lanes score 0 and sit after every real lane, so ties never pick them.
    p = tl.load(target_probs_ptr + row * target_stride + cols, mask=mask, other=0.0)
    if NO_DRAFT_PROBS:
        residual = tl.where(cols == tl.load(draft_ptr + row), 0.0, p)
    else:
        q = tl.load(draft_probs_ptr + row * draft_stride + cols, mask=mask, other=0.0)
        residual = tl.maximum(p - q, 0.0)
    inv_exp = tl.load(inv_exp_ptr + req * inv_exp_stride + cols, mask=mask, other=0.0)
    scores = residual * inv_exp
    fallback = p * inv_exp
    slot = req * num_chunks + chunk
    tl.store(score_ptr + slot, tl.max(scores, axis=0))
    tl.store(token_ptr + slot, chunk * CHUNK + tl.argmax(scores, axis=0, tie_break_left=True))
    tl.store(fallback_score_ptr + slot, tl.max(fallback, axis=0))
    best_fallback = tl.argmax(fallback, axis=0, tie_break_left=True)
    tl.store(fallback_token_ptr + slot, chunk * CHUNK + best_fallback)


@triton.jit
def _recover_place_kernel(
    out_ptr,  # [batch, max_spec_len + 1] int64
    out_stride,
    score_ptr,  # [batch, num_chunks] float32
    token_ptr,  # [batch, num_chunks] int64
    fallback_score_ptr,  # [batch, num_chunks] float32
    fallback_token_ptr,  # [batch, num_chunks] int64
    num_accepted_ptr,  # [batch] int64
    cu_num_draft_ptr,  # [batch + 1] int64
    is_greedy_ptr,  # [batch] bool
    num_chunks,
    CHUNKS_POW2: tl.constexpr,
):
    req = tl.program_id(0)
    if tl.load(is_greedy_ptr + req):
        return
    start = tl.load(cu_num_draft_ptr + req)
    num_accepted = tl.load(num_accepted_ptr + req)
    if num_accepted == tl.load(cu_num_draft_ptr + req + 1) - start:
        return
    chunks = tl.arange(0, CHUNKS_POW2)
    mask = chunks < num_chunks
    # Scores are >= 0, so padding at -1 never wins; the first chunk holding the maximum
    # wins ties, which makes the result the first maximum over the whole vocabulary.
    scores = tl.load(score_ptr + req * num_chunks + chunks, mask=mask, other=-1.0)
    fallback = tl.load(fallback_score_ptr + req * num_chunks + chunks, mask=mask, other=-1.0)
    best = tl.argmax(scores, axis=0, tie_break_left=True)
    best_fallback = tl.argmax(fallback, axis=0, tie_break_left=True)
    token = tl.load(token_ptr + req * num_chunks + best)
    fallback_token = tl.load(fallback_token_ptr + req * num_chunks + best_fallback)
    token = tl.where(tl.max(scores, axis=0) > 0, token, fallback_token)
    tl.store(out_ptr + req * out_stride + num_accepted, token)


def rejection_sample_triton(inputs: RejectionInputs) -> torch.Tensor:
    """Triton rejection sampling -> [batch, max_spec_len + 1] int64 (same result as the ref)."""
    x = inputs
    device = x.target_probs.device
    use_triton("triton", device)  # raises where the kernels cannot run
    batch, width = x.batch_size, x.max_spec_len + 1
    out = torch.full((batch, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    if x.num_tokens == 0:
        out[:, 0] = x.bonus_token_ids
        return out
    cu, greedy = x.cu_num_draft_tokens, x.is_greedy
    drafts, bonus = x.draft_token_ids, x.bonus_token_ids
    if bool(greedy.any()):
        target_argmax = x.target_probs.argmax(dim=1)  # [num_tokens]
        _greedy_verify_kernel[(batch,)](
            out, out.stride(0), cu, drafts, target_argmax, bonus, greedy
        )
    if not x.has_random_drafts():
        # Random requests, if any, have no drafts: their bonus token is their only output.
        out[:, 0] = torch.where(greedy, out[:, 0], bonus)
        return out

    no_draft_probs = x.draft_probs is None
    draft_probs = x.target_probs if no_draft_probs else x.draft_probs  # placeholder pointer
    assert x.uniforms is not None and x.inv_exponentials is not None, "random drafts need draws"
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    _random_verify_kernel[(batch,)](
        out,
        out.stride(0),
        num_accepted,
        cu,
        drafts,
        draft_probs,
        draft_probs.stride(0),
        x.target_probs,
        x.target_probs.stride(0),
        x.uniforms,
        bonus,
        greedy,
        NO_DRAFT_PROBS=no_draft_probs,
    )

    chunk = min(_MAX_CHUNK, triton.next_power_of_2(x.vocab_size))
    num_chunks = triton.cdiv(x.vocab_size, chunk)
    scores = torch.empty(batch, num_chunks, dtype=torch.float32, device=device)
    tokens = torch.empty(batch, num_chunks, dtype=torch.int64, device=device)
    fallback_scores, fallback_tokens = torch.empty_like(scores), torch.empty_like(tokens)
    _recover_partial_kernel[(batch, num_chunks)](
        scores,
        tokens,
        fallback_scores,
        fallback_tokens,
        num_accepted,
        cu,
        drafts,
        draft_probs,
        draft_probs.stride(0),
        x.target_probs,
        x.target_probs.stride(0),
        x.inv_exponentials,
        x.inv_exponentials.stride(0),
        greedy,
        x.vocab_size,
        num_chunks,
        NO_DRAFT_PROBS=no_draft_probs,
        CHUNK=chunk,
    )
    _recover_place_kernel[(batch,)](
        out,
        out.stride(0),
        scores,
        tokens,
        fallback_scores,
        fallback_tokens,
        num_accepted,
        cu,
        greedy,
        num_chunks,
        CHUNKS_POW2=triton.next_power_of_2(num_chunks),
    )
    return out
