"""The prefix-aware request router's choice, on replicas described by their reports: the
longest cached prefix wins unless its replica is overloaded; no match or no prompt goes to
the least-loaded replica; what it sent a replica counts before the replica reports it."""

import asyncio
import time
from types import SimpleNamespace

from ray.serve._private.common import DeploymentID, ReplicaID

from cluster.engine.block_manager import KVBlockManager, prefix_block_hashes
from cluster.serve.prefix_router import (
    CACHED_BLOCKS,
    ENGINE_UNAVAILABLE,
    ONGOING_REQUESTS,
    PROMPT_TOKEN_IDS,
    REPORTED_AT,
    PrefixCacheRouter,
)

BLOCK = 4
DEPLOYMENT = DeploymentID(name="LLMServer", app_name="app")
SYSTEM = list(range(100, 124))  # 6 blocks
OTHER = list(range(200, 224))


def replica(name, cached=(), ongoing=0):
    stats = {CACHED_BLOCKS: list(cached), ONGOING_REQUESTS: ongoing, REPORTED_AT: time.time()}
    return SimpleNamespace(
        replica_id=ReplicaID(unique_id=name, deployment_id=DEPLOYMENT), routing_stats=stats
    )


def router(**kwargs):
    r = PrefixCacheRouter.__new__(PrefixCacheRouter)  # the choice needs no Serve state
    r.initialize_state(block_size=BLOCK, **kwargs)
    return r


def choose(r, replicas, token_ids=None):
    request = SimpleNamespace(args=(), kwargs={PROMPT_TOKEN_IDS: token_ids} if token_ids else {})
    ranks = asyncio.run(r.choose_replicas(replicas, request))
    assert sorted(x[0].replica_id.unique_id for x in ranks) == sorted(
        x.replica_id.unique_id for x in replicas
    )  # every replica is ranked, one per rank
    return [x[0].replica_id.unique_id for x in ranks]


def test_the_replica_caching_the_longest_prefix_wins():
    keys = prefix_block_hashes(SYSTEM, BLOCK)
    replicas = [replica("a", keys[:2]), replica("b", keys[:5]), replica("c")]
    assert choose(router(), replicas, [*SYSTEM, 1, 2, 3])[:2] == ["b", "a"]
    # a key that is not a prefix does not count: "a" holds block 2 without block 1
    replicas = [replica("a", keys[1:]), replica("b", keys[:1], ongoing=1)]
    assert choose(router(), replicas, [*SYSTEM, 1])[0] == "b"


def test_an_overloaded_match_and_no_match_go_to_the_least_loaded():
    keys = prefix_block_hashes(SYSTEM, BLOCK)
    busy = [replica("a", keys, ongoing=9), replica("b", ongoing=2), replica("c", ongoing=5)]
    assert choose(router(max_imbalance=4), busy, [*SYSTEM, 1]) == ["b", "c", "a"]
    assert choose(router(max_imbalance=8), busy, [*SYSTEM, 1])[0] == "a"
    assert choose(router(), busy, [*OTHER, 1])[0] == "b"  # nobody caches it: a tie, then load
    assert choose(router(), busy)[0] == "b"  # no token ids (a body the route server could not read)
    short = SYSTEM[: BLOCK - 1]  # no whole block followed by a token: nothing to match
    assert choose(router(), busy, short)[0] == "b"


def test_a_replica_restarting_its_engine_comes_last_and_its_sent_blocks_are_forgotten():
    keys = prefix_block_hashes(SYSTEM, BLOCK)
    r = router()
    replicas = [replica("a"), replica("b", ongoing=20)]
    assert choose(r, replicas, [*SYSTEM, 1])[0] == "a"  # "a" is sent the prompt's blocks
    replicas[0].routing_stats[ENGINE_UNAVAILABLE] = True
    replicas[0].routing_stats[CACHED_BLOCKS] = list(keys)  # a stale report counts for nothing
    assert choose(r, replicas, [*SYSTEM, 2]) == ["b", "a"]  # even overloaded, "b" is first
    replicas[0].routing_stats[ENGINE_UNAVAILABLE] = False
    replicas[0].routing_stats[CACHED_BLOCKS] = []  # restarted: an empty cache
    replicas[1].routing_stats[CACHED_BLOCKS] = list(keys)
    replicas[1].routing_stats[ONGOING_REQUESTS] = 0
    assert choose(r, replicas, [*SYSTEM, 3])[0] == "b"  # nothing remembered for "a"


def test_what_it_sent_counts_until_the_replicas_report():
    r = router()
    replicas = [replica("a"), replica("b")]
    first = choose(r, replicas, [*SYSTEM, 1])[0]
    # the replicas have not reported since: the same prefix follows the first request,
    # and a different one goes to the other replica, now the less loaded
    assert choose(r, replicas, [*SYSTEM, 2])[0] == first
    assert choose(r, replicas, [*OTHER, 1])[0] != first
    # a replica that is gone is forgotten
    assert choose(r, [replica("c")], [*SYSTEM, 3]) == ["c"]
    assert set(r._sent) == {ReplicaID(unique_id="c", deployment_id=DEPLOYMENT)}


def test_the_router_keys_are_the_engines_prefix_cache_keys():
    blocks = KVBlockManager(num_blocks=16, block_size=BLOCK)
    request = SimpleNamespace(
        request_id="r", num_computed_tokens=len(SYSTEM), num_tokens=len(SYSTEM) + 1
    )
    request.token_ids = lambda start, end: ([*SYSTEM, 7])[start:end]
    blocks.allocate("r", len(SYSTEM) + 1)
    blocks.cache_blocks(request)
    reported = blocks.cached_block_hashes(limit=100)
    assert reported == prefix_block_hashes([*SYSTEM, 7], BLOCK)
    assert blocks.cached_block_hashes(limit=2) == reported[-2:]
    assert len(blocks.cached_prefix([*SYSTEM, 7, 8])) == len(reported)


def test_prompts_nobody_caches_divide_among_the_replicas():
    """Each new prompt goes to the replica sent the fewest prompt blocks, even when that
    replica is somewhat busier: the prompts split between the caches."""
    r = router()
    replicas = [replica("a"), replica("b", ongoing=3)]
    prompts = [list(range(1000 * p, 1000 * p + 24)) for p in range(1, 9)]
    where = {choose(r, replicas, [*p, 1])[0] for p in prompts[:2]}
    assert where == {"a", "b"}
    counts = {"a": 0, "b": 0}
    for p in prompts[2:]:
        counts[choose(r, replicas, [*p, 1])[0]] += 1
    assert counts == {"a": 3, "b": 3}
