"""Adaptive speculation: the controller finds the draft count with the best measured
goodput per batch-size bucket, re-checks the others, and the engine stays lossless."""

import itertools

import pytest
from block_checks import assert_no_block_leaks

from cluster.engine.spec_controller import SpecController


def drive(controller, batch_size, goodput_of_k, steps):
    """Feed `steps` steps whose goodput (tokens/s) is `goodput_of_k[k]`; return the ks used."""
    used = []
    for _ in range(steps):
        k = controller.num_drafts(batch_size)
        used.append(k)
        controller.observe(batch_size, k, num_tokens=int(goodput_of_k[k] * 10), seconds=10.0)
    return used


def test_climbs_from_speculation_off_while_goodput_rises_then_keeps_the_best():
    c = SpecController(max_drafts=3, window_steps=2, explore_every=4)
    used = drive(c, 1, {0: 10, 1: 15, 2: 25, 3: 20}, 8)
    assert used == [0, 0, 1, 1, 2, 2, 3, 3]  # each arm measured for one window
    used = drive(c, 1, {0: 10, 1: 15, 2: 25, 3: 20}, 40)
    assert used.count(2) > 0.7 * len(used)  # exploits the best ...
    assert {1, 3} <= set(used) and 0 not in used  # ... and re-checks its neighbours only


def test_turns_speculation_off_where_it_does_not_pay_and_buckets_are_independent():
    c = SpecController(max_drafts=3, window_steps=2, explore_every=5)
    used = drive(c, 16, {0: 100, 1: 90, 2: 80, 3: 70}, 8)
    assert used == [0, 0, 1, 1, 0, 0, 0, 0]  # one window of k = 1 shows drafting loses
    assert c.num_drafts(16) == 0 and c.num_drafts(12) == 0  # same bucket (9-16)
    # A new batch size starts from the nearest measured one's choice (no full sweep) ...
    used = drive(c, 1, {0: 10, 1: 15, 2: 20, 3: 28}, 8)
    assert used[:6] == [0] * 6
    # ... and tries its other counts in probe windows, then settles on its own best.
    used = drive(c, 1, {0: 10, 1: 15, 2: 20, 3: 28}, 60)
    assert used[-20:].count(3) >= 14
    summary = c.summary()
    assert summary["9-16"]["num_drafts"] == 0
    assert summary["9-16"]["goodput_by_num_drafts"][:2] == [100, 90]
    assert all(g is not None for g in summary["1"]["goodput_by_num_drafts"])


def test_follows_a_change_in_goodput():
    c = SpecController(max_drafts=2, window_steps=1, explore_every=3, smoothing=1.0)
    drive(c, 4, {0: 10, 1: 20, 2: 30}, 4)
    assert c.num_drafts(4) == 2
    used = drive(c, 4, {0: 30, 1: 20, 2: 10}, 30)  # acceptance collapsed: drafting stops paying
    assert used[-10:].count(0) >= 8


def test_probes_back_off_while_nothing_changes():
    c = SpecController(max_drafts=3, window_steps=1, explore_every=2, max_explore_every=16)
    used = drive(c, 1, {0: 10, 1: 15, 2: 25, 3: 20}, 200)[4:]  # after the first sweep
    probes = [i for i, k in enumerate(used) if k != 2]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps[-1] == 17 and len(probes) < 20  # the interval grew to its cap


def test_a_marginal_gain_does_not_turn_drafting_on():
    c = SpecController(max_drafts=3, window_steps=1, explore_every=100, min_gain=0.1)
    drive(c, 8, {0: 100, 1: 105, 2: 108, 3: 90}, 4)
    assert c.num_drafts(8) == 0  # 8% better is not enough
    c = SpecController(max_drafts=3, window_steps=1, explore_every=100, min_gain=0.1)
    drive(c, 8, {0: 100, 1: 105, 2: 125, 3: 90}, 4)
    assert c.num_drafts(8) == 2


def test_steps_decided_before_a_switch_are_not_credited_to_the_new_count():
    c = SpecController(max_drafts=2, window_steps=1)
    k = c.num_drafts(1)
    c.observe(1, k, 30, 1.0)  # window over: the controller moves to k + 1
    c.observe(1, k, 1000, 1.0)  # a late step of the old k
    assert c.summary()["1"]["goodput_by_num_drafts"] == [30.0, None, None]


@pytest.mark.parametrize("batch_size,bucket", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (16, 4)])
def test_buckets(batch_size, bucket):
    assert SpecController.bucket_of(batch_size) == bucket


@pytest.mark.parametrize("method", ["eagle3", "ngram", "draft_model"])
def test_adaptive_engine_is_lossless(tmp_path, smollm2_path, method):
    from random_heads import write_all
    from tiny_models import make_tiny_chat_model

    from cluster import LLM, SamplingParams

    target = str(tmp_path / "target")
    make_tiny_chat_model(target, smollm2_path, num_hidden_layers=4, seed=3)
    spec = write_all(str(tmp_path / "drafts"), target)[method]
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], [9, 8, 9, 8, 9, 8, 9, 8], [40, 41])]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = dict(dtype="float32", max_model_len=128, num_kv_blocks=96, block_size=4)
    with LLM(target, **engine) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    adaptive = {**spec, "num_speculative_tokens": 3, "adaptive": True}
    with LLM(target, speculative_config=adaptive, **engine) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        summary = llm.get_metrics()["adaptive_speculation"]
        assert_no_block_leaks(llm.engine.core.block_manager)
    assert [o.outputs[0].token_ids for o in outs] == reference
    bucket = summary["3-4"]  # the decode batch: 3 requests
    assert bucket["windows"] >= 4  # k changed window to window ...
    assert None not in bucket["goodput_by_num_drafts"][:2]  # ... from 0 to 1 at least
