"""The token-budget scheduler and the KV block manager, driven without a model."""

import pytest
from block_checks import assert_no_block_leaks

from cluster.config import SchedulerConfig
from cluster.engine.block_manager import KVBlockManager
from cluster.engine.messages import ModelRunnerOutput, SchedulerOutput
from cluster.engine.request import FinishReason, Request
from cluster.engine.scheduler import Scheduler
from cluster.sampling_params import SamplingParams


def make_scheduler(
    num_blocks=100, block_size=4, max_num_seqs=8, budget=32, max_len=64, chunked=True, cache=True
):
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
    )
    return Scheduler(config, KVBlockManager(num_blocks, block_size, cache), max_len)


def request(req_id, prompt_len, **params):
    params.setdefault("max_tokens", 100)
    return Request(req_id, list(range(1, prompt_len + 1)), SamplingParams(**params), eos_token_id=0)


def respond(so: SchedulerOutput, tokens: dict[str, list[int]] | None = None, drafts=None):
    """A fake model: every sampling request gets `tokens[req]` (default [7])."""
    tokens = tokens or {}
    ids = [s.req_id for s in so.scheduled]
    sampled = [tokens.get(s.req_id, [7]) if s.sample else [] for s in so.scheduled]
    return ModelRunnerOutput(
        so.step_id, ids, sampled, draft_token_ids=[(drafts or {}).get(r, []) for r in ids]
    )


def test_block_manager_allocates_all_or_nothing_and_frees():
    bm = KVBlockManager(5, 4)
    assert bm.allocate("a", 9) == [0, 1, 2]
    assert bm.allocate("a", 12) == []
    assert bm.allocate("b", 12) is None and "b" not in bm.block_tables
    assert bm.allocate("b", 8) == [3, 4]
    bm.free("a")
    assert bm.num_free_blocks == 3
    assert_no_block_leaks(bm)


def test_chunked_prefill_within_budget_then_decode():
    s = make_scheduler(budget=10)
    s.add_request(request("a", 25))
    chunks = []
    while True:
        so = s.schedule()
        (item,) = so.scheduled
        chunks.append((item.num_computed_tokens, len(item.token_ids), item.sample))
        s.update_from_output(so, respond(so))
        if item.sample:
            break
    assert chunks == [(0, 10, False), (10, 10, False), (20, 5, True)]
    so = s.schedule()
    assert [(i.token_ids, i.num_computed_tokens) for i in so.scheduled] == [([7], 25)]


def test_budget_shared_running_first_then_fcfs():
    s = make_scheduler(budget=12, max_num_seqs=2)
    for name, n in (("a", 8), ("b", 8), ("c", 3)):
        s.add_request(request(name, n))
    so = s.schedule()
    assert [(i.req_id, len(i.token_ids)) for i in so.scheduled] == [("a", 8), ("b", 4)]
    s.update_from_output(so, respond(so))
    so = s.schedule()  # a decodes, b finishes its prompt; c waits (max_num_seqs=2)
    assert [(i.req_id, len(i.token_ids)) for i in so.scheduled] == [("a", 1), ("b", 4)]


@pytest.mark.parametrize("cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_preemption_frees_blocks_and_resumes_by_recompute(cache):
    # 6 blocks of 4 tokens; one sequence may reach max_len=24 (6 blocks), two cannot.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, max_len=24, cache=cache)
    s.add_request(request("a", 8))
    s.add_request(request("b", 8))
    b = s.requests["b"]
    resumed_with = None
    for _ in range(40):
        so = s.schedule()
        for new in so.new_requests:
            if new.req_id == "b" and b.num_preemptions:
                (item,) = [i for i in so.scheduled if i.req_id == "b"]
                resumed_with = (new.output_token_ids, item.num_computed_tokens, item.token_ids)
        s.update_from_output(so, respond(so))
        assert_no_block_leaks(s.blocks)
        if not s.has_unfinished_requests():
            break
    assert b.num_preemptions >= 1
    # b came back with its outputs and recomputed everything from position 0, or from
    # the whole blocks its earlier run (or a's equal prompt) left in the prefix cache
    outputs, start, tokens = resumed_with
    assert tokens == (b.prompt_token_ids + outputs)[start:]
    assert start == 0 if not cache else (start > 0 and start % 4 == 0)
    assert not s.has_unfinished_requests()
    assert s.blocks.num_free_blocks == 6


def test_stop_conditions_token_by_token():
    s = make_scheduler()
    s.add_request(request("eos", 3))
    s.add_request(request("ignore", 3, ignore_eos=True, max_tokens=2))
    s.add_request(request("stop_id", 3, stop_token_ids=[9]))
    so = s.schedule()
    outs = s.update_from_output(so, respond(so, {"eos": [0], "ignore": [0], "stop_id": [9]}))
    by_id = {o.req_id: o for o in outs}
    assert by_id["eos"].finish_reason == "stop" and by_id["eos"].new_token_ids == [0]
    assert by_id["stop_id"].finish_reason == "stop" and by_id["stop_id"].stop_reason == 9
    assert not by_id["ignore"].finished
    so = s.schedule()
    (out,) = s.update_from_output(so, respond(so))
    assert out.finish_reason == "length"
    assert not s.has_unfinished_requests()
    assert so.freed_req_ids == ["eos", "stop_id"]
    assert_no_block_leaks(s.blocks)
    assert s.blocks.num_free_blocks == s.blocks.num_blocks


def test_max_model_len_ends_the_request():
    s = make_scheduler(max_len=6)
    s.add_request(request("a", 4))
    reasons = []
    while s.has_unfinished_requests():
        so = s.schedule()
        reasons += [o.finish_reason for o in s.update_from_output(so, respond(so))]
    assert reasons[-1] == "length"


def test_spec_tokens_scheduled_trimmed_and_rolled_back():
    s = make_scheduler(budget=64, max_len=64)
    s.add_request(request("a", 5, max_tokens=50))
    so = s.schedule()
    s.update_from_output(so, respond(so, {"a": [11]}, drafts={"a": [12, 13, 14]}))
    a = s.requests["a"]
    assert a.spec_token_ids == [12, 13, 14] and a.num_tokens_with_spec == 9
    so = s.schedule()
    (item,) = so.scheduled
    assert item.token_ids == [11, 12, 13, 14] and item.num_spec_tokens == 3
    # one draft accepted, then a recovered token: two rejected drafts are rolled back
    outs = s.update_from_output(so, respond(so, {"a": [12, 20]}))
    assert outs[0].new_token_ids == [12, 20]
    assert (outs[0].num_draft_tokens, outs[0].num_accepted_tokens) == (3, 1)
    assert a.num_computed_tokens == 7 and a.num_tokens == 8  # 5 prompt + 11, 12 computed; 20 not
    # a budget too small for every draft trims them
    s.config = SchedulerConfig(max_num_batched_tokens=2, max_num_seqs=8)
    a.spec_token_ids = [1, 2, 3]
    (item,) = s.schedule().scheduled
    assert item.token_ids == [20, 1] and item.num_spec_tokens == 1 and a.spec_token_ids == [1]


def test_drafts_limited_by_max_tokens_and_max_len():
    s = make_scheduler(max_len=12)
    s.add_request(request("a", 5, max_tokens=3))
    so = s.schedule()
    s.update_from_output(so, respond(so, drafts={"a": [1, 2, 3, 4]}))
    assert len(s.requests["a"].spec_token_ids) == 1  # 1 output, 3 allowed: 1 draft + 1 bonus


def test_abort_frees_and_tells_workers():
    s = make_scheduler()
    s.add_request(request("a", 5))
    so = s.schedule()
    s.update_from_output(so, respond(so))
    (out,) = s.abort_requests(["a", "missing"])
    assert out.finish_reason == FinishReason.ABORT.value
    assert s.schedule().freed_req_ids == ["a"]
    assert s.blocks.num_free_blocks == s.blocks.num_blocks


def test_duplicate_request_id_is_refused():
    s = make_scheduler()
    s.add_request(request("a", 2))
    with pytest.raises(ValueError, match="already in the engine"):
        s.add_request(request("a", 2))


def test_pipeline_micro_batches_split_requests_and_skip_those_in_flight():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    s = Scheduler(config, KVBlockManager(100, 4), 64, max_concurrent_batches=2)
    for i in range(5):
        s.add_request(request(f"r{i}", 3))
    first = s.schedule()
    second = s.schedule()  # while `first` is in flight
    assert [x.req_id for x in first.scheduled] == ["r0", "r1", "r2"]  # ceil(5 / 2)
    assert [x.req_id for x in second.scheduled] == ["r3", "r4"]
    assert not s.schedule().scheduled  # everyone is in flight
    s.update_from_output(first, respond(first))
    third = s.schedule()
    assert [x.req_id for x in third.scheduled] == ["r0", "r1", "r2"]
    assert all(len(x.token_ids) == 1 for x in third.scheduled)  # their decode tokens


def test_requests_in_flight_are_never_preempted():
    # 6 blocks of 4: two requests of 8 prompt tokens take 2 blocks each (+1 on decode)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    s = Scheduler(config, KVBlockManager(5, 4), 64, max_concurrent_batches=2)
    s.add_request(request("a", 8))
    s.add_request(request("b", 8))
    first = s.schedule()
    assert [x.req_id for x in first.scheduled] == ["a"]
    second = s.schedule()
    assert [x.req_id for x in second.scheduled] == ["b"]
    s.update_from_output(first, respond(first))
    # "a" decodes into the last free block, then needs one more: "b" (in flight) cannot
    # give its blocks, so "a" itself yields
    a = s.requests["a"]
    for _ in range(10):
        so = s.schedule()
        assert [x.req_id for x in so.scheduled] in (["a"], [])
        if not so.scheduled:
            break
        s.update_from_output(so, respond(so))
    assert a.num_preemptions == 1 and s.requests["b"].num_preemptions == 0
    s.update_from_output(second, respond(second))
    assert len(s.requests["b"].output_token_ids) == 1
