"""Drafting steps 2..k, shared by the EAGLE-family and draft-model proposers (chains here;
trees through `tree_drafting.grow_trees`, both behind `ModelDrafter.draft_from_roots`).

After pass 0 each drafting request has one draft token, the position it follows and
(for EAGLE) a hidden state. Every further pass feeds the previous draft token at the next
position, one token per request, writing draft KV into the slots the scheduler reserved
ahead. A request stops drafting when its next position has no reserved block. Draft
tokens stay on the device until the chain ends: one transfer returns them all.

With `min_confidence`, a request's chain also ends where the draft's own probability of
the chain so far (the product of each draft's probability under softmax of the draft's
logits) falls below it: per request per step, drafts the draft itself
doubts are not sent for verification. The cut is made once the chain ends (on the
device, in the same transfer), so it costs no synchronisation; it depends only on the
draft's distributions, so it is lossless.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from cluster.models.attention import AttentionMetadata, KVCache, attention_context
from cluster.sample.randomness import draw_inv_exponentials
from cluster.sampling_params import SamplingParams
from cluster.spec_decode.batch import DraftProposal, ProposalBatch
from cluster.spec_decode.tree_drafting import TreeShape, grow_trees

# forward(input_ids [n], hidden [n, H] | None, positions [n], step)
#   -> (logits [n, vocab], next hidden | None); run inside the step's attention context.
StepFn = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, int],
    tuple[torch.Tensor, torch.Tensor | None],
]


def choose_tokens(
    logits: torch.Tensor,  # [n, vocab]
    params: list[SamplingParams],
    sample: bool,
    generators: Mapping[int, torch.Generator],  # row -> its request's draft generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Argmax drafts, or (with `sample`) drafts drawn from softmax(logits / T) for requests
    with temperature > 0, seeded rows from their own generator. Returns (token ids [n],
    the sampling distributions [n, vocab] or None)."""
    tokens = logits.argmax(dim=-1)
    if not sample or all(p.is_greedy for p in params):
        return tokens, None
    temps = torch.tensor(
        [1.0 if p.is_greedy else p.temperature for p in params], device=logits.device
    )
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    inv_exp = draw_inv_exponentials(
        [not p.is_greedy for p in params], generators, probs.shape[1], probs.device
    )
    drawn = (probs * inv_exp).argmax(dim=-1)
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
    last_positions: list[int],  # [n] position of the token draft 1 follows
    block_tables: torch.Tensor,  # [n, max_blocks]
    num_blocks: list[int],  # [n]
    block_size: int,
    kv_cache: KVCache,
    params: list[SamplingParams],
    generators: Mapping[int, torch.Generator],  # request (row of first_tokens) -> generator
    k: int,
    sample: bool,
    min_confidence: float | None = None,
    first_confidence: torch.Tensor | None = None,  # [n] draft 1's probability (with the above)
) -> tuple[list[list[int]], list[torch.Tensor | None]]:
    """Drafts 2..k for every request (cut where the chain's draft probability falls below
    `min_confidence`); returns ([n][<= k] tokens, [n] probs [k_i, vocab] | None)."""
    n = first_tokens.shape[0]
    device = first_tokens.device
    # [n] per pass, -1 once a request has stopped (requests only ever stop, so -1 ends a row)
    passes = [first_tokens]
    probs: list[list[torch.Tensor]] = [
        [first_probs[i]] if first_probs is not None else [] for i in range(n)
    ]
    active = list(range(n))
    positions = list(last_positions)
    tokens = first_tokens
    # [n] per pass: each draft's probability under the draft (1 where a row has stopped)
    confidences = [first_confidence] if first_confidence is not None else []
    for step in range(1, k):
        still = [j for j, i in enumerate(active) if positions[j] + 1 < num_blocks[i] * block_size]
        if not still:
            break
        if len(still) < len(active):
            rows = torch.tensor(still, device=device)
            tokens = tokens[rows]
            hidden = hidden[rows] if hidden is not None else None
        active = [active[j] for j in still]
        positions = [positions[j] + 1 for j in still]
        pos = torch.tensor(positions, device=device)
        tables = block_tables[active]
        slots = tables.gather(1, (pos // block_size)[:, None])[:, 0] * block_size + pos % block_size
        meta = AttentionMetadata(
            query_start_loc=list(range(len(active) + 1)),
            seq_lens=[p + 1 for p in positions],
            positions=pos,
            kv_cache=kv_cache,
            slot_mapping=slots,
            block_tables=tables,
        )
        with attention_context(meta):
            logits, hidden = step_fn(tokens, hidden, pos, step)
        rows = {j: generators[i] for j, i in enumerate(active) if i in generators}
        tokens, step_probs = choose_tokens(logits, [params[i] for i in active], sample, rows)
        row = torch.full((n,), -1, dtype=tokens.dtype, device=device)
        row[active] = tokens
        passes.append(row)
        if confidences:
            confidence = torch.ones(n, device=device)
            confidence[active] = draft_confidence(logits, tokens)
            confidences.append(confidence)
        if step_probs is not None:
            for j, i in enumerate(active):
                if probs[i]:
                    probs[i].append(step_probs[j])
    table = torch.stack(passes, dim=1)  # [n, passes]
    if confidences and min_confidence is not None:  # a prefix of each row stays
        doubted = torch.stack(confidences, dim=1).cumprod(dim=1) < min_confidence
        table = table.masked_fill(doubted, -1)
    drafts = [[t for t in r if t >= 0] for r in table.tolist()]  # the chain's one transfer
    return drafts, [
        torch.stack(p[: len(d)]) if d and len(p) >= len(d) else None
        for p, d in zip(probs, drafts, strict=True)
    ]


def draft_confidence(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[n] each draft's probability under softmax(logits) ([n, vocab]; `tokens` [n])."""
    return torch.softmax(logits.float(), dim=-1).gather(1, tokens[:, None])[:, 0]


class ModelDrafter:
    """What the proposers that run a draft model share (the EAGLE family's heads, a draft
    LM): the cache their passes write draft KV into, how many drafts they make and how
    they choose them, and passes 2..k after their own pass 0 (`draft_from_roots`)."""

    needs_token_history = False

    def __init__(
        self,
        kv_cache: KVCache,
        block_size: int,
        num_speculative_tokens: int,
        sample: bool,
        tree: TreeShape | None = None,
        min_confidence: float | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.sample = sample
        self.tree = tree  # draft trees (EAGLE-2's expansion) instead of chains
        self.min_confidence = min_confidence  # chains end where the draft doubts them

    def drafting(self, batch: ProposalBatch) -> tuple[int, list[int]]:
        """(drafts per request this step, the batch indices of the requests that draft:
        those that sampled, none when no draft is wanted)."""
        k = self.k if batch.num_drafts is None else min(self.k, batch.num_drafts)
        return k, [i for i, s in enumerate(batch.sampled) if s and batch.num_valid[i] and k]

    def draft_from_roots(
        self,
        step_fn: StepFn,
        batch: ProposalBatch,
        drafting: list[int],  # batch indices of the requests that draft, in root order
        k: int,
        root_logits: torch.Tensor,  # [n, vocab] the draft's logits after each root
        root_hidden: torch.Tensor | None,  # [n, H] the hidden state the next pass continues
        root_indices: list[int],  # [n] position of each root (the token draft 1 follows)
    ) -> DraftProposal:
        """Every drafting request's drafts after pass 0: a chain (`run_chain`) or a tree
        (`grow_trees`), placed at its batch index; the others get none."""
        proposal = DraftProposal.none(len(batch.sampled))
        params = [batch.params[i] for i in drafting]
        generators = {
            j: batch.draft_generators[i]
            for j, i in enumerate(drafting)
            if i in batch.draft_generators
        }
        tables = batch.block_tables[drafting]
        num_blocks = [batch.num_blocks[i] for i in drafting]
        block_size, kv_cache, sample = self.block_size, self.kv_cache, self.sample
        if self.tree is not None:
            trees, probs = grow_trees(
                step_fn, root_logits, root_hidden, root_indices, tables, num_blocks, block_size,
                kv_cache, params, generators, sample, self.tree,
            )  # fmt: skip
            proposal.parents = [None] * len(batch.sampled)
            for j, i in enumerate(drafting):
                proposal.token_ids[i], proposal.probs[i] = list(trees[j].tokens), probs[j]
                proposal.parents[i] = list(trees[j].parents)
            return proposal
        tokens, first_probs = choose_tokens(root_logits, params, sample, generators)
        first_confidence = None
        if self.min_confidence is not None:
            first_confidence = draft_confidence(root_logits, tokens)
        drafts, draft_probs = run_chain(
            step_fn, tokens, first_probs, root_hidden, root_indices, tables, num_blocks,
            block_size, kv_cache, params, generators, k, sample, self.min_confidence,
            first_confidence,
        )  # fmt: skip
        for j, i in enumerate(drafting):
            proposal.token_ids[i], proposal.probs[i] = drafts[j], draft_probs[j]
        return proposal
