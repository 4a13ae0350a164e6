"""`Verifier`: a step's sampling and draft verification on the last pipeline stage.

A step without drafts is sampled (`Sampler`); drafts, chains and trees alike (a chain is a
tree of width one), are verified by `RejectionSampler` (one Triton kernel and its torch
reference, `kernels/rejection.py`). Every verifying row is processed exactly as the sampler
would at that position, so speculation never changes what is sampled. Also the prompt
logprobs some requests ask for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

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
from cluster.worker.penalty_tables import PenaltyTables
from cluster.worker.request_state import CachedRequestState

# Prompt rows whose logits exist at once for prompt logprobs ([rows, vocab] float32).
PROMPT_LOGITS_ROWS = 256


@dataclass
class Verified:
    tokens: list[list[int]]  # [sampled requests][1 + accepted drafts] the step's new tokens
    logprobs: dict[str, list[TokenLogprobs]]  # by request, for requests that asked
    paths: dict[str, list[int]]  # tree requests with drafts: the accepted nodes, in order


class Verifier:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.penalties = PenaltyTables(vocab_size, device)  # rows added by the runner

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
        if any(s.num_spec_tokens for s in sampled):
            verified = self._verify_drafts(logits, sampled, states)
        else:
            verified = Verified(*self._sample(logits, states), {})
        self.penalties.append([item.req_id for item in sampled], verified.tokens)
        return verified

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
        self, logits: torch.Tensor, states: list[CachedRequestState]
    ) -> tuple[list[list[int]], dict[str, list[TokenLogprobs]]]:
        """One token per request from its one row."""
        if not states:
            return [], {}
        out = self.sampler(logits, self._sampling_metadata(states))
        for st in states:
            st.draft_probs = None  # drafts not verified this step are dropped with it
        lp = out.logprobs.reshape(len(states), 1) if out.logprobs is not None else None
        return [[t] for t in out.token_ids.tolist()], _logprobs_by_request(
            lp, states, [1] * len(states)
        )

    def _verify_drafts(
        self,
        logits: torch.Tensor,
        sampled: list[ScheduledRequest],
        states: list[CachedRequestState],
    ) -> Verified:
        """Verify each sampled request's drafts (a chain, a tree or none)."""
        drafts = [s.token_ids[len(s.token_ids) - s.num_spec_tokens :] for s in sampled]
        parents = [s.spec_parents for s in sampled]
        spec = SpecDecodeMetadata.from_trees(drafts, parents, self.device)
        draft_probs, has_q = self._draft_probs(states, spec)
        out = self.rejection_sampler(
            logits, spec, self._sampling_metadata(states), draft_probs, has_q
        )
        for st in states:
            st.draft_probs = None  # verified now
        rows = out.token_ids.tolist()
        accepted = [[n for n in path if n >= 0] for path in out.accepted_nodes.tolist()]
        counts = [len(path) + 1 for path in accepted]
        paths = {
            item.req_id: path
            for item, path in zip(sampled, accepted, strict=True)
            if item.num_spec_tokens and item.spec_parents is not None
        }
        tokens = [row[:n] for row, n in zip(rows, counts, strict=True)]
        return Verified(tokens, _logprobs_by_request(out.logprobs, states, counts), paths)

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        return SamplingMetadata.from_params(
            [st.sampling_params for st in states],
            self.vocab_size,
            self.device,
            output_token_ids=[st.output_token_ids for st in states],
            generators={i: st.generator for i, st in enumerate(states) if st.generator is not None},
            eos_token_ids=[st.eos_token_id for st in states],
            penalty_tables=(
                self.penalties.prompt_mask,
                self.penalties.output_counts,
                self.penalties.rows([st.req_id for st in states]),
            ),
        )

    def _draft_probs(
        self, states: list[CachedRequestState], spec: SpecDecodeMetadata
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """[num_drafts, vocab] the distribution each draft came from (its parent row of the
        request's `draft_probs`: row 0 the root's), and [batch] whose rows those are (the
        others' drafts are argmax drafts, point masses); (None, None) when none has any."""
        with_q = [
            st.draft_probs is not None and n > 0 and st.draft_probs.shape[0] >= n
            for st, n in zip(states, spec.num_draft_tokens, strict=True)
        ]
        if not any(with_q):
            return None, None
        rows = []
        for st, parents, has in zip(states, spec.parents, with_q, strict=True):
            if not parents:
                continue
            if has:
                index = torch.tensor(parents, device=st.draft_probs.device) + 1
                rows.append(st.draft_probs.index_select(0, index).to(self.device))
            else:
                rows.append(torch.zeros(len(parents), self.vocab_size, device=self.device))
        return torch.cat(rows), torch.tensor(with_q, device=self.device)


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
