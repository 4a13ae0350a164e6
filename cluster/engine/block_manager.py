"""KV block accounting: a free list and one block table per request.

The engine core owns this; workers hold the KV tensors and only see block ids.
Blocks are allocated all-or-nothing for the tokens a step needs, and freed when a
request finishes or is preempted. A roll-back of rejected draft tokens keeps the
blocks (later writes overwrite the rejected slots).
"""

from __future__ import annotations

from collections import deque


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens; the new block ids, or None
        (and nothing allocated) when too few blocks are free."""
        table = self.block_tables.setdefault(request_id, [])
        needed = self.blocks_for(num_tokens) - len(table)
        if needed <= 0:
            return []
        if needed > len(self._free):
            if not table:
                del self.block_tables[request_id]
            return None
        new = [self._free.popleft() for _ in range(needed)]
        table.extend(new)
        return new

    def free(self, request_id: str) -> None:
        for block in reversed(self.block_tables.pop(request_id, [])):
            self._free.appendleft(block)

    def check_no_leaks(self) -> None:
        """Every block is either free or in exactly one table (raises otherwise)."""
        used = [b for table in self.block_tables.values() for b in table]
        everything = sorted(used + list(self._free))
        if everything != list(range(self.num_blocks)):
            raise AssertionError(
                f"KV blocks leaked or doubly owned: {len(used)} used, {len(self._free)} free"
            )
