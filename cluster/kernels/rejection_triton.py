"""Rejection sampling of draft trees as one Triton kernel; `rejection.py` holds the same
maths in torch (and the glossary).

`_verify_kernel` runs one program per request. It walks the request's nodes in index order
(a child comes after its parent), trying the current node's children: greedy requests
compare with the precomputed argmax of the current target row; random ones test
`u * q(x) < P(x)`. A rejected child's residual is folded into the request's scratch rows
(`_fold`, two passes over the vocabulary) only when a sibling follows, so a chain, whose
walk ends at its first rejection, never folds. The token after the accepted path is the
bonus (given, at a leaf), the argmax (greedy) or the exponential race over the current
row with the pending residual applied on the fly, chunk by chunk, first maximum winning.

On CPU tensors the kernel runs under the Triton interpreter, which must be switched on with
`TRITON_INTERPRET=1` before `triton` is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.kernels.backend import use_triton
from cluster.kernels.rejection_inputs import PLACEHOLDER_TOKEN_ID, RejectionInputs, RejectionOutput

_MAX_BLOCK = 4096  # vocabulary entries per chunk


@triton.jit
def _load_p(target_row_ptr, scratch_row_ptr, cols, mask, in_scratch):
    """The current target distribution at `cols`: the target row, or the scratch row."""
    stored = (cols * 0 + in_scratch) != 0  # (a flag as a block: the interpreter needs it)
    base = tl.load(target_row_ptr + cols, mask=mask & ~stored, other=0.0)
    return base + tl.load(scratch_row_ptr + cols, mask=mask & stored, other=0.0)


@triton.jit
def _load_pq(
    target_row_ptr,
    q_row_ptr,
    scratch_p_ptr,
    scratch_q_ptr,
    cols,
    mask,
    q_mask,
    in_scratch,
    HAS_DRAFT_PROBS: tl.constexpr,
):
    """The current (p, q) at `cols`; q is p itself without draft probabilities (unused)."""
    p = _load_p(target_row_ptr, scratch_p_ptr, cols, mask, in_scratch)
    q = p
    if HAS_DRAFT_PROBS:
        q = _load_p(q_row_ptr, scratch_q_ptr, cols, q_mask, in_scratch)
    return p, q


@triton.jit
def _residual(p, q, cols, token, full):
    """max(p - q, 0) where the request has draft probabilities, else p without `token`."""
    without = tl.where(cols == token, 0.0, p)
    return tl.where(full != 0, tl.maximum(p - q, 0.0), without)


@triton.jit
def _fold(
    target_row_ptr,
    q_row_ptr,  # the rejected child's draft row (siblings share it)
    scratch_p_ptr,
    scratch_q_ptr,
    in_scratch,
    token,
    full,
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Scratch <- (normalise(residual), normalise(q without token)), float64 sums; each
    kept as it was where nothing would be left."""
    p_total = tl.zeros((), dtype=tl.float64)
    q_total = tl.zeros((), dtype=tl.float64)
    for lo in range(0, vocab_size, BLOCK):
        cols = lo + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        p, q = _load_pq(
            target_row_ptr,
            q_row_ptr,
            scratch_p_ptr,
            scratch_q_ptr,
            cols,
            mask,
            mask,
            in_scratch,
            HAS_DRAFT_PROBS,
        )
        if HAS_DRAFT_PROBS:
            q_total += tl.sum(tl.where(cols == token, 0.0, q).to(tl.float64), axis=0)
        p_total += tl.sum(_residual(p, q, cols, token, full).to(tl.float64), axis=0)
    for lo in range(0, vocab_size, BLOCK):  # the same chunks again, now normalised
        cols = lo + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        p, q = _load_pq(
            target_row_ptr,
            q_row_ptr,
            scratch_p_ptr,
            scratch_q_ptr,
            cols,
            mask,
            mask,
            in_scratch,
            HAS_DRAFT_PROBS,
        )
        if HAS_DRAFT_PROBS:
            rest = tl.where(cols == token, 0.0, q)
            q_next = tl.where(q_total > 0, (rest.to(tl.float64) / q_total).to(tl.float32), q)
            tl.store(scratch_q_ptr + cols, q_next, mask=mask)
        r = _residual(p, q, cols, token, full)
        p_next = tl.where(p_total > 0, (r.to(tl.float64) / p_total).to(tl.float32), p)
        tl.store(scratch_p_ptr + cols, p_next, mask=mask)


@triton.jit
def _race(
    target_row_ptr,
    q_row_ptr,
    scratch_p_ptr,
    scratch_q_ptr,
    inv_exp_row_ptr,
    in_scratch,
    pending_token,  # -1: draw from p itself
    full,
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """argmax(residual / E) over the vocabulary, or argmax(p / E) where the residual has no
    mass; the first maximum wins."""
    best = tl.full((), -1.0, tl.float32)
    best_token = tl.zeros((), dtype=tl.int64)
    fallback = tl.full((), -1.0, tl.float32)
    fallback_token = tl.zeros((), dtype=tl.int64)
    for lo in range(0, vocab_size, BLOCK):
        cols = lo + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        q_mask = mask & ((cols * 0 + pending_token) >= 0)  # no draft row before a rejection
        p, q = _load_pq(
            target_row_ptr,
            q_row_ptr,
            scratch_p_ptr,
            scratch_q_ptr,
            cols,
            mask,
            q_mask,
            in_scratch,
            HAS_DRAFT_PROBS,
        )
        r = tl.where(pending_token >= 0, _residual(p, q, cols, pending_token, full), p)
        inv_exp = tl.load(inv_exp_row_ptr + cols, mask=mask, other=0.0)
        # Masked lanes score 0 and sit after every real lane, so ties never pick them.
        scores = r * inv_exp
        chunk_best = tl.max(scores, axis=0)
        chunk_token = lo + tl.argmax(scores, axis=0, tie_break_left=True).to(tl.int64)
        take = chunk_best > best
        best_token = tl.where(take, chunk_token, best_token)
        best = tl.where(take, chunk_best, best)
        plain = p * inv_exp
        chunk_best = tl.max(plain, axis=0)
        chunk_token = lo + tl.argmax(plain, axis=0, tie_break_left=True).to(tl.int64)
        take = chunk_best > fallback
        fallback_token = tl.where(take, chunk_token, fallback_token)
        fallback = tl.where(take, chunk_best, fallback)
    return tl.where(best > 0, best_token, fallback_token)


@triton.jit
def _verify_kernel(
    out_ptr,  # [batch, max_depth + 1] int64, PLACEHOLDER-filled
    out_stride,
    nodes_ptr,  # [batch, max_depth] int64, -1-filled: the node accepted at each depth
    nodes_stride,
    cu_num_draft_ptr,  # [batch + 1] int64
    draft_ptr,  # [num_tokens] int64
    parent_ptr,  # [num_tokens] int64
    target_probs_ptr,  # [num_rows, vocab] float32
    target_stride,
    row_start_ptr,  # [batch] int64
    argmax_ptr,  # [num_rows] int64 (read for greedy requests)
    draft_probs_ptr,  # [num_tokens, vocab] float32 (unused without HAS_DRAFT_PROBS)
    draft_stride,
    has_draft_probs_ptr,  # [batch] bool
    bonus_ptr,  # [batch] int64 (unused without HAS_BONUS)
    is_greedy_ptr,  # [batch] bool
    uniforms_ptr,  # [num_tokens] float64
    inv_exp_ptr,  # [batch, vocab] float32
    inv_exp_stride,
    scratch_p_ptr,  # [batch, vocab] float32
    scratch_q_ptr,  # [batch, vocab] float32
    scratch_stride,
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    HAS_BONUS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_num_draft_ptr + req)
    num_draft = tl.load(cu_num_draft_ptr + req + 1) - start
    row_start = tl.load(row_start_ptr + req)
    greedy = tl.load(is_greedy_ptr + req).to(tl.int32)
    zero = start * 0  # flags and indices below are int64 scalars, like `start`
    full = zero
    if HAS_DRAFT_PROBS:
        full = zero + tl.load(has_draft_probs_ptr + req).to(tl.int64)
    scratch_p = scratch_p_ptr + req * scratch_stride
    scratch_q = scratch_q_ptr + req * scratch_stride
    cur = zero - 1  # the current node, -1 the root
    pending = zero - 1  # a rejected child whose residual is not yet folded
    tried = zero  # a child of the current node was rejected
    in_scratch = zero  # the current p (and q) are the scratch rows
    depth = zero
    for j in range(num_draft):
        if tl.load(parent_ptr + start + j) == cur:
            token = tl.load(draft_ptr + start + j)
            row = row_start + cur + 1
            target_row = target_probs_ptr + row * target_stride
            if greedy != 0:
                ok = token == tl.load(argmax_ptr + row)
            else:
                if pending >= 0:  # a sibling after a rejection: fold the residual into p
                    _fold(
                        target_row,
                        draft_probs_ptr + (start + pending) * draft_stride,
                        scratch_p,
                        scratch_q,
                        in_scratch,
                        tl.load(draft_ptr + start + pending),
                        full,
                        vocab_size,
                        HAS_DRAFT_PROBS,
                        BLOCK,
                    )
                    in_scratch = zero + 1
                    pending = zero - 1
                p_x = tl.load(target_row + token, mask=in_scratch == 0, other=0.0)
                p_x += tl.load(scratch_p + token, mask=in_scratch != 0, other=0.0)
                q_x = tl.full((), 1.0, tl.float64)
                if HAS_DRAFT_PROBS:
                    q_row = draft_probs_ptr + (start + j) * draft_stride
                    q_now = tl.load(q_row + token, mask=in_scratch == 0, other=0.0)
                    q_now += tl.load(scratch_q + token, mask=in_scratch != 0, other=0.0)
                    q_x = tl.where(full != 0, q_now.to(tl.float64), q_x)
                u = tl.load(uniforms_ptr + start + j)
                ok = (q_x > 0) & (u * q_x < p_x.to(tl.float64))
            if ok:
                tl.store(out_ptr + req * out_stride + depth, token)
                tl.store(nodes_ptr + req * nodes_stride + depth, zero + j)
                depth += 1
                cur = zero + j
                pending = zero - 1
                tried = zero
                in_scratch = zero
            else:
                tried = zero + 1
                if greedy == 0:
                    pending = zero + j
    row = row_start + cur + 1
    leaf_bonus = (tried == 0) & HAS_BONUS  # (then the leaf's row need not exist)
    final = tl.load(bonus_ptr + req, mask=leaf_bonus, other=0)
    if greedy != 0:
        final = tl.where(leaf_bonus, final, tl.load(argmax_ptr + row, mask=~leaf_bonus, other=0))
    elif not leaf_bonus:
        pending_token = zero - 1
        if pending >= 0:
            pending_token = tl.load(draft_ptr + start + pending)
        final = _race(
            target_probs_ptr + row * target_stride,
            draft_probs_ptr + (start + tl.maximum(pending, 0)) * draft_stride,
            scratch_p,
            scratch_q,
            inv_exp_ptr + req * inv_exp_stride,
            in_scratch,
            pending_token,
            full,
            vocab_size,
            HAS_DRAFT_PROBS,
            BLOCK,
        )
    tl.store(out_ptr + req * out_stride + depth, final)


def rejection_sample_triton(inputs: RejectionInputs) -> RejectionOutput:
    """Triton rejection sampling (the same result as `rejection_sample_ref`)."""
    x = inputs
    device = x.target_probs.device
    use_triton("triton", device)  # raises where the kernel cannot run
    batch, vocab = x.batch_size, x.vocab_size
    out = torch.full(
        (batch, x.max_depth + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device
    )
    nodes = torch.full((batch, max(x.max_depth, 1)), -1, dtype=torch.int64, device=device)
    if bool(x.is_greedy.any()) and x.target_probs.shape[0]:
        argmax = x.target_probs.argmax(dim=1)  # [num_rows]
    else:
        argmax = torch.zeros(1, dtype=torch.int64, device=device)
    has_q = x.draft_probs is not None and x.num_tokens > 0
    draft_probs = x.draft_probs if has_q else x.target_probs  # placeholder pointer
    scratch_rows = 1 if x.all_chains else batch  # only siblings are folded
    scratch_p = torch.empty(scratch_rows, vocab, dtype=torch.float32, device=device)
    scratch_q = torch.empty_like(scratch_p) if has_q else scratch_p
    uniforms = x.uniforms if x.uniforms is not None else torch.zeros(1, dtype=torch.float64)
    inv_exp = x.inv_exponentials
    if inv_exp is None:
        inv_exp = torch.ones(1, vocab, dtype=torch.float32, device=device)
    _verify_kernel[(batch,)](
        out,
        out.stride(0),
        nodes,
        nodes.stride(0),
        x.cu_num_draft_tokens,
        x.draft_token_ids,
        x.draft_parents,
        x.target_probs,
        x.target_probs.stride(0),
        x.target_row_starts,
        argmax,
        draft_probs,
        draft_probs.stride(0),
        x.request_has_draft_probs(),
        x.bonus_token_ids if x.bonus_token_ids is not None else x.cu_num_draft_tokens,
        x.is_greedy,
        uniforms.to(device),
        inv_exp,
        inv_exp.stride(0),
        scratch_p,
        scratch_q,
        scratch_p.stride(0),
        vocab,
        HAS_DRAFT_PROBS=has_q,
        HAS_BONUS=x.bonus_token_ids is not None,
        BLOCK=min(_MAX_BLOCK, triton.next_power_of_2(vocab)),
    )
    return RejectionOutput(out, nodes[:, : x.max_depth])
