"""`ModelRunner`: one step on one worker: inputs, target forward, sampling, verification.

The runner keeps a small per-request state (prompt and output ids for penalties, the
request's generator, its block table) that the scheduler output updates every step.
Every TP rank samples the same tokens (same logits, same generators), so all ranks agree
on the output; only one of them reports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from cluster.engine.messages import (
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from cluster.sample import (
    Logprobs,
    RejectionSampler,
    Sampler,
    SamplingMetadata,
    SpecDecodeMetadata,
)
from cluster.sampling_params import SamplingParams
from cluster.worker.input_batch import ModelInputs, prepare_inputs
from cluster.worker.kv_cache import PagedKVCache


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: PagedKVCache,
        device: torch.device,
        sampler_backend: str = "auto",
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.vocab_size = int(model.config.vocab_size)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler, backend=sampler_backend)
        self.requests: dict[str, CachedRequestState] = {}

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.freed_req_ids:
            self.requests.pop(req_id, None)
        for new in so.new_requests:
            self.requests[new.req_id] = self._new_state(new)
        for item in so.scheduled:
            self.requests[item.req_id].block_ids.extend(item.new_block_ids)

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        params = new.sampling_params
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return CachedRequestState(
            new.req_id, list(new.prompt_token_ids), list(new.output_token_ids), params, generator
        )

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if not so.scheduled:
            return ModelRunnerOutput(so.step_id, [], [])
        block_tables = {s.req_id: self.requests[s.req_id].block_ids for s in so.scheduled}
        inputs = prepare_inputs(so.scheduled, block_tables, self.kv_cache.block_size, self.device)
        inputs.meta.kv_cache = self.kv_cache
        hidden = self.model(inputs.input_ids, inputs.meta)  # [num_tokens, hidden]
        sampled_ids, logprobs = self._sample(hidden, inputs)
        per_request = dict(zip((s.req_id for s in inputs.sampled), sampled_ids, strict=True))
        for req_id, tokens in per_request.items():
            self.requests[req_id].output_token_ids.extend(tokens)
        return ModelRunnerOutput(
            step_id=so.step_id,
            req_ids=[s.req_id for s in so.scheduled],
            sampled_token_ids=[per_request.get(s.req_id, []) for s in so.scheduled],
            logprobs=logprobs,
        )

    def _sample(
        self, hidden: torch.Tensor, inputs: ModelInputs
    ) -> tuple[list[list[int]], dict[str, list[TokenLogprobs]]]:
        if not inputs.sampled:
            return [], {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [num_logits, vocab]
        states = [self.requests[s.req_id] for s in inputs.sampled]
        metadata = SamplingMetadata.from_params(
            [st.sampling_params for st in states],
            self.vocab_size,
            self.device,
            prompt_token_ids=[st.prompt_token_ids for st in states],
            output_token_ids=[st.output_token_ids for st in states],
            generators={i: st.generator for i, st in enumerate(states) if st.generator is not None},
        )
        if any(s.num_spec_tokens for s in inputs.sampled):
            drafts = [s.token_ids[len(s.token_ids) - s.num_spec_tokens :] for s in inputs.sampled]
            spec = SpecDecodeMetadata.from_drafts(drafts, self.device)
            out = self.rejection_sampler(logits, spec, metadata)
            token_ids, lp = out.token_ids, out.logprobs  # [batch, k + 1], -1 after the last
            counts = out.num_output_tokens.tolist()
        else:
            out = self.sampler(logits, metadata)
            token_ids = out.token_ids[:, None]  # [batch, 1]
            lp = out.logprobs.reshape(len(states), 1) if out.logprobs is not None else None
            counts = [1] * len(states)
        rows = token_ids.tolist()
        sampled = [row[:n] for row, n in zip(rows, counts, strict=True)]
        return sampled, _logprobs_by_request(lp, states, counts)


def _logprobs_by_request(
    logprobs: Logprobs | None, states: list[CachedRequestState], counts: list[int]
) -> dict[str, list[TokenLogprobs]]:
    """Wire form of the logprobs of every output token, for requests that asked for them."""
    if logprobs is None:
        return {}
    ids, values, ranks = (
        logprobs.token_ids.tolist(),
        logprobs.logprobs.tolist(),
        logprobs.ranks.tolist(),
    )
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
