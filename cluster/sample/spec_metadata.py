"""`SpecDecodeMetadata`: a batch's drafts as a tree per request (a chain is a tree of width
one) and where each request's logits rows are."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.sample.metadata import LogitsRows


@dataclass(frozen=True)
class SpecDecodeMetadata:
    """Drafts of a batch, as a tree per request (a chain of k drafts: node j's parent is
    j - 1), and where their logits rows are.

    Request i's rows are consecutive in `logits`: its root's (the distribution of its next
    token), then one per node (the distribution after that node). For a chain those are the
    rows verifying each draft, then its bonus row."""

    draft_token_ids: torch.Tensor  # [num_tokens] int64, flattened in request order
    num_draft_tokens: tuple[int, ...]  # per request, 0 allowed
    draft_parents: tuple[tuple[int, ...], ...] = ()  # [batch][n_i]; () for chains

    @property
    def parents(self) -> tuple[tuple[int, ...], ...]:
        """[batch][n_i] each node's parent (-1: the root)."""
        if self.draft_parents:
            return self.draft_parents
        return tuple(tuple(range(-1, n - 1)) for n in self.num_draft_tokens)

    @property
    def max_depth(self) -> int:
        return max((_depth(p) for p in self.parents), default=0)

    @classmethod
    def from_drafts(
        cls, draft_token_ids: Sequence[Sequence[int]], device: torch.device | str = "cpu"
    ) -> SpecDecodeMetadata:
        """Chains: request i's rows are consecutive, one per draft, then its bonus row."""
        return cls.from_trees(draft_token_ids, None, device)

    @classmethod
    def from_trees(
        cls,
        draft_token_ids: Sequence[Sequence[int]],
        parents: Sequence[Sequence[int] | None] | None,
        device: torch.device | str = "cpu",
    ) -> SpecDecodeMetadata:
        """Trees (`parents[i]` None or missing: request i's drafts are a chain); request
        i's rows are consecutive: the root's, then one per node."""
        num_draft = tuple(len(d) for d in draft_token_ids)
        chains = tuple(tuple(range(-1, n - 1)) for n in num_draft)
        given = tuple(
            chain if parents is None or parents[i] is None else tuple(parents[i])
            for i, chain in enumerate(chains)
        )
        flat = [t for drafts in draft_token_ids for t in drafts]
        return cls(
            draft_token_ids=torch.tensor(flat, dtype=torch.int64, device=device),
            num_draft_tokens=num_draft,
            draft_parents=() if given == chains else given,
        )

    def tree_rows(self) -> LogitsRows:
        """The logits rows (every request's root's, then its nodes'): the root's sees nothing
        extra, node j's the drafts on the path from the root down to node j."""
        device = self.draft_token_ids.device
        requests: list[int] = []
        history_rows: list[int] = []
        history_index: list[int] = []  # into draft_token_ids
        start = 0
        for i, parents in enumerate(self.parents):
            paths: list[list[int]] = [[]]
            for j, parent in enumerate(parents):
                paths.append([*paths[parent + 1], start + j])
            for path in paths:
                row = len(requests)
                requests.append(i)
                history_rows.extend([row] * len(path))
                history_index.extend(path)
            start += len(parents)
        index = torch.tensor(history_index, dtype=torch.int64, device=device)
        return LogitsRows(
            requests=tuple(requests),
            request_index=torch.tensor(requests, dtype=torch.int64, device=device),
            history_rows=torch.tensor(history_rows, dtype=torch.int64, device=device),
            history_tokens=self.draft_token_ids[index],
        )


def _depth(parents: Sequence[int]) -> int:
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return max(depths, default=0)
