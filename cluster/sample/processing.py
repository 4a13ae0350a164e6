"""The logits pipeline shared by `Sampler` and `RejectionSampler`, one row per sampled position.

Order: logit bias, `min_tokens` (stop tokens out while a request has too few outputs: a
row verifying draft j counts the j drafts before it), penalties (repetition on prompt + output tokens, then frequency and presence on
output tokens), temperature, min-p, top-k, top-p. Greedy requests carry neutral values for
everything after the penalties, so their argmax is the argmax of the penalised logits.
Because both samplers call `process_logits`, a verified draft position is processed exactly
as the plain sampler would process that position.
"""

from __future__ import annotations

import torch

from cluster.sample.metadata import LogitsRows, MinTokens, Penalties, SamplingMetadata


def process_logits(
    logits: torch.Tensor,  # [rows, vocab], any float dtype
    metadata: SamplingMetadata,
    rows: LogitsRows,
) -> torch.Tensor:
    """[rows, vocab] float32: the logits each row samples from (a new tensor)."""
    out = logits.to(torch.float32, copy=True)
    request = rows.request_index  # [rows]
    if metadata.logit_bias is not None:
        out += metadata.logit_bias.index_select(0, request)
    if metadata.min_tokens is not None:
        apply_min_tokens(out, metadata.min_tokens, rows)
    if metadata.penalties is not None:
        apply_penalties(out, metadata.penalties, rows)
    if not metadata.all_greedy:
        out.div_(metadata.temperature[request][:, None])
    if metadata.min_p is not None:
        apply_min_p(out, metadata.min_p[request])
    if metadata.top_k is not None or metadata.top_p is not None:
        top_k = None if metadata.top_k is None else metadata.top_k[request]
        top_p = None if metadata.top_p is None else metadata.top_p[request]
        apply_top_k_top_p(out, top_k, top_p)
    return out


def sampling_distribution(
    processed: torch.Tensor,  # [rows, vocab] float32 from process_logits
    greedy_rows: torch.Tensor,  # [rows] bool
) -> torch.Tensor:
    """[rows, vocab] float32: softmax of each row, or a point mass on the argmax if greedy."""
    if not bool(greedy_rows.any()):
        return processed.softmax(dim=-1)
    point = torch.zeros_like(processed).scatter_(1, processed.argmax(dim=-1, keepdim=True), 1.0)
    if bool(greedy_rows.all()):
        return point
    return torch.where(greedy_rows[:, None], point, processed.softmax(dim=-1))


def apply_min_tokens(logits: torch.Tensor, min_tokens: MinTokens, rows: LogitsRows) -> None:
    """Set the stop tokens of rows whose position comes before `min_tokens` to -inf."""
    request = rows.request_index  # [rows]
    before = torch.bincount(rows.history_rows, minlength=rows.num_rows)  # drafts before a row
    early = before < min_tokens.remaining.index_select(0, request)  # [rows]
    mask = min_tokens.stop_mask.index_select(0, request) & early[:, None]
    logits.masked_fill_(mask, float("-inf"))


def apply_penalties(logits: torch.Tensor, penalties: Penalties, rows: LogitsRows) -> None:
    """Penalise `logits` [rows, vocab] in place; each row also counts its history tokens."""
    active_rows = penalties.active[rows.request_index].nonzero().squeeze(1)  # [active]
    if active_rows.numel() == 0:
        return
    request = rows.request_index[active_rows]  # [active]
    table_rows = penalties.table_rows[request]  # [active]
    counts = penalties.output_counts.index_select(0, table_rows)  # [active, vocab] int32
    # History pairs belong to rows; re-index them into the active subset.
    slot = torch.full((rows.num_rows,), -1, dtype=torch.int64, device=logits.device)
    slot[active_rows] = torch.arange(active_rows.numel(), device=logits.device)
    pair_slot = slot[rows.history_rows]
    keep = pair_slot >= 0
    ones = torch.ones(int(keep.sum()), dtype=counts.dtype, device=counts.device)
    counts.index_put_((pair_slot[keep], rows.history_tokens[keep]), ones, accumulate=True)

    sub = logits.index_select(0, active_rows)  # [active, vocab]
    seen = penalties.prompt_mask.index_select(0, table_rows) | (counts > 0)
    repetition = penalties.repetition[request][:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub -= penalties.frequency[request][:, None] * counts
    sub -= penalties.presence[request][:, None] * (counts > 0)
    logits.index_copy_(0, active_rows, sub)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below `min_p` [rows] times the row's top probability."""
    selected = (min_p > 0).nonzero().squeeze(1)
    if selected.numel() == 0:
        return
    sub = logits.index_select(0, selected)
    probs = sub.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[selected][:, None]
    logits.index_copy_(0, selected, sub.masked_fill(probs < threshold, float("-inf")))


def apply_top_k_top_p(
    logits: torch.Tensor,  # [rows, vocab], modified in place
    top_k: torch.Tensor | None,  # [rows] int64, vocab = off
    top_p: torch.Tensor | None,  # [rows] float32, 1.0 = off
) -> None:
    """Keep the logits >= the k-th largest (ties kept), then the smallest set of most likely
    tokens whose probability reaches `top_p` (ties broken by token id)."""
    vocab = logits.shape[1]
    k = torch.full((logits.shape[0],), vocab, device=logits.device) if top_k is None else top_k
    p = torch.ones(logits.shape[0], device=logits.device) if top_p is None else top_p
    selected = ((k < vocab) | (p < 1)).nonzero().squeeze(1)
    if selected.numel() == 0:
        return
    k, p = k[selected], p[selected]
    ordered, order = logits.index_select(0, selected).sort(dim=-1, descending=True, stable=True)
    kth = ordered.gather(1, (k - 1)[:, None])  # [selected, 1]
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    drop = (mass_before >= p[:, None]) & (p < 1)[:, None]
    drop[:, 0] = False  # the most likely token always stays (a top_p below float32's
    # smallest value rounds to 0, which would drop every token and leave no distribution)
    ordered = ordered.masked_fill(drop, float("-inf"))
    logits.index_copy_(0, selected, torch.empty_like(ordered).scatter_(1, order, ordered))
