"""`ModelRunner`: one step on one worker: inputs, target forward, sampling, verification,
and the next step's drafts.

The runner keeps a small per-request state (prompt and output ids for `min_tokens` and
n-gram lookup, the request's generator, the distributions its pending drafts were
sampled from), the running requests' block tables (`InputBatch`: a step writes only the
blocks it appends) and, in its verifier, the penalised requests' token statistics
(`PenaltyTables`); the scheduler output updates them every step. Every TP rank
samples the same tokens (same logits, same generators) and proposes the same drafts, so
all ranks agree; only one of them reports. With pipeline stages, a stage that is not the
last runs its layers and hands the activations on; sampling and drafting happen on the
last stage, and the next step's token ids reach every stage from the scheduler.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cluster.engine.messages import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from cluster.models.attention import AttentionLayer, attention_context
from cluster.models.compiled import CompiledForward, CompileOptions, cut_rows, pad_rows
from cluster.parallel import ParallelState
from cluster.parallel.pipeline import StageActivations
from cluster.spec_decode.batch import ProposalBatch, Proposer
from cluster.worker.input_batch import InputBatch, ModelInputs
from cluster.worker.kv_cache import PagedKVCache
from cluster.worker.request_state import CachedRequestState
from cluster.worker.state_cache import RecurrentStateCache
from cluster.worker.verifier import Verified, Verifier

logger = logging.getLogger(__name__)

# capture_features' sink: (the step's scheduled requests, [num_tokens, F] feature rows)
FeatureSink = Callable[[list[ScheduledRequest], torch.Tensor], None]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: PagedKVCache,
        device: torch.device,
        proposer: Proposer | None = None,
        aux_hidden_layers: tuple[int, ...] = (),
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
        self.feature_sink: FeatureSink | None = None  # `capture_features`
        self.verifier = Verifier(int(model.config.vocab_size), device)
        # The target's attention layers: an accepted tree path's KV moves in these only
        # (a draft head's layers are rewritten at the path's final slots by its pass 0).
        self.target_layers = {m.layer_idx for m in model.modules() if isinstance(m, AttentionLayer)}
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(kv_cache.block_size, device)
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
        # Compile on a thread while the engine serves eagerly (see `warm_up`).
        self.compile_in_background = compile_options is not None and compile_options.background
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

    def _on_min_rows(self, fn: Callable[..., Any], *rows: torch.Tensor) -> Any:
        """`fn` (the target's forward, or its logits) over rows padded to at least
        `min_rows` (padding rows attend to nothing, write no KV and are cut off)."""
        n = rows[0].shape[0]
        if n >= self.min_rows:
            return fn(*rows)
        return cut_rows(fn(*(pad_rows(x, self.min_rows) for x in rows)), n)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, vocab] float32 logits of `hidden` ([n, hidden])."""
        return self._on_min_rows(self.model.compute_logits, hidden)

    def warm_up(self) -> float:
        """Compile every bucket of the target's and the draft's forward now; returns the
        seconds it took (0 when nothing is compiled).

        With `CompileOptions.background` (every forward built with it): compile on a thread
        and return 0 at once; each forward runs eagerly until its graphs exist. The compiled
        rows of a batch-invariant engine equal the eager ones, so the answers do not change
        when the graphs take over. Only for a single rank: the warm-up forwards of a
        tensor- or pipeline-parallel rank run collectives, which must not interleave with
        the steps'."""
        if not self.compile_in_background:
            return self._warm_up()

        def compile_all() -> None:
            try:
                logger.info("compiled the forwards in the background in %.1f s", self._warm_up())
            except Exception:  # the forwards stay eager (each forward's warm_up ends it)
                logger.exception("compiling the forwards in the background failed")

        threading.Thread(target=compile_all, name="cluster-compile", daemon=True).start()
        return 0.0

    def _warm_up(self) -> float:
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
            self.input_batch.remove(req_id)
            self.verifier.penalties.remove(req_id)
            if self.state_cache is not None:
                self.state_cache.remove(req_id)
        for new in so.new_requests:
            self.requests[new.req_id] = CachedRequestState.of(new, self.device)
            self.input_batch.add(new.req_id)
            self.verifier.penalties.add(
                new.req_id, new.sampling_params, new.prompt_token_ids, new.output_token_ids
            )
            if self.state_cache is not None:
                self.state_cache.add(new.req_id)
        for item in so.scheduled:
            self.input_batch.append_blocks(item.req_id, item.new_block_ids)

    def capture_features(self, layers: tuple[int, ...], sink: FeatureSink | None) -> None:
        """Hand every step's draft-head features to `sink` (None: stop): the scheduled
        requests and [num_tokens, (len(layers) + 1) * hidden] rows, the residual streams
        entering `layers` then the final hidden state, what EAGLE-3 (`layers`) or EAGLE-1
        and MTP (`()`) heads are fed. For an eager single-stage engine whose draft (if
        any) reads the same layers: a compiled graph's outputs are fixed when it compiles."""
        if self.proposer is not None and sink is not None and layers != self.aux_hidden_layers:
            raise ValueError(
                f"this engine's draft reads layers {self.aux_hidden_layers}, not {layers}"
            )
        self.aux_hidden_layers = layers
        self.feature_sink = sink

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
        inputs = self.input_batch.prepare(so.scheduled)
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
            out = self._on_min_rows(
                self.target_forward, inputs.input_ids, inputs.meta.positions, *stage_rows
            )
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
        if self.feature_sink is not None:
            captured = torch.cat([features, hidden], -1) if self.aux_hidden_layers else hidden
            self.feature_sink(so.scheduled, captured)
        prompt_logprobs = self.verifier.prompt_logprobs(
            self._logits, hidden, so.scheduled, self.requests
        )
        verified = self._verify(hidden, inputs)
        per_request = dict(zip((s.req_id for s in inputs.sampled), verified.tokens, strict=True))
        for req_id, tokens in per_request.items():
            self.requests[req_id].output_token_ids.extend(tokens)
        drafts, parents = self._propose(so, inputs, per_request, features, verified.paths)
        return ModelRunnerOutput(
            step_id=so.step_id,
            req_ids=[s.req_id for s in so.scheduled],
            sampled_token_ids=[per_request.get(s.req_id, []) for s in so.scheduled],
            logprobs=verified.logprobs,
            draft_token_ids=drafts,
            prompt_logprobs=prompt_logprobs,
            draft_parents=parents,
            accepted_nodes=verified.paths,
        )

    def _verify(self, hidden: torch.Tensor, inputs: ModelInputs) -> Verified:
        if not inputs.sampled:
            return Verified([], {}, {})
        logits = self._logits(hidden[inputs.logits_indices])  # [num_logits, vocab]
        states = [self.requests[s.req_id] for s in inputs.sampled]
        return self.verifier.verify(logits, inputs.sampled, states)

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
            num_blocks=[self.input_batch.blocks_of(s.req_id) for s in scheduled],
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
