"""`CachedRequestState`: what a worker keeps of each running request between steps
(prompt and output ids for penalties and n-gram lookup, its generators, the
distributions its pending drafts came from; its block table is in `InputBatch`),
updated by every scheduler output."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.engine.messages import NewRequestData
from cluster.sample.randomness import draft_seed
from cluster.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None  # the verifier's and sampler's draws
    draft_generator: torch.Generator | None  # sampled drafts' draws (an independent stream)
    # The distributions the pending drafts were drawn from ([k, vocab]; for a tree, the root's
    # row then one per node: [n + 1, vocab]); None: argmax drafts.
    draft_probs: torch.Tensor | None = None
    eos_token_id: int | None = None

    def token_at(self, position: int) -> int:
        if position < len(self.prompt_token_ids):
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - len(self.prompt_token_ids)]

    @classmethod
    def of(cls, new: NewRequestData, device: torch.device) -> CachedRequestState:
        """A new request's state; a seeded sampled request gets its generators here."""
        params = new.sampling_params
        generator = draft_generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=device).manual_seed(params.seed)
            draft_generator = torch.Generator(device=device)
            draft_generator.manual_seed(draft_seed(params.seed))
        return cls(
            new.req_id,
            list(new.prompt_token_ids),
            list(new.output_token_ids),
            params,
            generator,
            draft_generator,
            eos_token_id=new.eos_token_id,
        )
