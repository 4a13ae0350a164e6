"""`RejectionInputs`, one rejection-sampling step's validated tensors, and the
placeholder that pads a request's output row; shared by the torch path
(`rejection.py`) and the Triton kernels (`rejection_triton.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class RejectionInputs:
    """Validated inputs of one rejection-sampling step (built by `cluster.sample.rejection`)."""

    draft_token_ids: torch.Tensor  # [num_tokens] int64, flattened in request order
    cu_num_draft_tokens: torch.Tensor  # [batch + 1] int64: request i owns [cu[i], cu[i + 1])
    draft_probs: torch.Tensor | None  # [num_tokens, vocab] float32; None: drafts are deltas
    target_probs: torch.Tensor  # [num_tokens, vocab] float32, rows contiguous
    bonus_token_ids: torch.Tensor  # [batch] int64
    is_greedy: torch.Tensor  # [batch] bool
    uniforms: torch.Tensor | None  # [num_tokens] float64 in [0, 1); read for random requests
    inv_exponentials: torch.Tensor | None  # [batch, vocab] float32, 1 / E; random requests
    max_spec_len: int

    @property
    def batch_size(self) -> int:
        return self.bonus_token_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.draft_token_ids.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.target_probs.shape[1]

    @property
    def num_draft_tokens(self) -> torch.Tensor:  # [batch] int64
        return self.cu_num_draft_tokens[1:] - self.cu_num_draft_tokens[:-1]

    def has_random_drafts(self) -> bool:
        """Whether some non-greedy request has drafts (only then is randomness read)."""
        return bool(((~self.is_greedy) & (self.num_draft_tokens > 0)).any())
