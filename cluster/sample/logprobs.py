"""Log-probabilities of sampled tokens and of each request's top-n alternatives."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logprobs:
    """Per sampled position: the sampled token's logprob and rank, then the top-n tokens.

    Leading dimensions follow the token ids they describe (`[rows]` for `Sampler`,
    `[batch, max_depth + 1]` for `RejectionSampler`). Column 0 is the sampled token;
    columns 1..n are the request's n most likely tokens, most likely first. Entries a request
    did not ask for, and positions without a token, hold token -1, logprob -inf, rank -1.
    """

    token_ids: torch.Tensor  # [..., 1 + max_num_logprobs] int64
    logprobs: torch.Tensor  # [..., 1 + max_num_logprobs] float32
    ranks: torch.Tensor  # [...] int64, 1 = the most likely token

    def reshape(self, *shape: int) -> Logprobs:
        """The same entries with leading dimensions `shape`."""
        width = self.token_ids.shape[-1]
        return Logprobs(
            self.token_ids.reshape(*shape, width),
            self.logprobs.reshape(*shape, width),
            self.ranks.reshape(*shape),
        )


def compute_logprobs(
    logits: torch.Tensor,  # [rows, vocab]: raw or processed logits
    token_ids: torch.Tensor,  # [rows] int64, -1 where the row has no token
    num_logprobs: torch.Tensor,  # [rows] int64: top-n wanted, -1 = no logprobs for the row
    max_num_logprobs: int,
) -> Logprobs:
    """Logprobs of `token_ids` under `softmax(logits)` and each row's top-n tokens."""
    logprobs = logits.float().log_softmax(dim=-1)  # [rows, vocab]
    wanted = (token_ids >= 0) & (num_logprobs >= 0)  # [rows]
    token = token_ids.clamp_min(0)[:, None]  # [rows, 1]
    chosen = logprobs.gather(1, token)  # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(max_num_logprobs, dim=-1)  # [rows, max_num_logprobs]
    ids = torch.cat([token, top_ids], dim=1)
    values = torch.cat([chosen, top_values], dim=1)
    columns = torch.arange(1 + max_num_logprobs, device=logits.device)
    keep = wanted[:, None] & (columns[None, :] <= num_logprobs[:, None])
    return Logprobs(
        token_ids=torch.where(keep, ids, -1),
        logprobs=torch.where(keep, values, float("-inf")),
        ranks=torch.where(wanted, ranks, -1),
    )
