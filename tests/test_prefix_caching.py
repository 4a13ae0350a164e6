"""Automatic prefix caching: whole blocks of KV (the draft's included) shared between
requests with the same tokens, exactly as if they were computed again.

The block manager's rules are checked directly (what is shared, the token after a block
in its key, the order blocks are reused in); then the engine on a tiny random model, for
every speculative method: a request whose prefix an earlier request cached gets the same
greedy tokens, and the same drafts accepted, as with caching off.
"""

import pytest
from block_checks import assert_no_block_leaks
from random_heads import write_all
from tiny_models import make_tiny_chat_model

from cluster import LLM, SamplingParams
from cluster.engine.block_manager import KVBlockManager
from cluster.engine.request import Request


def computed(request_id, tokens, num_computed):
    request = Request(request_id, list(tokens), SamplingParams())
    request.num_computed_tokens = num_computed
    return request


def test_full_blocks_followed_by_a_known_token_are_shared():
    bm = KVBlockManager(16, 4)
    a = computed("a", range(10), 10)  # blocks [0..3] [4..7] final; [8, 9] partial
    bm.allocate("a", 10)
    bm.cache_blocks(a)
    shared = bm.cached_prefix(list(range(10)))
    assert shared == bm.block_tables["a"][:2]
    # the token after a block is part of its key: a different 9th token misses block 2
    assert bm.cached_prefix([*range(8), 99, 5]) == shared[:1]
    # at least one token is always left to compute
    assert bm.cached_prefix(list(range(8))) == shared[:1]
    bm.allocate_prefix("b", shared)
    assert bm.allocate("b", 12) == [bm.block_tables["b"][2]]
    assert_no_block_leaks(bm)
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 16
    assert bm.cached_prefix(list(range(10))) == shared  # still cached while free
    assert_no_block_leaks(bm)


def test_blocks_are_final_only_once_computed():
    bm = KVBlockManager(8, 4)
    bm.allocate("a", 12)
    bm.cache_blocks(computed("a", range(12), 5))  # block 1 not computed yet
    assert len(bm.cached_prefix(list(range(12)))) == 1
    bm.cache_blocks(computed("a", range(12), 12))  # block 2 lacks its next token
    assert len(bm.cached_prefix([*list(range(12)), 0])) == 2


def test_uncached_free_blocks_are_reused_first_then_the_oldest_cached():
    bm = KVBlockManager(6, 2)
    bm.allocate("a", 6)
    bm.cache_blocks(computed("a", range(7), 6))
    bm.allocate("x", 4)  # uncached
    bm.free("x")
    bm.free("a")
    # x's blocks go first; then a's tail before its head
    taken = bm.allocate("y", 10)
    assert taken[:2] == [3, 4] and taken[2:] == [5, 2, 1]
    assert bm.cached_prefix(list(range(7))) == [0]  # a's first block survived
    assert_no_block_leaks(bm)


def test_disabled_caching_never_shares():
    bm = KVBlockManager(8, 4, enable_prefix_caching=False)
    bm.allocate("a", 9)
    bm.cache_blocks(computed("a", range(9), 9))
    assert bm.cached_prefix(list(range(9))) == []


NEW_TOKENS = 12
BASE = list(range(200, 228))  # 7 whole blocks of 4
# The first request caches BASE's blocks; then a request that shares them but not the
# token after them (the last shared block's draft KV must not be reused: it was computed
# from token 1), a repeat, a short one.
FIRST = [[*BASE, 1, 2, 3]]
THEN = [[*BASE, 5, 6], [*BASE, 1, 2, 3], BASE[:9]]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(
    dtype="float32", max_model_len=128, num_kv_blocks=96, block_size=4, max_num_batched_tokens=24
)
METHODS = ["eagle", "eagle3", "mtp_deepseek", "mtp_qwen3_next", "ngram", "draft_model"]


@pytest.fixture(scope="module")
def target(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("prefix")
    make_tiny_chat_model(str(root / "target"), smollm2_path, num_hidden_layers=4, seed=5)
    return str(root / "target"), write_all(str(root / "drafts"), str(root / "target"))


def _run(path, spec=None, cache=True, **overrides):
    """THEN's outputs, generated after FIRST in the same engine, every draft the proposer
    made for them (per request, in order), and the prefix cache's hit rate."""
    spec = {**spec, "num_speculative_tokens": 3} if spec else None
    engine = {**ENGINE, **overrides}
    with LLM(path, speculative_config=spec, enable_prefix_caching=cache, **engine) as llm:
        drafts = _record_drafts(llm)
        for prompts in (FIRST, THEN):
            drafts.clear()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        blocks = llm.engine.core.block_manager
        assert_no_block_leaks(blocks)
        ids = [o.request_id for o in outs]
        return (
            [o.outputs[0] for o in outs],
            [drafts.get(i) for i in ids],
            blocks.prefix_stats.hit_rate,
        )


def _record_drafts(llm):
    """request id -> the drafts proposed for it, step by step (from each step's output)."""
    executor = llm.engine.core.executor
    submit_model = executor.submit_model
    drafts = {}

    def recording(scheduler_output):
        wait = submit_model(scheduler_output)

        def output():
            out = wait()
            for req_id, tokens in zip(out.req_ids, out.draft_token_ids, strict=False):
                if tokens:  # (a prefill chunk that samples nothing drafts nothing)
                    drafts.setdefault(req_id, []).append(list(tokens))
            return out

        return output

    executor.submit_model = recording
    return drafts


@pytest.fixture(scope="module")
def baseline(target):
    outs, _, hit_rate = _run(target[0], cache=False)
    assert hit_rate == 0.0
    return [o.token_ids for o in outs]


def test_cached_prefixes_give_the_same_tokens_without_speculation(target, baseline):
    outs, _, hit_rate = _run(target[0])
    assert [o.token_ids for o in outs] == baseline
    assert hit_rate > 0.5


@pytest.mark.parametrize("method", METHODS)
def test_cached_prefixes_keep_speculation_exact(target, baseline, method):
    """The same tokens and the same drafts as without the cache: the draft's KV in the
    shared blocks is what the draft would have computed."""
    path, specs = target
    cached, cached_drafts, hit_rate = _run(path, specs[method])
    fresh, fresh_drafts, _ = _run(path, specs[method], cache=False)
    assert hit_rate > 0.5
    assert [o.token_ids for o in cached] == [o.token_ids for o in fresh] == baseline
    assert any(r is not None for r in cached_drafts + fresh_drafts)  # the drafts were seen
    if method == "mtp_deepseek":
        # Its second layer (draft 2) reads layer 1's output at the position before: the
        # first position after a hit has none kept and reads its own instead, so only
        # the first draft of each step is the same as without the cache.
        cached_drafts = [[d[:1] for d in r] for r in cached_drafts]
        fresh_drafts = [[d[:1] for d in r] for r in fresh_drafts]
    assert cached_drafts == fresh_drafts
    assert sum(o.num_draft_tokens for o in cached) > 0


def test_cached_prefixes_survive_preemption(target, baseline):
    """Few blocks: requests are preempted and resume from what the cache kept."""
    path, specs = target
    outs, _, _ = _run(path, specs["eagle3"], num_kv_blocks=32, max_num_batched_tokens=64)
    assert [o.token_ids for o in outs] == baseline


@pytest.mark.parametrize("layout", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_cached_prefixes_with_parallel_ranks(target, baseline, layout):
    path, specs = target
    outs, _, hit_rate = _run(path, specs["eagle3"], **{layout: 2})
    assert [o.token_ids for o in outs] == baseline
    assert hit_rate > 0.5
