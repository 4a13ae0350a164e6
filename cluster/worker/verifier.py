"""`Verifier`: a step's sampling and draft verification on the last pipeline stage.

Requests without drafts are sampled (`Sampler`); drafts are verified by rejection
sampling, chains through `RejectionSampler` (the Triton kernel and its torch reference,
`kernels/rejection.py`), trees (and chains in a step that has trees: a chain is a tree of
width one) through `TreeRejectionSampler`. Every verifying row is processed exactly as
the sampler would at that position, so speculation never changes what is sampled. Also
the prompt logprobs some requests ask for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.draft_tree import DraftTree
from cluster.engine.messages import PromptLogprobs, ScheduledRequest, TokenLogprobs
from cluster.sample import (
    Logprobs,
    RejectionSampler,
    Sampler,
    SamplingMetadata,
    SpecDecodeMetadata,
    compute_logprobs,
)
from cluster.sample.grammar_mask import apply_token_bitmask, bitmask_rows
from cluster.sample.tree_sampler import TreeRejectionSampler
from cluster.worker.request_state import CachedRequestState

# Prompt rows whose logits exist at once for prompt logprobs ([rows, vocab] float32).
PROMPT_LOGITS_ROWS = 256


@dataclass
class Verified:
    tokens: list[list[int]]  # [sampled requests][1 + accepted drafts] the step's new tokens
    logprobs: dict[str, list[TokenLogprobs]]  # by request, for requests that asked
    paths: dict[str, list[int]]  # tree requests with drafts: the accepted nodes, in order


class Verifier:
    def __init__(self, vocab_size: int, device: torch.device, backend: str = "auto") -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler, backend=backend)
        self.tree_sampler = TreeRejectionSampler(self.sampler)

    def prompt_logprobs(
        self,
        logits_of: Callable[[torch.Tensor], torch.Tensor],
        hidden: torch.Tensor,  # [num_tokens, hidden] the step's final hidden states
        scheduled: list[ScheduledRequest],
        requests: dict[str, CachedRequestState],
    ) -> dict[str, PromptLogprobs]:
        """For requests that asked: the logprobs of the prompt tokens that this step's rows
        predict (row p predicts prompt token p + 1), from the raw logits."""
        result: dict[str, PromptLogprobs] = {}
        row = 0  # the request's first row in `hidden` ([num_tokens, hidden])
        for item in scheduled:
            state = requests[item.req_id]
            num_top = state.sampling_params.prompt_logprobs
            first = item.num_computed_tokens
            end = min(first + len(item.token_ids), len(state.prompt_token_ids) - 1)
            if num_top is not None and end > first:
                tokens: list[TokenLogprobs] = []
                for lo in range(first, end, PROMPT_LOGITS_ROWS):
                    hi = min(lo + PROMPT_LOGITS_ROWS, end)
                    rows = hidden[row + lo - first : row + hi - first]
                    logits = logits_of(rows)  # [hi - lo, vocab]
                    targets = state.prompt_token_ids[lo + 1 : hi + 1]
                    ids = torch.tensor(targets, device=self.device)
                    wanted = torch.full_like(ids, num_top)
                    lp = compute_logprobs(logits, ids, wanted, num_top)
                    tokens += map(
                        TokenLogprobs,
                        lp.token_ids.tolist(),
                        lp.logprobs.tolist(),
                        lp.ranks.tolist(),
                    )
                result[item.req_id] = PromptLogprobs(first, tokens)
            row += len(item.token_ids)
        return result

    def verify(
        self,
        logits: torch.Tensor,  # [num_logits, vocab] float32 at `ModelInputs.logits_indices`
        sampled: list[ScheduledRequest],
        states: list[CachedRequestState],
    ) -> Verified:
        """Sample, or verify the drafts of, every request that samples this step (rows
        of guided requests masked by their grammars first)."""
        self._apply_grammars(logits, sampled)
        if any(s.spec_parents is not None for s in sampled):
            return self._verify_trees(logits, sampled, states)
        tokens, logprobs = self._sample(logits, sampled, states)
        return Verified(tokens, logprobs, {})

    def _apply_grammars(self, logits: torch.Tensor, sampled: list[ScheduledRequest]) -> None:
        guided, first = [], 0
        for item in sampled:
            num_rows = 1 + item.num_spec_tokens
            if item.grammar_bitmask is not None:
                guided.append((first, num_rows, item.grammar_bitmask))
            first += num_rows
        if guided:
            apply_token_bitmask(logits, *bitmask_rows(guided, self.device))

    def _sample(
        self,
        logits: torch.Tensor,
        sampled: list[ScheduledRequest],
        states: list[CachedRequestState],
    ) -> tuple[list[list[int]], dict[str, list[TokenLogprobs]]]:
        if not sampled:
            return [], {}
        metadata = self._sampling_metadata(states)
        if any(s.num_spec_tokens for s in sampled):
            drafts = [s.token_ids[len(s.token_ids) - s.num_spec_tokens :] for s in sampled]
            spec = SpecDecodeMetadata.from_drafts(drafts, self.device)
            draft_probs = self._draft_probs(states, drafts)
            out = self.rejection_sampler(logits, spec, metadata, draft_probs)
            token_ids, lp = out.token_ids, out.logprobs  # [batch, k + 1], -1 after the last
            counts = out.num_output_tokens.tolist()
        else:
            out = self.sampler(logits, metadata)
            token_ids = out.token_ids[:, None]  # [batch, 1]
            lp = out.logprobs.reshape(len(states), 1) if out.logprobs is not None else None
            counts = [1] * len(states)
        for st in states:
            st.draft_probs = None  # verified now
        rows = token_ids.tolist()
        tokens = [row[:n] for row, n in zip(rows, counts, strict=True)]
        return tokens, _logprobs_by_request(lp, states, counts)

    def _verify_trees(
        self,
        logits: torch.Tensor,
        sampled: list[ScheduledRequest],
        states: list[CachedRequestState],
    ) -> Verified:
        """Verify each sampled request's draft tree (a chain or no drafts are trees too)."""
        metadata = self._sampling_metadata(states)
        trees = []
        for item in sampled:
            drafts = item.token_ids[len(item.token_ids) - item.num_spec_tokens :]
            if item.spec_parents is None:
                trees.append(DraftTree.chain(drafts))
            else:
                trees.append(DraftTree(tuple(drafts), tuple(item.spec_parents)))
        probs = [
            st.draft_probs if st.draft_probs is not None and tree.num_nodes else None
            for st, tree in zip(states, trees, strict=True)
        ]
        out = self.tree_sampler(logits, trees, metadata, probs)
        for st in states:
            st.draft_probs = None  # verified now
        counts = out.num_output_tokens
        rows = out.token_ids.tolist()
        paths = {
            item.req_id: path
            for item, path in zip(sampled, out.accepted_nodes, strict=True)
            if item.num_spec_tokens
        }
        tokens = [row[:n] for row, n in zip(rows, counts, strict=True)]
        return Verified(tokens, _logprobs_by_request(out.logprobs, states, counts), paths)

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        return SamplingMetadata.from_params(
            [st.sampling_params for st in states],
            self.vocab_size,
            self.device,
            prompt_token_ids=[st.prompt_token_ids for st in states],
            output_token_ids=[st.output_token_ids for st in states],
            generators={i: st.generator for i, st in enumerate(states) if st.generator is not None},
            eos_token_ids=[st.eos_token_id for st in states],
        )

    def _draft_probs(
        self, states: list[CachedRequestState], drafts: list[list[int]]
    ) -> torch.Tensor | None:
        """[num_drafts, vocab] the distributions the drafts came from; one-hot rows (deltas)
        for argmax drafts. None when every draft is an argmax draft."""
        if all(st.draft_probs is None for st in states):
            return None
        rows = []
        for st, d in zip(states, drafts, strict=True):
            if not d:
                continue
            if st.draft_probs is not None and st.draft_probs.shape[0] >= len(d):
                rows.append(st.draft_probs[: len(d)].to(self.device))
            else:
                ids = torch.tensor(d, device=self.device)
                rows.append(torch.nn.functional.one_hot(ids, self.vocab_size).float())
        return torch.cat(rows)


def _logprobs_by_request(
    logprobs: Logprobs | None, states: list[CachedRequestState], counts: list[int]
) -> dict[str, list[TokenLogprobs]]:
    """Wire form of the logprobs of every output token, for requests that asked for them."""
    if logprobs is None:
        return {}
    ids = logprobs.token_ids.tolist()
    values = logprobs.logprobs.tolist()
    ranks = logprobs.ranks.tolist()
    result: dict[str, list[TokenLogprobs]] = {}
    for i, (state, n) in enumerate(zip(states, counts, strict=True)):
        wanted = state.sampling_params.logprobs
        if wanted is None:
            continue
        result[state.req_id] = [
            TokenLogprobs(ids[i][j][: wanted + 1], values[i][j][: wanted + 1], ranks[i][j])
            for j in range(n)
        ]
    return result
