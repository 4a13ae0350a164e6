"""`TreeRejectionSampler`: verification of a batch of draft trees from the target's
logits, with each request's sampling parameters.

Request i's rows are its root row (the distribution of its next token) and one row per
node (the distribution after that node). Every row is processed exactly as the `Sampler`
would process it at that point of the sequence: penalties and `min_tokens` see the path of
drafts from the root down to the node, then temperature, min-p, top-k, top-p. The
recursive rule (`cluster.sample.tree_rejection`) picks the accepted path and the token
after it (recovered or bonus), drawn from the processed distribution there. A seeded
request draws from its own generator: one uniform per node, then one race over the
vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.draft_tree import DraftTree
from cluster.sample.logprobs import Logprobs, compute_logprobs
from cluster.sample.metadata import LogitsRows, SamplingMetadata
from cluster.sample.processing import process_logits, sampling_distribution
from cluster.sample.randomness import draw_inv_exponentials, draw_uniforms
from cluster.sample.sampler import Sampler
from cluster.sample.tree_rejection import (
    PLACEHOLDER,
    TreeRejectionInputs,
    tree_rejection_sample,
)


@dataclass(frozen=True)
class TreeSamplerOutput:
    token_ids: torch.Tensor  # [batch, max_depth + 1] int64, PLACEHOLDER after the last
    accepted_nodes: list[list[int]]  # [batch] the accepted path's nodes
    logprobs: Logprobs | None  # [batch, max_depth + 1, ...] for every output token

    @property
    def num_output_tokens(self) -> list[int]:
        return [len(path) + 1 for path in self.accepted_nodes]


def tree_rows(trees: list[DraftTree], device: torch.device) -> LogitsRows:
    """Row 0 of each request sees nothing extra; node j's row sees the drafts on the path
    from the root down to node j."""
    requests, history_rows, history_tokens = [], [], []
    for i, tree in enumerate(trees):
        for node in range(-1, tree.num_nodes):
            row = len(requests)
            requests.append(i)
            path = tree.path(node)
            history_rows.extend([row] * len(path))
            history_tokens.extend(tree.tokens[n] for n in path)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return LogitsRows(tuple(requests), ints(requests), ints(history_rows), ints(history_tokens))


class TreeRejectionSampler:
    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = Sampler() if sampler is None else sampler

    def __call__(
        self,
        logits: torch.Tensor,  # [sum(n_i + 1), vocab]: each request's root row, then its nodes'
        trees: list[DraftTree],
        metadata: SamplingMetadata,
        draft_probs: list[torch.Tensor | None],  # [batch] [n_i + 1, vocab] or None (deltas)
    ) -> TreeSamplerOutput:
        device = logits.device
        rows = tree_rows(trees, device)
        processed = process_logits(logits, metadata, rows)
        greedy = metadata.is_greedy
        target = sampling_distribution(processed, greedy[rows.request_index])
        greedy_list = greedy.tolist()
        nodes = [t.num_nodes for t in trees]
        needs = [not g and n > 0 for g, n in zip(greedy_list, nodes, strict=True)]
        generators = metadata.generators
        flat = draw_uniforms(nodes, needs, generators, device)
        uniforms = torch.zeros(len(trees), max(max(nodes, default=0), 1), dtype=torch.float64)
        uniforms = uniforms.to(device)
        start = 0
        for i, n in enumerate(nodes):
            uniforms[i, :n] = flat[start : start + n]
            start += n
        races = draw_inv_exponentials(
            [not g for g in greedy_list], generators, logits.shape[1], device
        )
        full = None
        has_q = None
        if any(q is not None for q in draft_probs):
            full = torch.zeros_like(target)
            start = 0
            for tree, q in zip(trees, draft_probs, strict=True):
                if q is not None:  # (a chain's: one row per draft, no leaf row)
                    rows_q = q[: tree.num_nodes + 1]
                    full[start : start + rows_q.shape[0]] = rows_q
                start += tree.num_nodes + 1
            has_q = torch.tensor([q is not None for q in draft_probs], device=device)
        verified = tree_rejection_sample(
            TreeRejectionInputs(trees, target, full, uniforms, races, has_q)
        )
        logprobs = None
        if metadata.max_num_logprobs is not None:
            raw = self.sampler.logprobs_mode == "raw"
            logprobs = self._logprobs(
                logits if raw else processed,
                verified.token_ids,
                verified.accepted_nodes,
                trees,
                metadata,
            )
        return TreeSamplerOutput(verified.token_ids, verified.accepted_nodes, logprobs)

    @staticmethod
    def _logprobs(
        sources: torch.Tensor,  # [rows, vocab] raw or processed logits
        token_ids: torch.Tensor,  # [batch, width]
        accepted: list[list[int]],
        trees: list[DraftTree],
        metadata: SamplingMetadata,
    ) -> Logprobs:
        """Logprobs of every output token, read at the row that produced it: the root's for
        the first, then each accepted node's for the token after it."""
        batch, width = token_ids.shape
        row_of, start = [], 0
        for tree, path in zip(trees, accepted, strict=True):
            producing = [start] + [start + 1 + n for n in path]
            row_of.extend(producing[j] if j < len(producing) else start for j in range(width))
            start += tree.num_nodes + 1
        index = torch.tensor(row_of, dtype=torch.int64, device=sources.device)
        wanted = [metadata.num_logprobs[i] for i in range(batch) for _ in range(width)]
        num = torch.tensor([-1 if n is None else n for n in wanted], device=sources.device)
        ids = token_ids.reshape(-1).clamp(min=0)
        flat = compute_logprobs(sources.index_select(0, index), ids, num, metadata.max_num_logprobs)
        return flat.reshape(batch, width)


__all__ = ["PLACEHOLDER", "TreeRejectionSampler", "TreeSamplerOutput", "tree_rows"]
