"""`Sampler`: one token per logits row, every request with its own parameters.

Greedy rows take the argmax of their penalised logits and draw no random numbers. Random
rows draw with the exponential race `argmax(probs / E)`, `E ~ Exp(1)`, from their request's
generator when it has one. Logprobs are computed from the raw logits (`logprobs_mode="raw"`,
the model's own distribution) or from the processed ones (`"processed"`, the distribution
actually sampled from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from cluster.sample.logprobs import Logprobs, compute_logprobs
from cluster.sample.metadata import LogitsRows, SamplingMetadata
from cluster.sample.processing import process_logits, sampling_distribution
from cluster.sample.randomness import draw_inv_exponentials

LogprobsMode = Literal["raw", "processed"]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [rows] int64
    logprobs: Logprobs | None  # [rows, ...] when some request asked for logprobs


class Sampler(nn.Module):
    """Temperature, top-k, top-p, min-p, penalties, seeds and top-n logprobs, vectorised."""

    def __init__(self, logprobs_mode: LogprobsMode = "raw") -> None:
        super().__init__()
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def forward(
        self,
        logits: torch.Tensor,  # [rows, vocab]
        metadata: SamplingMetadata,
        rows: LogitsRows | None = None,
    ) -> SamplerOutput:
        """Sample one token per row (default: row i belongs to request i)."""
        if rows is None:
            rows = LogitsRows.one_per_request(metadata.batch_size, logits.device)
        processed = process_logits(logits, metadata, rows)
        token_ids = self.sample(processed, metadata, rows)
        return SamplerOutput(token_ids, self.logprobs(logits, processed, token_ids, metadata, rows))

    def sample(
        self,
        processed: torch.Tensor,  # [rows, vocab] from process_logits
        metadata: SamplingMetadata,
        rows: LogitsRows,
    ) -> torch.Tensor:
        """[rows] int64: argmax for greedy rows, the exponential race for the others."""
        if metadata.all_greedy:
            return processed.argmax(dim=-1)
        greedy_rows = metadata.is_greedy[rows.request_index]
        probs = sampling_distribution(processed, greedy_rows)  # [rows, vocab]
        needs_draws = [not metadata.greedy[r] for r in rows.requests]
        generators = {
            row: metadata.generators[r]
            for row, r in enumerate(rows.requests)
            if r in metadata.generators
        }
        inv_exp = draw_inv_exponentials(needs_draws, generators, probs.shape[1], probs.device)
        return (probs * inv_exp).argmax(dim=-1)

    def logprobs(
        self,
        logits: torch.Tensor,  # [rows, vocab] raw
        processed: torch.Tensor,  # [rows, vocab]
        token_ids: torch.Tensor,  # [rows] int64, -1 where a row has no token
        metadata: SamplingMetadata,
        rows: LogitsRows,
    ) -> Logprobs | None:
        """Logprobs of `token_ids` for rows whose request asked for them, else None."""
        max_num = metadata.max_num_logprobs
        if max_num is None:
            return None
        wanted = [metadata.num_logprobs[r] for r in rows.requests]
        num = torch.tensor([-1 if n is None else n for n in wanted], device=logits.device)
        source = logits if self.logprobs_mode == "raw" else processed
        return compute_logprobs(source, token_ids, num, max_num)
