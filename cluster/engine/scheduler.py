"""The token-budget scheduler: no prefill or decode phases, only tokens to compute.

Every request has `num_computed_tokens` and `num_tokens_with_spec` (prompt + output +
draft tokens). Each step hands out at most `max_num_batched_tokens` tokens so computed
catches up with that: running requests first (decode tokens, drafts, the rest of a
chunked prompt), then waiting requests in arrival order (FCFS) while sequences and
KV blocks last; a request admitted starts after the whole blocks of its tokens that the
prefix cache holds (`KVBlockManager.cached_prefix`). When blocks run out, the most
recently admitted running request is preempted: its blocks are freed and it is
recomputed later (from its cached prefix, if that survived).

With pipeline stages several batches are in flight at once (`max_concurrent_batches`):
a request in flight is not scheduled again, nor preempted, until its output is back,
and the requests are split evenly between the batches.
"""

from __future__ import annotations

from collections import deque

from cluster.config import SchedulerConfig
from cluster.draft_tree import DraftTree
from cluster.engine.block_manager import KVBlockManager
from cluster.engine.messages import (
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from cluster.engine.metrics import SpecDecodingStats
from cluster.engine.request import FinishReason, Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: KVBlockManager,
        max_model_len: int,
        num_lookahead_tokens: int = 0,
        max_concurrent_batches: int = 1,
    ) -> None:
        self.config = config
        self.blocks = block_manager
        self.max_model_len = max_model_len
        # KV slots reserved past a step's tokens for the draft's own passes.
        self.num_lookahead_tokens = num_lookahead_tokens
        # Pipeline stages keep several batches in flight; a request is in at most one.
        self.max_concurrent_batches = max_concurrent_batches
        self._in_flight: set[str] = set()
        self.spec_stats = SpecDecodingStats()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._freed: list[str] = []  # to tell the workers at the next step
        self._kv_copies: list[list[int]] = []  # accepted tree paths to move, next step
        self._known_to_workers: set[str] = set()
        self._step_id = 0
        self.num_preemptions = 0  # total, for metrics and tests
        self._preempted_this_step = False

    # ---- requests in and out -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outputs = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            request.finish(FinishReason.ABORT)
            self._release(request)
            outputs.append(EngineCoreOutput(req_id, [], finish_reason=FinishReason.ABORT.value))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def step_id(self) -> int:
        """The latest `SchedulerOutput`'s id: how many batches were scheduled so far."""
        return self._step_id

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _release(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.request_id)
        del self.requests[request.request_id]
        if request.request_id in self._known_to_workers:
            self._known_to_workers.discard(request.request_id)
            self._freed.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.set_drafts([])
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_this_step = True
        self.waiting.appendleft(request)
        if request.request_id in self._known_to_workers:
            self._known_to_workers.discard(request.request_id)
            self._freed.append(request.request_id)

    # ---- one step --------------------------------------------------------------------
    def schedule(self, num_drafts: int | None = None) -> SchedulerOutput:
        """The next batch. `num_drafts` (adaptive speculation) caps the drafts verified in
        this step and asks the proposer for that many after it."""
        budget = self.config.max_num_batched_tokens
        max_seqs = self._max_seqs_this_step()
        scheduled: list[ScheduledRequest] = []
        new_requests: list[NewRequestData] = []
        self._preempted_this_step = False

        index = 0
        while index < len(self.running) and budget > 0 and len(scheduled) < max_seqs:
            request = self.running[index]
            if request.request_id in self._in_flight:
                index += 1
                continue
            if num_drafts is not None and len(request.spec_token_ids) > num_drafts:
                self._keep_drafts(request, num_drafts)
            num_new = min(request.num_tokens_with_spec - request.num_computed_tokens, budget)
            num_new = min(num_new, self.max_model_len - request.num_computed_tokens)
            if num_new <= 0:
                index += 1
                continue
            new_blocks = self._allocate_or_preempt(request, num_new)
            if new_blocks is None:  # the request itself was preempted
                break
            scheduled.append(self._scheduled(request, num_new, new_blocks))
            budget -= num_new
            index += 1

        # Admit waiting requests (none in a step that had to preempt).
        while (
            self.waiting
            and budget > 0
            and not self._preempted_this_step
            and len(self.running) < self.config.max_num_seqs
            and len(scheduled) < max_seqs
        ):
            request = self.waiting[0]
            # Whole blocks of its tokens cached by earlier requests are not computed again
            # (unless each prompt position's logprobs are still wanted).
            prefix = []
            if self.blocks.enable_prefix_caching and request.prompt_logprobs is None:
                tokens = request.prompt_token_ids + request.output_token_ids
                prefix = self.blocks.cached_prefix(tokens)
            request.num_computed_tokens = len(prefix) * self.blocks.block_size
            num_new = request.num_tokens - request.num_computed_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                request.num_computed_tokens = 0
                break
            num_new = min(num_new, budget)
            self.blocks.allocate_prefix(request.request_id, prefix)
            new_blocks = self.blocks.allocate(
                request.request_id, self._slots_needed(request, num_new)
            )
            if new_blocks is None:
                self.blocks.free(request.request_id)
                request.num_computed_tokens = 0
                break
            self.blocks.prefix_stats.observe(request.num_tokens, request.num_computed_tokens)
            new_blocks = prefix + new_blocks
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new_requests.append(
                NewRequestData(
                    request.request_id,
                    list(request.prompt_token_ids),
                    list(request.output_token_ids),
                    request.sampling_params,
                    request.eos_token_id,
                )
            )
            self._known_to_workers.add(request.request_id)
            scheduled.append(self._scheduled(request, num_new, new_blocks))
            budget -= num_new

        self._step_id += 1
        freed, self._freed = self._freed, []
        copies, self._kv_copies = self._kv_copies, []
        self._in_flight.update(item.req_id for item in scheduled)
        return SchedulerOutput(self._step_id, new_requests, scheduled, freed, num_drafts, copies)

    def _max_seqs_this_step(self) -> int:
        """With several batches in flight, split the requests evenly between them so no
        pipeline stage waits for a batch that took every request."""
        if self.max_concurrent_batches == 1:
            return self.config.max_num_seqs
        num_requests = len(self.running) + len(self.waiting)
        per_batch = -(-num_requests // self.max_concurrent_batches)
        return max(1, min(self.config.max_num_seqs, per_batch))

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list[int] | None:
        """Blocks for `num_new` more tokens, preempting from the back of `running` as needed
        (never a request in flight). None when `request` itself had to be preempted."""
        while True:
            new_blocks = self.blocks.allocate(
                request.request_id, self._slots_needed(request, num_new)
            )
            if new_blocks is not None:
                return new_blocks
            victim = next(r for r in reversed(self.running) if r.request_id not in self._in_flight)
            self._preempt(victim)
            if victim is request:
                return None

    def _slots_needed(self, request: Request, num_new: int) -> int:
        wanted = request.num_computed_tokens + num_new + self.num_lookahead_tokens
        return min(wanted, self.max_model_len)

    def _scheduled(self, request: Request, num_new: int, new_blocks: list[int]) -> ScheduledRequest:
        start = request.num_computed_tokens
        num_spec = max(0, start + num_new - request.num_tokens)
        if num_spec < len(request.spec_token_ids):  # trimmed by the budget
            self._keep_drafts(request, num_spec)
        sample = start + num_new >= request.num_tokens
        bitmask = None
        if sample and request.grammar is not None:
            bitmask = request.grammar.bitmask(request.spec_token_ids, request.spec_parents)
        return ScheduledRequest(
            req_id=request.request_id,
            token_ids=request.token_ids(start, start + num_new),
            num_computed_tokens=start,
            num_spec_tokens=num_spec,
            new_block_ids=new_blocks,
            sample=sample,
            spec_parents=request.spec_parents if num_spec else None,
            grammar_bitmask=bitmask,
        )

    @staticmethod
    def _keep_drafts(request: Request, count: int) -> None:
        """The first `count` drafts (a tree's first nodes include their ancestors)."""
        parents = request.spec_parents
        request.set_drafts(
            request.spec_token_ids[:count], parents[:count] if parents is not None else None
        )

    # ---- applying the result ---------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        sampled = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True))
        drafts = dict(zip(runner_output.req_ids, runner_output.draft_token_ids, strict=False))
        parents = dict(zip(runner_output.req_ids, runner_output.draft_parents, strict=False))
        for item in scheduler_output.scheduled:
            self._in_flight.discard(item.req_id)
            request = self.requests.get(item.req_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(item.token_ids)
            generated = sampled.get(item.req_id, [])
            num_accepted = 0
            if item.num_spec_tokens:
                num_accepted = max(0, len(generated) - 1)
                # KV of rejected drafts is simply overwritten later.
                request.num_computed_tokens -= item.num_spec_tokens - num_accepted
                depth = None
                if item.spec_parents is not None:
                    depth = DraftTree((0,) * item.num_spec_tokens, tuple(item.spec_parents)).depth
                self.spec_stats.observe(item.num_spec_tokens, num_accepted, depth)
                path = runner_output.accepted_nodes.get(item.req_id)
                if path:
                    root = item.num_computed_tokens + len(item.token_ids) - 1 - item.num_spec_tokens
                    self._move_accepted_path(request, root, path)
            request.set_drafts([])
            new_tokens = request.append_checking_stops(generated, self.max_model_len)
            self.blocks.cache_blocks(request)
            logprobs = runner_output.logprobs.get(item.req_id)
            if logprobs is not None:
                logprobs = logprobs[: len(new_tokens)]
            prompt_logprobs = request.gather_prompt_logprobs(
                runner_output.prompt_logprobs.get(item.req_id), bool(new_tokens)
            )
            if not request.is_finished and drafts.get(item.req_id):
                request.set_limited_drafts(
                    drafts[item.req_id], parents.get(item.req_id), self.max_model_len
                )
            if new_tokens or request.is_finished:
                outputs.append(
                    EngineCoreOutput(
                        item.req_id,
                        new_tokens,
                        logprobs,
                        request.finish_reason.value if request.finish_reason else None,
                        request.stop_reason,
                        item.num_spec_tokens,
                        num_accepted,
                        prompt_logprobs,
                    )
                )
            if request.is_finished:
                self._release(request)
        return outputs

    def _move_accepted_path(self, request: Request, root: int, path: list[int]) -> None:
        """The accepted nodes' KV (at slots root + 1 + node) goes to root + 1 .. root + d,
        where the sequence continues; the copies run on every rank before the next step."""
        table, size = self.blocks.block_tables[request.request_id], self.blocks.block_size

        def slot(position: int) -> int:
            return table[position // size] * size + position % size

        for depth, node in enumerate(path, start=1):
            if node != depth - 1:
                self._kv_copies.append([slot(root + 1 + node), slot(root + depth)])

    def finish_by_stop_string(self, request_id: str, stop: str) -> None:
        """The output processor saw a stop string in the text: end the request."""
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished:
            request.finish(FinishReason.STOP, stop_reason=stop)
            self._release(request)
