"""`ModelRunner`: one step on one worker: inputs, target forward, sampling, verification,
and the next step's drafts.

The runner keeps a small per-request state (prompt and output ids for penalties and
n-gram lookup, the request's generator, its block table, the distributions its pending
drafts were sampled from) that the scheduler output updates every step. Every TP rank
samples the same tokens (same logits, same generators) and proposes the same drafts, so
all ranks agree; only one of them reports. With pipeline stages, a stage that is not the
last runs its layers and hands the activations on; sampling and drafting happen on the
last stage, and the next step's token ids reach every stage from the scheduler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cluster.draft_tree import DraftTree
from cluster.engine.messages import (
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from cluster.models.attention import AttentionLayer, attention_context
from cluster.models.compiled import CompiledForward, CompileOptions, cut_rows, pad_rows
from cluster.parallel import ParallelState
from cluster.parallel.pipeline import StageActivations
from cluster.sample import (
    Logprobs,
    RejectionSampler,
    Sampler,
    SamplingMetadata,
    SpecDecodeMetadata,
    compute_logprobs,
)
from cluster.sample.randomness import draft_seed
from cluster.sample.tree_sampler import TreeRejectionSampler
from cluster.sampling_params import SamplingParams
from cluster.spec_decode.batch import ProposalBatch, Proposer
from cluster.worker.input_batch import ModelInputs, prepare_inputs
from cluster.worker.kv_cache import PagedKVCache
from cluster.worker.state_cache import RecurrentStateCache

# Prompt rows whose logits exist at once for prompt logprobs ([rows, vocab] float32).
PROMPT_LOGITS_ROWS = 256


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None  # the verifier's and sampler's draws
    draft_generator: torch.Generator | None  # sampled drafts' draws (an independent stream)
    block_ids: list[int] = field(default_factory=list)
    # The distributions the pending drafts were drawn from ([k, vocab]; for a tree, the root's
    # row then one per node: [n + 1, vocab]); None: argmax drafts.
    draft_probs: torch.Tensor | None = None
    eos_token_id: int | None = None

    def token_at(self, position: int) -> int:
        if position < len(self.prompt_token_ids):
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - len(self.prompt_token_ids)]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: PagedKVCache,
        device: torch.device,
        proposer: Proposer | None = None,
        aux_hidden_layers: tuple[int, ...] = (),
        sampler_backend: str = "auto",
        state: ParallelState | None = None,
        compile_options: CompileOptions | None = None,
        state_cache: RecurrentStateCache | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.model = model
        self.state_cache = state_cache  # recurrent layers' per-request states, if any
        self.state = state or ParallelState.single(device)
        self.kv_cache = kv_cache
        self.device = device
        self.proposer = proposer
        self.aux_hidden_layers = aux_hidden_layers
        self.vocab_size = int(model.config.vocab_size)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler, backend=sampler_backend)
        self.tree_sampler = TreeRejectionSampler(self.sampler)
        # The target's attention layers: an accepted tree path's KV moves in these only
        # (a draft head's layers are rewritten at the path's final slots by its pass 0).
        self.target_layers = {m.layer_idx for m in model.modules() if isinstance(m, AttentionLayer)}
        self.requests: dict[str, CachedRequestState] = {}
        # Batch invariance: no matrix product of the target runs on one row. CPU BLAS
        # libraries compute a single row (a matrix-vector product) in another summation
        # order than a row of a larger product, so a lone token's logits would differ from
        # the same token's inside a batch or a verification step; with two rows or more
        # each row's result is the same whatever the row count.
        self.min_rows = 2 if batch_invariant else 1
        # Activations from earlier stages carry the aux states of the layers they ran.
        start = getattr(getattr(model, "model", None), "start_layer", 0)
        self.num_aux_from_earlier_stages = len({i for i in aux_hidden_layers if i < start})
        # The target's forward over rows (input_ids, positions[, hidden, residual, *aux]),
        # compiled per token-count bucket when asked.
        self.target_forward = self._target_rows
        if compile_options is not None:
            self.target_forward = CompiledForward(
                self._target_rows, compile_options, device, "target"
            )
        # Cumulative timings (the pipeline benchmark's stage idle fraction).
        self.num_steps = 0
        self.step_s = 0.0
        self.recv_wait_s = 0.0
        self.send_wait_s = 0.0

    def _target_rows(
        self, input_ids: torch.Tensor, positions: torch.Tensor, *stage_rows: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]] | StageActivations:
        intermediate = None
        if stage_rows:  # [num_tokens, hidden] each: hidden, residual, *aux of earlier stages
            hidden, residual, *aux = stage_rows
            intermediate = StageActivations(hidden, residual, list(aux))
        return self.model(input_ids, positions, self.aux_hidden_layers, intermediate)

    def _run_target(self, *rows: torch.Tensor) -> Any:
        """The target's forward over rows of at least `min_rows` (padding rows attend to
        nothing, write no KV and are cut off)."""
        n = rows[0].shape[0]
        if n >= self.min_rows:
            return self.target_forward(*rows)
        padded = tuple(pad_rows(x, self.min_rows) for x in rows)
        return cut_rows(self.target_forward(*padded), n)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, vocab] float32 logits of `hidden` ([n, hidden]), on at least `min_rows` rows."""
        n = hidden.shape[0]
        if n >= self.min_rows:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(pad_rows(hidden, self.min_rows))[:n]

    def warm_up(self) -> float:
        """Compile every bucket of the target's and the draft's forward now; returns the
        seconds it took (0 when nothing is compiled)."""
        seconds = 0.0
        if isinstance(self.target_forward, CompiledForward):
            hidden = int(self.model.config.hidden_size)
            num_stage_rows = (
                0 if self.state.is_first_stage else 2 + self.num_aux_from_earlier_stages
            )
            seconds += self.target_forward.warm_up([hidden] * num_stage_rows, self.kv_cache.dtype)
        if self.proposer is not None:
            seconds += self.proposer.warm_up()
        return seconds

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.freed_req_ids:
            self.requests.pop(req_id, None)
            if self.state_cache is not None:
                self.state_cache.remove(req_id)
        for new in so.new_requests:
            self.requests[new.req_id] = self._new_state(new)
            if self.state_cache is not None:
                self.state_cache.add(new.req_id)
        for item in so.scheduled:
            self.requests[item.req_id].block_ids.extend(item.new_block_ids)

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        params = new.sampling_params
        generator = draft_generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
            draft_generator = torch.Generator(device=self.device)
            draft_generator.manual_seed(draft_seed(params.seed))
        return CachedRequestState(
            new.req_id,
            list(new.prompt_token_ids),
            list(new.output_token_ids),
            params,
            generator,
            draft_generator,
            eos_token_id=new.eos_token_id,
        )

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        try:
            return self._execute(so)
        finally:
            self.num_steps += 1
            self.step_s += time.perf_counter() - start

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        self.kv_cache.copy_slots(so.kv_copies, self.target_layers)
        if not so.scheduled:
            return ModelRunnerOutput(so.step_id, [], [])
        block_tables = {s.req_id: self.requests[s.req_id].block_ids for s in so.scheduled}
        inputs = prepare_inputs(so.scheduled, block_tables, self.kv_cache.block_size, self.device)
        inputs.meta.kv_cache = self.kv_cache
        step_states = None
        if self.state_cache is not None:
            step_states = inputs.meta.recurrent = self.state_cache.begin_step(so.scheduled)
        stage_rows: list[torch.Tensor] = []
        if not self.state.is_first_stage:
            wait_start = time.perf_counter()
            intermediate = StageActivations.recv_from_previous_stage(
                self.state,
                num_tokens=int(inputs.input_ids.shape[0]),
                hidden_size=int(self.model.config.hidden_size),
                num_aux=self.num_aux_from_earlier_stages,
                dtype=self.kv_cache.dtype,
            )
            self.recv_wait_s += time.perf_counter() - wait_start
            stage_rows = [intermediate.hidden, intermediate.residual, *intermediate.aux]
        with attention_context(inputs.meta):
            out = self._run_target(inputs.input_ids, inputs.meta.positions, *stage_rows)
        if step_states is not None:
            self.state_cache.end_step(step_states)
        if not self.state.is_last_stage:
            send_start = time.perf_counter()
            out.send_to_next_stage(self.state)
            self.send_wait_s += time.perf_counter() - send_start
            return ModelRunnerOutput(so.step_id, [], [])
        if self.aux_hidden_layers:
            hidden, aux = out
            features = torch.cat(aux, dim=-1)  # [num_tokens, 3 * hidden] for EAGLE-3
        else:
            hidden = features = out  # [num_tokens, hidden]
        prompt_logprobs = self._prompt_logprobs(hidden, so.scheduled)
        if any(s.spec_parents is not None for s in inputs.sampled):
            sampled_ids, logprobs, paths = self._sample_trees(hidden, inputs)
        else:
            (sampled_ids, logprobs), paths = self._sample(hidden, inputs), {}
        per_request = dict(zip((s.req_id for s in inputs.sampled), sampled_ids, strict=True))
        for req_id, tokens in per_request.items():
            self.requests[req_id].output_token_ids.extend(tokens)
        drafts, parents = self._propose(so, inputs, per_request, features, paths)
        return ModelRunnerOutput(
            step_id=so.step_id,
            req_ids=[s.req_id for s in so.scheduled],
            sampled_token_ids=[per_request.get(s.req_id, []) for s in so.scheduled],
            logprobs=logprobs,
            draft_token_ids=drafts,
            prompt_logprobs=prompt_logprobs,
            draft_parents=parents,
            accepted_nodes=paths,
        )

    def _prompt_logprobs(
        self, hidden: torch.Tensor, scheduled: list[ScheduledRequest]
    ) -> dict[str, PromptLogprobs]:
        """For requests that asked: the logprobs of the prompt tokens that this step's rows
        predict (row p predicts prompt token p + 1), from the raw logits."""
        result: dict[str, PromptLogprobs] = {}
        row = 0  # the request's first row in `hidden` ([num_tokens, hidden])
        for item in scheduled:
            state = self.requests[item.req_id]
            num_top = state.sampling_params.prompt_logprobs
            first = item.num_computed_tokens
            end = min(first + len(item.token_ids), len(state.prompt_token_ids) - 1)
            if num_top is not None and end > first:
                tokens: list[TokenLogprobs] = []
                for lo in range(first, end, PROMPT_LOGITS_ROWS):
                    hi = min(lo + PROMPT_LOGITS_ROWS, end)
                    rows = hidden[row + lo - first : row + hi - first]
                    logits = self._logits(rows)  # [hi - lo, vocab]
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

    def _sample(
        self, hidden: torch.Tensor, inputs: ModelInputs
    ) -> tuple[list[list[int]], dict[str, list[TokenLogprobs]]]:
        if not inputs.sampled:
            return [], {}
        logits = self._logits(hidden[inputs.logits_indices])  # [num_logits, vocab]
        states = [self.requests[s.req_id] for s in inputs.sampled]
        metadata = self._sampling_metadata(states)
        if any(s.num_spec_tokens for s in inputs.sampled):
            drafts = [s.token_ids[len(s.token_ids) - s.num_spec_tokens :] for s in inputs.sampled]
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
        sampled = [row[:n] for row, n in zip(rows, counts, strict=True)]
        return sampled, _logprobs_by_request(lp, states, counts)

    def _sample_trees(
        self, hidden: torch.Tensor, inputs: ModelInputs
    ) -> tuple[list[list[int]], dict[str, list[TokenLogprobs]], dict[str, list[int]]]:
        """Verify each sampled request's draft tree (a chain or no drafts are trees too):
        (tokens per request, logprobs, the accepted nodes of requests that had drafts)."""
        logits = self._logits(hidden[inputs.logits_indices])  # [rows, vocab]
        states = [self.requests[s.req_id] for s in inputs.sampled]
        metadata = self._sampling_metadata(states)
        trees = []
        for item in inputs.sampled:
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
        sampled = [row[:n] for row, n in zip(rows, counts, strict=True)]
        paths = {
            item.req_id: path
            for item, path in zip(inputs.sampled, out.accepted_nodes, strict=True)
            if item.num_spec_tokens
        }
        return sampled, _logprobs_by_request(out.logprobs, states, counts), paths

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

    def _propose(
        self,
        so: SchedulerOutput,
        inputs: ModelInputs,
        sampled: dict[str, list[int]],
        features: torch.Tensor,
        paths: dict[str, list[int]],
    ) -> tuple[list[list[int]], list[list[int] | None]]:
        """The next drafts (and their parents, for trees). A request verified against a
        tree has its accepted path's rows brought right after its root first, so the
        proposer sees the accepted tokens as a chain (their KV slots are already the
        chain's: `slot_mapping` stays as it is)."""
        if self.proposer is None:
            return [], []
        scheduled = so.scheduled
        input_ids, positions = inputs.input_ids, inputs.meta.positions
        if paths:
            order = _accepted_first(scheduled, inputs.meta.query_start_loc, paths)
            index = torch.tensor(order, device=self.device)
            input_ids, positions, features = input_ids[index], positions[index], features[index]
        num_valid, next_ids = [], []
        for item in scheduled:
            state = self.requests[item.req_id]
            n = len(item.token_ids)
            if item.req_id in sampled:
                tokens = sampled[item.req_id]
                num_valid.append(n - (item.num_spec_tokens - (len(tokens) - 1)))
                next_ids.append(tokens[-1])
            else:  # a partial prompt: the next prompt token follows the chunk
                num_valid.append(n)
                next_ids.append(state.token_at(item.num_computed_tokens + n))
        states = [self.requests[s.req_id] for s in scheduled]
        meta = inputs.meta
        batch = ProposalBatch(
            query_start_loc=meta.query_start_loc,
            num_computed=[s.num_computed_tokens for s in scheduled],
            num_valid=num_valid,
            next_token_ids=next_ids,
            sampled=[s.req_id in sampled for s in scheduled],
            params=[st.sampling_params for st in states],
            draft_generators={
                i: st.draft_generator for i, st in enumerate(states) if st.draft_generator
            },
            token_history=(
                [st.prompt_token_ids + st.output_token_ids for st in states]
                if self.proposer.needs_token_history
                else []
            ),
            input_ids=input_ids,
            positions=positions,
            slot_mapping=meta.slot_mapping,
            block_tables=meta.block_tables,
            num_blocks=[len(st.block_ids) for st in states],
            target_hidden=features,
            num_drafts=so.num_drafts,
            req_ids=[s.req_id for s in scheduled],
            freed_req_ids=list(so.freed_req_ids),
        )
        proposal = self.proposer.propose(batch)
        for st, probs in zip(states, proposal.probs, strict=True):
            st.draft_probs = probs
        parents = proposal.parents or [None] * len(proposal.token_ids)
        return proposal.token_ids, parents


def _accepted_first(
    scheduled: list[ScheduledRequest], query_start_loc: list[int], paths: dict[str, list[int]]
) -> list[int]:
    """A permutation of the step's rows: each tree request's rows up to its root, its
    accepted nodes' rows in path order, then its other nodes' rows."""
    order: list[int] = []
    for item, start in zip(scheduled, query_start_loc, strict=False):
        n = len(item.token_ids)
        path = paths.get(item.req_id)
        if path is None:
            order.extend(range(start, start + n))
            continue
        root = start + n - 1 - item.num_spec_tokens
        accepted = [root + 1 + node for node in path]
        rest = [r for r in range(root + 1, start + n) if r not in set(accepted)]
        order.extend([*range(start, root + 1), *accepted, *rest])
    return order


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
