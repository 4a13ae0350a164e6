"""`PenaltyTables`: what repetition, presence and frequency penalties need of each
request that uses one, kept between steps.

A request's row holds which tokens its prompt contains and how often each token has
been output so far. A step adds only its new tokens, so the sampler reads the same
statistics as before without recounting every request's whole history (at batch 64
with 500-token histories, recounting cost 18 ms a step).
"""

from __future__ import annotations

import torch

from cluster.sample.metadata import uses_penalties
from cluster.sampling_params import SamplingParams


class PenaltyTables:
    def __init__(self, vocab_size: int, device: torch.device, rows: int = 4) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # [rows, vocab] each; a row per penalised request (grown by doubling)
        self.prompt_mask = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(rows, vocab_size, dtype=torch.int32, device=device)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))

    def add(
        self,
        req_id: str,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
    ) -> None:
        """A new (or resumed) request's row, if it uses a penalty."""
        if not uses_penalties(params):
            return
        if not self._free_rows:
            self._grow()
        row = self.row_of[req_id] = self._free_rows.pop()
        prompt = torch.tensor(prompt_token_ids, dtype=torch.int64, device=self.device)
        self.prompt_mask[row, prompt] = True
        self.append([req_id], [output_token_ids])

    def append(self, req_ids: list[str], token_ids: list[list[int]]) -> None:
        """Count each request's new output tokens, in one scatter (requests without a
        row are skipped)."""
        if not self.row_of:  # nobody uses a penalty: nothing to count
            return
        rows, tokens = [], []
        for req_id, new in zip(req_ids, token_ids, strict=True):
            row = self.row_of.get(req_id)
            if row is not None:
                rows += [row] * len(new)
                tokens += new
        if not rows:
            return
        index = torch.tensor([rows, tokens], dtype=torch.int64, device=self.device)
        ones = torch.ones(len(rows), dtype=torch.int32, device=self.device)
        self.output_counts.index_put_((index[0], index[1]), ones, accumulate=True)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.prompt_mask[row] = False
            self.output_counts[row] = 0
            self._free_rows.append(row)

    def rows(self, req_ids: list[str]) -> list[int]:
        """Each request's row (0 for requests without a penalty: their rows are not read)."""
        return [self.row_of.get(req_id, 0) for req_id in req_ids]

    def _grow(self) -> None:
        old = self.prompt_mask.shape[0]
        self.prompt_mask = torch.cat([self.prompt_mask, torch.zeros_like(self.prompt_mask)])
        self.output_counts = torch.cat([self.output_counts, torch.zeros_like(self.output_counts)])
        self._free_rows = list(range(2 * old - 1, old - 1, -1))
