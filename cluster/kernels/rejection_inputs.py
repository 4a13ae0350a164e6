"""`RejectionInputs`, one verification step's validated tensors, `RejectionOutput`, and the
placeholder that pads a request's output row; shared by the torch path (`rejection.py`)
and the Triton kernel (`rejection_triton.py`).

Every request's drafts form a tree (`cluster.draft_tree.DraftTree`): node j of request i is
`draft_token_ids[cu[i] + j]`, its parent `draft_parents[cu[i] + j]` (a node of the same
request before it, or -1 for the root). A chain of k drafts is the tree whose node j has
parent j - 1, so chains and trees share one layout and one verification rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class RejectionInputs:
    """Validated inputs of one verification step (built by `cluster.sample.rejection`)."""

    draft_token_ids: torch.Tensor  # [num_tokens] int64, flattened in request order
    cu_num_draft_tokens: torch.Tensor  # [batch + 1] int64: request i owns [cu[i], cu[i + 1])
    draft_parents: torch.Tensor  # [num_tokens] int64: parent node in the request, -1 the root
    # [num_rows, vocab] float32, rows contiguous: request i's root row is
    # `target_row_starts[i]`, node j's row (the distribution after node j) the one j + 1 after
    target_probs: torch.Tensor
    target_row_starts: torch.Tensor  # [batch] int64
    # [num_tokens, vocab] float32: the distribution each draft was drawn from (siblings
    # share their parent's); None: every draft is a point mass (delta)
    draft_probs: torch.Tensor | None
    # [batch] bool: whose drafts `draft_probs` describes (the others' are deltas); None:
    # every request's when `draft_probs` is given
    has_draft_probs: torch.Tensor | None
    # [batch] int64 or None. Given: the token after a fully accepted path that ends at a
    # leaf (sampled elsewhere; leaf rows are then never read). None: drawn from the leaf's row.
    bonus_token_ids: torch.Tensor | None
    is_greedy: torch.Tensor  # [batch] bool
    uniforms: torch.Tensor | None  # [num_tokens] float64 in [0, 1); read for random requests
    inv_exponentials: torch.Tensor | None  # [batch, vocab] float32, 1 / E; random requests
    max_depth: int  # the deepest node's depth over the batch (a chain of k: k)
    # Every request's drafts are a chain (known on the host: then no residual is ever
    # folded, and the torch path reads nothing back per draft)
    all_chains: bool

    @classmethod
    def for_chains(
        cls,
        num_draft_tokens: list[int],  # [batch]
        *,
        draft_token_ids: torch.Tensor,
        target_probs: torch.Tensor,  # [num_tokens, vocab]: one row per draft, no bonus rows
        draft_probs: torch.Tensor | None,
        bonus_token_ids: torch.Tensor,
        is_greedy: torch.Tensor,
        uniforms: torch.Tensor | None,
        inv_exponentials: torch.Tensor | None,
    ) -> RejectionInputs:
        """Chains in the layout of vLLM's rejection sampler: request i's rows are its drafts'
        (the bonus token is given, so leaf rows do not exist)."""
        device = target_probs.device
        cu = torch.tensor([0, *num_draft_tokens], dtype=torch.int64).cumsum(0).to(device)
        parents = [p for n in num_draft_tokens for p in range(-1, n - 1)]
        return cls(
            draft_token_ids=draft_token_ids,
            cu_num_draft_tokens=cu,
            draft_parents=torch.tensor(parents, dtype=torch.int64, device=device),
            target_probs=target_probs,
            target_row_starts=cu[:-1],
            draft_probs=draft_probs,
            has_draft_probs=None,
            bonus_token_ids=bonus_token_ids,
            is_greedy=is_greedy,
            uniforms=uniforms,
            inv_exponentials=inv_exponentials,
            max_depth=max(num_draft_tokens, default=0),
            all_chains=True,
        )

    @property
    def batch_size(self) -> int:
        return self.is_greedy.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.draft_token_ids.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.target_probs.shape[1]

    @property
    def num_draft_tokens(self) -> torch.Tensor:  # [batch] int64
        return self.cu_num_draft_tokens[1:] - self.cu_num_draft_tokens[:-1]

    def request_has_draft_probs(self) -> torch.Tensor:  # [batch] bool
        if self.draft_probs is None:
            return torch.zeros_like(self.is_greedy)
        if self.has_draft_probs is None:
            return torch.ones_like(self.is_greedy)
        return self.has_draft_probs


@dataclass(frozen=True)
class RejectionOutput:
    token_ids: torch.Tensor  # [batch, max_depth + 1] int64, PLACEHOLDER_TOKEN_ID after the last
    accepted_nodes: torch.Tensor  # [batch, max_depth] int64: node accepted at each depth, or -1
