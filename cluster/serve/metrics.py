"""Per-replica engine metrics, published two ways, plus a plain snapshot for
`LLMServer.stats()`:

- on the serving port at `/metrics` (prometheus_client, this replica's own registry) with
  vLLM's names and labels (`vllm:time_to_first_token_seconds{model_name=...}`, ...), so
  the Grafana dashboards written for vLLM read them; each replica adds a `replica` label;
- through `ray.util.metrics` as `cluster_*` (Ray's metrics agent exports them as
  `ray_cluster_*`), for the Ray dashboard.

Requests by finish reason, prompt and generated tokens, time to first token, time per
output token, end-to-end latency, the scheduler's queue and KV usage, prefix-cache
lookups, and speculative decoding's drafts and acceptance, in total and per draft
position. The speculative numbers are the engine's own `SpecDecodingStats` (one
definition, vLLM's), which the scheduler actor reports after every step; the counters
here advance by the difference.
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import Any

import prometheus_client as prom
from ray.util import metrics as ray_metrics

from cluster.actors.wire import OutputBatch
from cluster.engine.metrics import SpecDecodingStats

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class _Family:
    """One metric in both sinks: `vllm:<vllm_name>` in Prometheus, `cluster_<ray_name>` in
    Ray; `label` (if any) is the one label a call sets (vLLM's and Ray's spelling)."""

    def __init__(
        self,
        kind: str,
        names: tuple[str, str],  # (vLLM's name, our Ray name), without prefixes
        doc: str,
        registry: prom.CollectorRegistry,
        common: dict[str, str],
        label: tuple[str, str] | None = None,  # (vLLM's label name, Ray's)
    ) -> None:
        vllm_name, ray_name = names
        self.label = label
        prom_labels = [*common, *(label[:1] if label else ())]
        ray_labels = ("model", *(label[1:] if label else ()))
        prom_kind, ray_kind = {
            "counter": (prom.Counter, ray_metrics.Counter),
            "gauge": (prom.Gauge, ray_metrics.Gauge),
            "histogram": (prom.Histogram, ray_metrics.Histogram),
        }[kind]
        histogram = kind == "histogram"
        prom_buckets = {"buckets": _LATENCY_BUCKETS} if histogram else {}
        ray_buckets = {"boundaries": _LATENCY_BUCKETS} if histogram else {}
        self._prom = prom_kind(
            f"vllm:{vllm_name}", doc, prom_labels, registry=registry, **prom_buckets
        )
        self._ray = ray_kind(
            f"cluster_{ray_name}", description=doc, tag_keys=ray_labels, **ray_buckets
        )
        self._ray.set_default_tags({"model": common["model_name"]})
        self._common = common

    def _both(self, value: str | None) -> tuple[Any, dict[str, str] | None]:
        if self.label is None:
            return self._prom.labels(**self._common), None
        prom_metric = self._prom.labels(**self._common, **{self.label[0]: value})
        return prom_metric, {self.label[1]: str(value)}

    def inc(self, amount: float, value: str | None = None) -> None:
        prom_metric, tags = self._both(value)
        prom_metric.inc(amount)
        self._ray.inc(amount, tags)

    def set(self, amount: float) -> None:
        prom_metric, _ = self._both(None)
        prom_metric.set(amount)
        self._ray.set(amount)

    def observe(self, amount: float) -> None:
        prom_metric, _ = self._both(None)
        prom_metric.observe(amount)
        self._ray.observe(amount)


class ServerMetrics:
    def __init__(self, model_id: str, replica: str = "") -> None:
        self.registry = prom.CollectorRegistry()
        common = {"model_name": model_id, "replica": replica}

        def family(kind: str, names: tuple[str, str], doc: str, **kw: Any) -> _Family:
            return _Family(kind, names, doc, self.registry, common, **kw)

        self._requests = family(
            "counter", ("request_success", "requests"), "finished requests",
            label=("finished_reason", "finish_reason"),
        )  # fmt: skip
        self._prompt_tokens = family("counter", ("prompt_tokens", "prompt_tokens"), "prompt tokens")
        self._generation_tokens = family(
            "counter", ("generation_tokens", "generation_tokens"), "generated tokens"
        )
        self._ttft = family(
            "histogram", ("time_to_first_token_seconds",) * 2, "time to first token"
        )
        self._tpot = family(
            "histogram",
            ("request_time_per_output_token_seconds", "time_per_output_token_seconds"),
            "a request's mean time per output token after the first",
        )
        self._e2e = family(
            "histogram", ("e2e_request_latency_seconds",) * 2, "arrival to last token"
        )
        self._waiting = family(
            "gauge", ("num_requests_waiting",) * 2, "requests waiting for admission"
        )
        self._running = family("gauge", ("num_requests_running",) * 2, "requests being computed")
        self._kv_usage = family(
            "gauge", ("kv_cache_usage_perc", "kv_cache_usage"), "fraction of KV blocks in use"
        )
        self._prefix_queries = family(
            "counter", ("prefix_cache_queries",) * 2, "prompt tokens looked up in the prefix cache"
        )
        self._prefix_hits = family(
            "counter", ("prefix_cache_hits",) * 2, "prompt tokens found in the prefix cache"
        )
        self._prefix_seen = (0, 0)
        self._drafts = family(
            "counter", ("spec_decode_num_drafts", "spec_decode_num_drafts"), "steps with drafts"
        )
        self._draft_tokens = family(
            "counter",
            ("spec_decode_num_draft_tokens", "spec_decode_draft_tokens"),
            "drafts verified",
        )
        self._accepted_total = family(
            "counter",
            ("spec_decode_num_accepted_tokens", "spec_decode_accepted_tokens_all"),
            "drafts accepted",
        )
        self._accepted = family(
            "counter",
            ("spec_decode_num_accepted_tokens_per_pos", "spec_decode_accepted_tokens"),
            "drafts accepted, by position",
            label=("position", "position"),
        )
        self.totals: Tally[str] = Tally()
        self.spec = SpecDecodingStats()

    def exposition(self) -> bytes:
        """This replica's metrics in Prometheus' text format (what `/metrics` serves)."""
        return prom.generate_latest(self.registry)

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
        if now.num_accepted_tokens > before.num_accepted_tokens:
            self._accepted_total.inc(now.num_accepted_tokens - before.num_accepted_tokens)
        for position, accepted in enumerate(now.accepted_per_position):
            old = before.accepted_per_position[position : position + 1] or [0]
            if accepted > old[0]:
                self._accepted.inc(accepted - old[0], str(position))

    def request_finished(
        self,
        finish_reason: str,
        num_prompt_tokens: int,
        num_output_tokens: int,
        ttft_s: float | None,
        tpot_s: float | None,
        e2e_s: float | None = None,
    ) -> None:
        self._requests.inc(1, finish_reason)
        self.totals[f"requests_{finish_reason}"] += 1
        if num_prompt_tokens:
            self._prompt_tokens.inc(num_prompt_tokens)
            self.totals["prompt_tokens"] += num_prompt_tokens
        if num_output_tokens:
            self._generation_tokens.inc(num_output_tokens)
            self.totals["generation_tokens"] += num_output_tokens
        for histogram, seconds in ((self._ttft, ttft_s), (self._tpot, tpot_s), (self._e2e, e2e_s)):
            if seconds is not None:
                histogram.observe(seconds)

    def snapshot(self) -> dict[str, Any]:
        return {**self.totals, "spec_decode": self.spec.as_dict()}
