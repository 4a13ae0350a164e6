"""The proposer interface: what a drafter receives after the target has verified a step
(`ProposalBatch`), what it returns (`DraftProposal`), and what the model runner asks of
it (`Proposer`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from cluster.sampling_params import SamplingParams


@dataclass
class ProposalBatch:
    """One entry per scheduled request (batch order), plus the target step's tensors.

    `num_valid[i]` of request i's `query_lens[i]` scheduled tokens hold valid target state
    (rejected drafts excluded); `next_token_ids[i]` is the token after them: the token
    just sampled, or the next prompt token when the prompt is only partly computed.
    Only requests with `sampled[i]` get drafts.
    """

    query_start_loc: list[int]  # [batch + 1] of the target step
    num_computed: list[int]  # [batch] position of each request's first scheduled token
    num_valid: list[int]  # [batch]
    next_token_ids: list[int]  # [batch]
    sampled: list[bool]  # [batch]
    params: list[SamplingParams]  # [batch]
    # batch index -> the request's draft generator (seeded sampled requests only), so a
    # seeded request's drafts do not depend on what else is in the batch
    draft_generators: dict[int, torch.Generator]
    # [batch] prompt + output ids after this step (only for proposers that ask for it)
    token_history: list[list[int]]
    input_ids: torch.Tensor  # [num_tokens] the target step's token ids
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens]
    block_tables: torch.Tensor  # [batch, max_blocks]
    num_blocks: list[int]  # [batch] blocks allocated to each request
    target_hidden: torch.Tensor | None  # [num_tokens, hidden] (EAGLE-3: [num_tokens, 3 * hidden])
    # Drafts wanted per request (adaptive speculation; at most the proposer's k). With 0,
    # a draft with its own KV still reads this step's tokens, so it can resume later.
    num_drafts: int | None = None
    # [batch] request ids, and the requests finished or preempted since the last step (a
    # proposer that keeps state per request drops theirs)
    req_ids: list[str] = field(default_factory=list)
    freed_req_ids: list[str] = field(default_factory=list)


@dataclass
class DraftProposal:
    token_ids: list[list[int]]  # [batch][<= k] drafts (empty for requests that did not sample)
    # [batch] the distribution each request's drafts were sampled from ([k_i, vocab]; for a
    # tree [n_i + 1, vocab]: the root's row, then each node's), or None where drafts are
    # argmax / deltas.
    probs: list[torch.Tensor | None]
    # [batch] each draft's parent when the drafts form a tree (`cluster.draft_tree`);
    # None: chains.
    parents: list[list[int] | None] | None = None

    @classmethod
    def none(cls, batch_size: int) -> DraftProposal:
        """No drafts for any request."""
        return cls([[] for _ in range(batch_size)], [None] * batch_size)


class Proposer(Protocol):
    """A drafter: the EAGLE-family heads, a draft LM, n-gram lookup (or a test's script)."""

    # Whether `ProposalBatch.token_history` must be filled (a list copy per request).
    needs_token_history: bool

    def propose(self, batch: ProposalBatch) -> DraftProposal:
        """Drafts for the requests of `batch` that sampled this step."""
        ...

    def warm_up(self) -> float:
        """Compile what can be compiled now (once, at start-up); the seconds it took."""
        ...
