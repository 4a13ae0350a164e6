"""Drafting steps 2..k, shared by the EAGLE-family and draft-model proposers.

After pass 0 each drafting request has one draft token, the position it follows and
(for EAGLE) a hidden state. Every further pass feeds the previous draft token at the next
position, one token per request, writing draft KV into the slots the scheduler reserved
ahead. A request stops drafting when its next position has no reserved block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cluster.models.attention import AttentionMetadata, KVCache
from cluster.sampling_params import SamplingParams

# forward(input_ids [n], hidden [n, H] | None, meta, step) -> (logits [n, vocab], next hidden | None)
StepFn = Callable[
    [torch.Tensor, torch.Tensor | None, AttentionMetadata, int],
    tuple[torch.Tensor, torch.Tensor | None],
]


def choose_tokens(
    logits: torch.Tensor,  # [n, vocab]
    params: list[SamplingParams],
    sample: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Argmax drafts, or (with `sample`) drafts drawn from softmax(logits / T) for requests
    with temperature > 0. Returns (token ids [n], the sampling distributions [n, vocab] or None)."""
    tokens = logits.argmax(dim=-1)
    if not sample or all(p.is_greedy for p in params):
        return tokens, None
    temps = torch.tensor(
        [1.0 if p.is_greedy else p.temperature for p in params], device=logits.device
    )
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    drawn = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
    greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
    tokens = torch.where(greedy, tokens, drawn)
    probs = torch.where(
        greedy[:, None], torch.nn.functional.one_hot(tokens, probs.shape[1]).float(), probs
    )
    return tokens, probs


def run_chain(
    step_fn: StepFn,
    first_tokens: torch.Tensor,  # [n] draft 1 of each drafting request
    first_probs: torch.Tensor | None,  # [n, vocab]
    hidden: torch.Tensor | None,  # [n, H] the hidden state pass 1 continues from
    last_positions: torch.Tensor,  # [n] position of the token draft 1 follows
    block_tables: torch.Tensor,  # [n, max_blocks]
    num_blocks: list[int],  # [n]
    block_size: int,
    kv_cache: KVCache,
    params: list[SamplingParams],
    k: int,
    sample: bool,
) -> tuple[list[list[int]], list[torch.Tensor | None]]:
    """Drafts 2..k for every request; returns ([n][<= k] tokens, [n] probs [k_i, vocab] | None)."""
    n = first_tokens.shape[0]
    drafts = [[t] for t in first_tokens.tolist()]
    probs: list[list[torch.Tensor]] = [
        [first_probs[i]] if first_probs is not None else [] for i in range(n)
    ]
    active = list(range(n))
    tokens, positions = first_tokens, last_positions
    capacity = torch.tensor(num_blocks, device=positions.device) * block_size
    for step in range(1, k):
        positions = positions + 1
        still = [j for j, i in enumerate(active) if int(positions[j]) < int(capacity[i])]
        if not still:
            break
        rows = torch.tensor(still, device=positions.device)
        active = [active[j] for j in still]
        tokens, positions = tokens[rows], positions[rows]
        hidden = hidden[rows] if hidden is not None else None
        tables = block_tables[active]
        slots = (
            tables.gather(1, (positions // block_size)[:, None])[:, 0] * block_size
            + positions % block_size
        )
        meta = AttentionMetadata(
            query_start_loc=list(range(len(active) + 1)),
            seq_lens=(positions + 1).tolist(),
            positions=positions,
            kv_cache=kv_cache,
            slot_mapping=slots,
            block_tables=tables,
        )
        logits, hidden = step_fn(tokens, hidden, meta, step)
        tokens, step_probs = choose_tokens(logits, [params[i] for i in active], sample)
        for j, i in enumerate(active):
            drafts[i].append(int(tokens[j]))
            if step_probs is not None and probs[i]:
                probs[i].append(step_probs[j])
    return drafts, [
        torch.stack(p) if p and len(p) == len(d) else None
        for p, d in zip(probs, drafts, strict=True)
    ]
