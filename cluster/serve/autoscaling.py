"""Autoscaling an LLM deployment on what fills a replica: its sequences and its KV cache.

Serve's default policy counts HTTP requests per replica. For an engine the load is the
sequences it holds (running in the batch plus waiting for KV room) and how full its KV
cache is: a replica whose cache is full queues new sequences however few requests it
has. Each replica reports both (`LLMServer.record_autoscaling_stats`, keys below); the
policy here turns them into a replica count. Serve applies the manifest's
`min_replicas` / `max_replicas`, the up/down delays and the scaling factors around it,
and starts a replica from zero as soon as a request waits.

A manifest turns it on by giving the deployment an `autoscaling_config`;
`autoscaling_options` fills in what it leaves out (this policy, and a target of one
full batch per replica).
"""

from __future__ import annotations

from typing import Any

# What each replica reports (floats; Serve aggregates them over `look_back_period_s`).
ONGOING_SEQUENCES = "ongoing_sequences"  # running + waiting in this replica's engine
WAITING_SEQUENCES = "waiting_sequences"  # queued in the scheduler for a batch or KV room
KV_USAGE = "kv_usage"  # fraction of this replica's KV blocks in use

POLICY_PATH = "cluster.serve.autoscaling:LLMLoadPolicy"


class LLMLoadPolicy:
    """Replicas wanted = sequences held by all replicas / `target_ongoing_requests`, and
    at least one more than now while a replica with a full KV cache (`kv_usage_high`)
    has sequences waiting. Before the replicas have reported, Serve's request count
    stands in for the sequences."""

    def __init__(self, kv_usage_high: float = 0.9) -> None:
        if not 0.0 < kv_usage_high <= 1.0:
            raise ValueError(f"kv_usage_high must be in (0, 1], got {kv_usage_high}")
        self.kv_usage_high = kv_usage_high

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        """`ctx`: Serve's `AutoscalingContext`; returns (replicas wanted, policy state)."""
        current = ctx.current_num_replicas
        if current == 0:
            return ctx.target_num_replicas, {}
        metrics = ctx.aggregated_metrics or {}
        ongoing = metrics.get(ONGOING_SEQUENCES)
        sequences = sum(ongoing.values()) if ongoing else ctx.total_num_requests
        sequences += ctx.total_queued_requests or 0.0  # held at handles, in no replica yet
        wanted = sequences / ctx.config.get_target_ongoing_requests()
        waiting = metrics.get(WAITING_SEQUENCES, {})
        kv_full = [
            r for r, usage in metrics.get(KV_USAGE, {}).items() if usage >= self.kv_usage_high
        ]
        if any(waiting.get(replica, 0.0) > 0 for replica in kv_full):
            wanted = max(wanted, current + 1)
        return wanted, {}


def autoscaling_options(config: dict[str, Any], max_num_seqs: int) -> dict[str, Any]:
    """A manifest's `autoscaling_config` with our defaults for what it leaves out: the
    policy above and `target_ongoing_requests` = one full batch (`max_num_seqs`), where
    Serve's default of 2 would add a replica while the first still has 6 free slots."""
    return {
        "target_ongoing_requests": max_num_seqs,
        "policy": {"policy_function": POLICY_PATH},
        **config,
    }
