"""Which request each logits row belongs to, and the speculative-decoding layout of the rows.

Plain decoding samples one row per request. With speculation a request with `n` drafts
has `n + 1` logits rows: row `j < n` verifies draft `j` and is processed as if drafts
`0 .. j-1` were already output (its penalties see them); row `n` is the bonus position
and sees all `n` drafts. `LogitsRows` carries exactly that: the request of each row and
the extra (row, token) history pairs that penalties must count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitsRows:
    """Row -> request map, plus history tokens each row sees beyond its request's output."""

    requests: tuple[int, ...]  # host copy of request_index
    request_index: torch.Tensor  # [rows] int64
    history_rows: torch.Tensor  # [pairs] int64: the row that also sees ...
    history_tokens: torch.Tensor  # [pairs] int64: ... this token as already output

    @property
    def num_rows(self) -> int:
        return len(self.requests)

    @classmethod
    def one_per_request(cls, batch_size: int, device: torch.device | str) -> LogitsRows:
        """Plain decoding: row i samples for request i and sees nothing extra."""
        none = torch.zeros(0, dtype=torch.int64, device=device)
        index = torch.arange(batch_size, device=device)
        return cls(tuple(range(batch_size)), index, none, none)


@dataclass(frozen=True)
class SpecDecodeMetadata:
    """Drafts of a batch and where their verifying and bonus logits rows are."""

    draft_token_ids: torch.Tensor  # [num_tokens] int64, flattened in request order
    num_draft_tokens: tuple[int, ...]  # per request, 0 allowed
    target_logits_indices: torch.Tensor  # [num_tokens] the logits row verifying each draft
    bonus_logits_indices: torch.Tensor  # [batch] the logits row of each bonus position

    @property
    def max_spec_len(self) -> int:
        return max(self.num_draft_tokens, default=0)

    @classmethod
    def from_drafts(
        cls, draft_token_ids: Sequence[Sequence[int]], device: torch.device | str = "cpu"
    ) -> SpecDecodeMetadata:
        """Layout where request i's rows are consecutive: one per draft, then its bonus row."""
        num_draft = tuple(len(d) for d in draft_token_ids)
        target, bonus, start = [], [], 0
        for n in num_draft:
            target.extend(range(start, start + n))
            bonus.append(start + n)
            start += n + 1
        flat = [t for drafts in draft_token_ids for t in drafts]
        return cls(
            draft_token_ids=torch.tensor(flat, dtype=torch.int64, device=device),
            num_draft_tokens=num_draft,
            target_logits_indices=torch.tensor(target, dtype=torch.int64, device=device),
            bonus_logits_indices=torch.tensor(bonus, dtype=torch.int64, device=device),
        )

    def draft_rows(self) -> LogitsRows:
        """Rows of the verifying positions: row `cu[i] + j` sees drafts `0 .. j-1` of request i."""
        return self._rows(bonus=False)

    def bonus_rows(self) -> LogitsRows:
        """Rows of the bonus positions: row i sees every draft of request i."""
        return self._rows(bonus=True)

    def _rows(self, bonus: bool) -> LogitsRows:
        device = self.draft_token_ids.device
        requests: list[int] = []
        history_rows: list[int] = []
        history_index: list[int] = []  # into draft_token_ids
        start = 0
        for i, n in enumerate(self.num_draft_tokens):
            positions = [n] if bonus else list(range(n))
            for j in positions:
                row = len(requests)
                requests.append(i)
                history_rows.extend([row] * j)
                history_index.extend(range(start, start + j))
            start += n
        index = torch.tensor(history_index, dtype=torch.int64, device=device)
        return LogitsRows(
            requests=tuple(requests),
            request_index=torch.tensor(requests, dtype=torch.int64, device=device),
            history_rows=torch.tensor(history_rows, dtype=torch.int64, device=device),
            history_tokens=self.draft_token_ids[index],
        )
