"""Per-replica engine metrics through `ray.util.metrics` (exported to Prometheus by Ray's
metrics agent), plus the same numbers as a plain snapshot for `LLMServer.stats()`.

Requests, prompt and generated tokens, time to first token, time per output token, the
scheduler's queue and KV usage, and speculative decoding's acceptance, in total and per
draft position. The speculative numbers are the engine's own `SpecDecodingStats` (one
definition, vLLM's), which the scheduler actor reports after every step; the counters
here advance by the difference.
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import Any

from ray.util import metrics

from cluster.actors.wire import OutputBatch
from cluster.engine.metrics import SpecDecodingStats

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class ServerMetrics:
    def __init__(self, model_id: str) -> None:
        tags = {"model": model_id}

        def counter(name: str, doc: str, *keys: str) -> metrics.Counter:
            m = metrics.Counter(name, description=doc, tag_keys=("model", *keys))
            m.set_default_tags(tags)
            return m

        def gauge(name: str, doc: str) -> metrics.Gauge:
            m = metrics.Gauge(name, description=doc, tag_keys=("model",))
            m.set_default_tags(tags)
            return m

        def histogram(name: str, doc: str) -> metrics.Histogram:
            m = metrics.Histogram(
                name, description=doc, boundaries=_LATENCY_BUCKETS, tag_keys=("model",)
            )
            m.set_default_tags(tags)
            return m

        self._requests = counter("cluster_requests_total", "finished requests", "finish_reason")
        self._prompt_tokens = counter("cluster_prompt_tokens_total", "prompt tokens")
        self._generation_tokens = counter("cluster_generation_tokens_total", "generated tokens")
        self._ttft = histogram("cluster_time_to_first_token_seconds", "time to first token")
        self._tpot = histogram("cluster_time_per_output_token_seconds", "time per output token")
        self._waiting = gauge("cluster_num_requests_waiting", "requests waiting for admission")
        self._running = gauge("cluster_num_requests_running", "requests being computed")
        self._kv_usage = gauge("cluster_kv_cache_usage", "fraction of KV blocks in use")
        self._prefix_queries = counter(
            "cluster_prefix_cache_queries_total", "prompt tokens looked up in the prefix cache"
        )
        self._prefix_hits = counter(
            "cluster_prefix_cache_hits_total", "prompt tokens found in the prefix cache"
        )
        self._prefix_seen = (0, 0)
        self._drafts = counter("cluster_spec_decode_num_drafts_total", "steps with drafts")
        self._draft_tokens = counter("cluster_spec_decode_draft_tokens_total", "drafts verified")
        self._accepted = counter(
            "cluster_spec_decode_accepted_tokens_total", "drafts accepted, by position", "position"
        )
        self._acceptance = gauge("cluster_spec_decode_acceptance_rate", "accepted / drafted")
        self.totals: Tally[str] = Tally()
        self.spec = SpecDecodingStats()

    def observe_batch(self, batch: OutputBatch) -> None:
        """The scheduler's state after one engine step."""
        self._waiting.set(batch.stats.num_waiting)
        self._running.set(batch.stats.num_running)
        self._kv_usage.set(batch.stats.kv_usage)
        queries, hits = batch.stats.prefix_cache_queries, batch.stats.prefix_cache_hits
        if queries > self._prefix_seen[0]:
            self._prefix_queries.inc(queries - self._prefix_seen[0])
            if hits > self._prefix_seen[1]:
                self._prefix_hits.inc(hits - self._prefix_seen[1])
            self._prefix_seen = (queries, hits)
        if batch.stats.spec:
            self._observe_spec(SpecDecodingStats(**batch.stats.spec))

    def _observe_spec(self, now: SpecDecodingStats) -> None:
        before, self.spec = self.spec, now
        if now.num_drafts > before.num_drafts:
            self._drafts.inc(now.num_drafts - before.num_drafts)
            self._draft_tokens.inc(now.num_draft_tokens - before.num_draft_tokens)
            self._acceptance.set(now.num_accepted_tokens / max(1, now.num_draft_tokens))
        for position, accepted in enumerate(now.accepted_per_position):
            old = before.accepted_per_position[position : position + 1] or [0]
            if accepted > old[0]:
                self._accepted.inc(accepted - old[0], {"position": str(position)})

    def request_finished(
        self,
        finish_reason: str,
        num_prompt_tokens: int,
        num_output_tokens: int,
        ttft_s: float | None,
        tpot_s: float | None,
    ) -> None:
        self._requests.inc(1, {"finish_reason": finish_reason})
        self.totals[f"requests_{finish_reason}"] += 1
        if num_prompt_tokens:
            self._prompt_tokens.inc(num_prompt_tokens)
            self.totals["prompt_tokens"] += num_prompt_tokens
        if num_output_tokens:
            self._generation_tokens.inc(num_output_tokens)
            self.totals["generation_tokens"] += num_output_tokens
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        if tpot_s is not None:
            self._tpot.observe(tpot_s)

    def snapshot(self) -> dict[str, Any]:
        return {**self.totals, "spec_decode": self.spec.as_dict()}
