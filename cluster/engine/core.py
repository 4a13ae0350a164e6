"""`EngineCore`: the scheduler and KV accounting driving an executor, one step at a time.

No tokenizer, no text: token ids in, token ids out. The Ray scheduler actor hosts this
same object; the offline and async engines host it in-process.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass

from cluster.config import EngineConfig
from cluster.engine.block_manager import KVBlockManager
from cluster.engine.executor import Executor, PendingOutput
from cluster.engine.grammar import GrammarCompiler
from cluster.engine.messages import EngineCoreOutput, SchedulerOutput
from cluster.engine.request import Request
from cluster.engine.scheduler import Scheduler
from cluster.engine.spec_controller import SpecController
from cluster.engine.stats import EngineStats

logger = logging.getLogger(__name__)


@dataclass
class _Batch:
    """A submitted step: what was scheduled, its pending result, and (for adaptive
    speculation) the batch size that chose its draft count and when it started."""

    scheduler_output: SchedulerOutput
    pending: PendingOutput
    batch_size: int
    started: float


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        num_blocks = config.cache.num_kv_blocks or executor.available_kv_blocks()
        max_len = config.model.resolved_max_model_len
        if num_blocks * config.cache.block_size < max_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {config.cache.block_size} tokens, "
                f"fewer than one sequence of max_model_len={max_len} needs; raise "
                "cache.num_kv_blocks, cpu_kv_cache_gib or gpu_memory_utilization, or lower max_model_len"
            )
        executor.initialize_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, config.cache.block_size)
        if config.cache.enable_prefix_caching and not config.prefix_caching:
            logger.info("prefix caching is off: the target has recurrent layers")
        self.block_manager = KVBlockManager(
            num_blocks, config.cache.block_size, config.prefix_caching
        )
        spec = config.speculative
        # Drafts that run their own passes (all but n-gram) write KV ahead of the step.
        lookahead = 0
        if spec is not None and spec.draft_method.kv_cache != "none":
            lookahead = spec.num_speculative_tokens
            if spec.tree is not None:  # scratch slots for the nodes fed while growing trees
                lookahead = max(lookahead, spec.tree.num_fed(lookahead) + 1)
        # One batch in flight per pipeline stage keeps every stage busy.
        self.max_concurrent_batches = config.parallel.pipeline_parallel_size
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, max_len, lookahead, self.max_concurrent_batches
        )
        self._in_flight: deque[_Batch] = deque()
        self.num_steps = 0
        self.last_step_s = 0.0
        self.spec_controller: SpecController | None = None
        if spec is not None and spec.adaptive:
            self.spec_controller = SpecController(spec.num_speculative_tokens)

        self.grammars = GrammarCompiler(config.model)

    def add_request(self, request: Request) -> None:
        spec = request.sampling_params.structured_outputs
        if spec is not None:
            params = request.sampling_params
            stops = list(params.stop_token_ids)
            if request.eos_token_id is not None and not params.ignore_eos:
                stops.insert(0, request.eos_token_id)
            request.grammar = self.grammars.request_grammar(spec, stops)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(request_ids)

    def finish_by_stop_string(self, request_id: str, stop: str) -> None:
        self.scheduler.finish_by_stop_string(request_id, stop)

    def stats(self) -> EngineStats:
        """The engine's state and counters now."""
        scheduler, blocks = self.scheduler, self.block_manager
        return EngineStats(
            num_waiting=scheduler.num_waiting,
            num_running=scheduler.num_running,
            kv_usage=blocks.usage,
            prefix_cache_queries=blocks.prefix_stats.num_queried_tokens,
            prefix_cache_hits=blocks.prefix_stats.num_hit_tokens,
            num_preemptions=scheduler.num_preemptions,
            num_steps=self.num_steps,
            last_step_s=self.last_step_s,
            spec=asdict(scheduler.spec_stats),
        )

    def get_metrics(self) -> dict[str, object]:
        """Speculative-decoding statistics, scheduler counters, prefix cache hits (prompt
        tokens looked up at admission and found cached)."""
        stats = self.stats()
        return {
            **self.scheduler.spec_stats.as_dict(),
            "num_preemptions": stats.num_preemptions,
            "kv_cache_usage": stats.kv_usage,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            **(
                {"adaptive_speculation": self.spec_controller.summary()}
                if self.spec_controller is not None
                else {}
            ),
        }

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule a batch and submit it, then finish the oldest batch in flight. With
        pipeline stages, batches are submitted until one per stage is in flight (returning
        nothing meanwhile); with one stage every step schedules, runs and finishes a batch."""
        started = time.perf_counter()
        try:
            return self._step()
        finally:
            self.num_steps += 1
            self.last_step_s = time.perf_counter() - started

    def _step(self) -> list[EngineCoreOutput]:
        submitted = False
        if len(self._in_flight) < self.max_concurrent_batches:
            start = time.perf_counter()
            batch_size, num_drafts = self._num_drafts()
            scheduler_output = self.scheduler.schedule(num_drafts)
            if scheduler_output.scheduled or scheduler_output.freed_req_ids:
                pending = self.executor.submit_model(scheduler_output)
                self._in_flight.append(_Batch(scheduler_output, pending, batch_size, start))
                submitted = bool(scheduler_output.scheduled)
        if not self._in_flight or (
            submitted and len(self._in_flight) < self.max_concurrent_batches
        ):
            return []
        batch = self._in_flight.popleft()
        outputs = self.scheduler.update_from_output(batch.scheduler_output, batch.pending())
        self._observe(batch, outputs)
        return outputs

    def _num_drafts(self) -> tuple[int, int | None]:
        """(the batch size deciding it, drafts for the coming step); None: not adaptive."""
        if self.spec_controller is None:
            return 0, None
        batch_size = max(1, self.scheduler.num_running)
        return batch_size, self.spec_controller.num_drafts(batch_size)

    def _observe(self, batch: _Batch, outputs: list[EngineCoreOutput]) -> None:
        """Feed the controller steps that only decode and verify (a prefill chunk's cost
        says nothing about drafting). Only with one stage: adaptive needs PP=1."""
        scheduler_output = batch.scheduler_output
        controller, num_drafts = self.spec_controller, scheduler_output.num_drafts
        if controller is None or num_drafts is None:
            return
        if not all(
            s.sample and len(s.token_ids) == 1 + s.num_spec_tokens
            for s in scheduler_output.scheduled
        ):
            return
        num_tokens = sum(len(o.new_token_ids) for o in outputs)
        seconds = time.perf_counter() - batch.started
        controller.observe(batch.batch_size, num_drafts, num_tokens, seconds)

    def shutdown(self) -> None:
        self.executor.shutdown()
