"""Speculative-decoding statistics, aggregated over an engine's lifetime.

Definitions follow vLLM: a *draft* is one (request, step) with at least one draft token
verified; acceptance rate = accepted / draft tokens; mean acceptance length =
1 + accepted / drafts (it counts the recovered or bonus token); per-position acceptance
= how often the i-th draft was accepted, per draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(
        self, num_draft_tokens: int, num_accepted_tokens: int, depth: int | None = None
    ) -> None:
        """One verification: its drafts (a tree's nodes), how many were accepted, and how
        many positions deep the drafts went (a chain: one per draft)."""
        if num_draft_tokens == 0:
            return
        depth = num_draft_tokens if depth is None else depth
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.accepted_per_position) < depth:
            self.accepted_per_position += [0] * (depth - len(self.accepted_per_position))
        for i in range(num_accepted_tokens):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict[str, object]:
        drafts = self.num_drafts
        return {
            "num_drafts": drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
            if self.num_draft_tokens
            else 0.0,
            "mean_acceptance_length": 1 + self.num_accepted_tokens / drafts if drafts else 1.0,
            # drafts verified per verification (a tree's nodes)
            "mean_draft_tokens_per_step": self.num_draft_tokens / drafts if drafts else 0.0,
            "acceptance_per_position": [a / drafts for a in self.accepted_per_position]
            if drafts
            else [],
        }
