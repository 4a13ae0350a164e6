"""A consistency check of the engine core's KV block manager, for tests: no block leaked
or counted wrong after any sequence of allocations, hits and frees."""

from __future__ import annotations

from cluster.engine.block_manager import KVBlockManager


def assert_no_block_leaks(blocks: KVBlockManager) -> None:
    """Every block is free or held, and its count equals the tables holding it."""
    counts = [0] * blocks.num_blocks
    for table in blocks.block_tables.values():
        for block in table:
            counts[block] += 1
    free = set(blocks._free)
    bad = [
        b
        for b in range(blocks.num_blocks)
        if counts[b] != blocks._ref_counts[b] or (counts[b] == 0) != (b in free)
    ]
    assert not bad and len(free) == len(blocks._free), f"KV blocks leaked or miscounted: {bad[:10]}"
