"""Hybrid drafting: n-gram lookup where the context offers a long match, the draft model
(an EAGLE-family head or a draft LM) elsewhere, chosen per request per step.

A small model's answers repeat themselves and quote their prompts: where the request's
last `min_match` (or more, up to `max_n`) tokens occurred earlier in its context, what
followed them then is usually what the target says next, more often than a draft
model's guess. So after the model has drafted (it reads every request's new tokens
each step, which keeps its KV whole whichever drafter wins), a request whose context
has such a match takes the lookup's drafts instead, as many as the step asks for (fewer
when the match is near the end of the context), also where the model drafted fewer or
none (`min_draft_confidence`).

Lossless either way: the choice depends only on tokens already verified, and lookup
drafts carry no distribution (the rejection sampler verifies them as point masses,
NO_DRAFT_PROBS), while the model's keep theirs.
"""

from __future__ import annotations

from cluster.spec_decode.batch import DraftProposal, ProposalBatch, Proposer
from cluster.spec_decode.ngram import ngram_drafts


class HybridProposer:
    needs_token_history = True

    def __init__(self, model: Proposer, k: int, min_match: int, max_n: int) -> None:
        if not 1 <= min_match <= max_n:
            raise ValueError(f"need 1 <= min_match <= max_n, got {min_match} and {max_n}")
        self.model = model
        self.k = k
        self.min_match, self.max_n = min_match, max_n
        self.num_lookup_drafts = 0  # requests x steps that drafted by lookup
        self.num_model_drafts = 0

    def warm_up(self) -> float:
        return self.model.warm_up()

    def propose(self, batch: ProposalBatch) -> DraftProposal:
        proposal = self.model.propose(batch)  # chains: SpeculativeConfig refuses trees here
        token_ids, probs = list(proposal.token_ids), list(proposal.probs)
        k = self.k if batch.num_drafts is None else min(self.k, batch.num_drafts)
        for i, history in enumerate(batch.token_history):
            if not (k and batch.sampled[i] and batch.num_valid[i]):
                continue  # no drafts this step (a partial prompt, or adaptive k = 0)
            lookup = ngram_drafts(history, self.min_match, self.max_n, k)
            if lookup:
                token_ids[i], probs[i] = lookup, None
                self.num_lookup_drafts += 1
            else:
                self.num_model_drafts += 1
        return DraftProposal(token_ids, probs)
