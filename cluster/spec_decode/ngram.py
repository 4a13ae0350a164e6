"""Prompt-lookup (n-gram) drafts: continue the text the way it went the last time the
current suffix appeared.

For n from `max_n` down to `min_n`, the last n tokens are searched for earlier in the
request's own tokens (prompt and output); at the first n that matches, the earliest
occurrence wins and the up-to-k tokens that followed it are the drafts.
"""

from __future__ import annotations

import numpy as np

from cluster.spec_decode.batch import DraftProposal, ProposalBatch


def ngram_drafts(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Drafts for one sequence (possibly fewer than k, or none)."""
    seq = np.asarray(tokens, dtype=np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = seq[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(
            seq[: length - 1], n
        )  # excludes the suffix itself
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            follow = int(starts[0]) + n
            return seq[follow : follow + k].tolist()
    return []


class NgramProposer:
    needs_token_history = True

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n

    def warm_up(self) -> float:
        return 0.0  # nothing to compile

    def propose(self, batch: ProposalBatch) -> DraftProposal:
        k = self.k if batch.num_drafts is None else min(self.k, batch.num_drafts)
        drafts = [
            ngram_drafts(history, self.min_n, self.max_n, k) if sampled and k else []
            for history, sampled in zip(batch.token_history, batch.sampled, strict=True)
        ]
        return DraftProposal(drafts, [None] * len(drafts))
