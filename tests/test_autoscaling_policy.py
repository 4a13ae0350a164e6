"""The LLM autoscaling policy on Serve's own context and config types: replicas follow the
engines' sequences, a full KV cache with sequences waiting adds one, and a manifest's
`autoscaling_config` gets the policy and a one-batch target unless it names its own."""

import json
from pathlib import Path

import pytest
import yaml
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.cli import main
from cluster.serve import load_manifest
from cluster.serve.autoscaling import (
    KV_USAGE,
    ONGOING_SEQUENCES,
    POLICY_PATH,
    WAITING_SEQUENCES,
    LLMLoadPolicy,
)

DEFAULT = Path(__file__).parents[1] / "cluster" / "manifests" / "default.yaml"
DEPLOYMENT = DeploymentID(name="LLMServer", app_name="app")
REPLICAS = [ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT) for i in range(3)]


def context(replicas=2, metrics=None, requests=0.0, queued=0.0, target=8):
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=target)
    running = REPLICAS[:replicas]
    per_replica = {
        name: {r: values[i] for i, r in enumerate(running)}
        for name, values in (metrics or {}).items()
    }
    return AutoscalingContext(
        deployment_id=DEPLOYMENT,
        deployment_name="LLMServer",
        app_name="app",
        current_num_replicas=replicas,
        target_num_replicas=replicas,
        running_replicas=running,
        total_num_requests=requests,
        total_queued_requests=queued,
        aggregated_metrics=per_replica,
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=4,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=config,
    )


def wanted(ctx, **kwargs):
    return LLMLoadPolicy(**kwargs)(ctx)[0]


def test_replicas_follow_the_sequences_the_engines_hold():
    # 2 replicas holding 8 + 16 sequences, a target of 8 each: 3 replicas
    assert wanted(context(metrics={ONGOING_SEQUENCES: [8.0, 16.0]})) == pytest.approx(3.0)
    assert wanted(context(metrics={ONGOING_SEQUENCES: [1.0, 2.0]})) == pytest.approx(3 / 8)
    # handles' queued requests are in no engine yet but count
    assert wanted(context(metrics={ONGOING_SEQUENCES: [8.0, 8.0]}, queued=8.0)) == 3.0
    # before the replicas report, Serve's request count stands in
    assert wanted(context(metrics={}, requests=32.0)) == pytest.approx(4.0)
    # from zero replicas, Serve's own target (its cold start path) is kept
    assert wanted(context(replicas=0, metrics={}, requests=5.0)) == 0


def test_a_full_kv_cache_with_sequences_waiting_adds_a_replica():
    few = {ONGOING_SEQUENCES: [4.0, 2.0], WAITING_SEQUENCES: [3.0, 0.0]}
    assert wanted(context(metrics={**few, KV_USAGE: [0.95, 0.1]})) == 3
    # full but nothing waits, or waiting but room: the sequence count decides
    assert wanted(context(metrics={**few, KV_USAGE: [0.5, 0.95]})) == pytest.approx(6 / 8)
    assert wanted(context(metrics={**few, KV_USAGE: [0.8, 0.1]})) == pytest.approx(6 / 8)
    assert wanted(context(metrics={**few, KV_USAGE: [0.8, 0.1]}), kv_usage_high=0.75) == 3
    with pytest.raises(ValueError, match="kv_usage_high"):
        LLMLoadPolicy(kv_usage_high=1.5)


def test_manifest_autoscaling_gets_the_llm_policy_unless_it_names_one(capsys, tmp_path):
    def plan(autoscaling):
        config = yaml.safe_load(DEFAULT.read_text())
        config["applications"][0]["deployments"] = [
            {"name": "LLMServer", "autoscaling_config": autoscaling}
        ]
        path = tmp_path / "m.yaml"
        path.write_text(yaml.safe_dump(config))
        main(["serve", "--dry-run", str(path)])
        return json.loads(capsys.readouterr().out)["llm_server"]["autoscaling_config"]

    ours = plan({"min_replicas": 0, "max_replicas": 3})
    assert ours["policy"] == {"policy_function": POLICY_PATH}
    assert (
        ours["target_ongoing_requests"] == load_manifest(str(DEFAULT)).args.scheduler.max_num_seqs
    )
    # Serve accepts it as is: the policy imports and is a class it will instantiate
    serve_config = AutoscalingConfig(**ours)
    assert serve_config.policy.get_policy() is LLMLoadPolicy
    theirs = {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}
    kept = plan({"max_replicas": 3, "target_ongoing_requests": 2, "policy": theirs})
    assert kept["policy"] == theirs and kept["target_ongoing_requests"] == 2
