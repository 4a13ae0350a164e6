"""KV block accounting with automatic prefix caching.

The engine core owns this; workers hold the KV tensors and only see block ids. Blocks
are allocated all-or-nothing for the tokens a step needs; a roll-back of rejected draft
tokens keeps them (later writes overwrite the rejected slots).

Prefix caching: once a block's KV is final it is registered under a hash of its content
chain (the previous block's hash, its token ids, and the token after it), and a later
request whose tokens give the same chain shares it instead of computing it again. The
token after the block is part of the key because a draft head's KV at the block's last
position is computed from that token (EAGLE and MTP read token p+1 at position p): with
it, a hit carries the draft's KV exactly as a fresh computation would write it. A
block's KV is final when every position in it is computed and that next token is known
(`cache_blocks`); nothing writes below a request's computed tokens, so shared blocks are
read-only. A block whose last user frees it stays cached until the space is needed:
free blocks are reused uncached ones first, then cached ones least recently freed first
(a request's tail blocks before its head).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from cluster.engine.request import Request

BlockHash = bytes  # 16 bytes of BLAKE2b: a collision would hand a request wrong KV


@dataclass
class PrefixCacheStats:
    """Cumulative: prompt tokens looked up at admission and how many were cached."""

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    def observe(self, num_tokens: int, num_hit: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVBlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Blocks no request holds, in reuse order (uncached first, then cached by age).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # content hash -> block
        self._hash_of: dict[int, BlockHash] = {}  # block -> its content hash
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # request -> its full blocks' hashes
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix hits --------------------------------------------------------------------
    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """The cached blocks that hold the longest cached prefix of `token_ids` (whole
        blocks, each followed by a known token, so at least one token is left to compute)."""
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        for key in prefix_block_hashes(token_ids, self.block_size):
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cached_block_hashes(self, limit: int) -> list[BlockHash]:
        """The keys of up to `limit` cached blocks, the most recently registered last (what
        a replica reports to a prefix-aware router)."""
        for _ in range(3):  # the step loop may register a block while this reads
            try:
                keys = list(self._cached)
            except RuntimeError:
                continue
            return keys[-limit:]
        return []

    def allocate_prefix(self, request_id: str, blocks: list[int]) -> None:
        """Start `request_id`'s table with the cached `blocks` (from `cached_prefix`)."""
        assert not self.block_tables.get(request_id), "a prefix starts an empty table"
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        self.block_tables[request_id] = list(blocks)
        self._hashes[request_id] = [self._hash_of[b] for b in blocks]

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks whose KV became final: every position computed
        and the token after the block known."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request.request_id)
        if table is None:
            return
        hashes = self._hashes.setdefault(request.request_id, [])
        known = min(request.num_computed_tokens, request.num_tokens - 1)
        num_final = min(known // self.block_size, len(table))
        while len(hashes) < num_final:
            index = len(hashes)
            start, end = index * self.block_size, (index + 1) * self.block_size
            tokens = request.token_ids(start, end + 1)
            key = _block_hash(hashes[-1] if hashes else b"", tokens[:-1], tokens[-1])
            hashes.append(key)
            block = table[index]
            if key not in self._cached and block not in self._hash_of:
                self._cached[key] = block
                self._hash_of[block] = key

    # ---- allocation ---------------------------------------------------------------------
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
        new = [self._take_free_block() for _ in range(needed)]
        table.extend(new)
        return new

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._hash_of.pop(block, None)
        if key is not None:  # evicted: its content is about to be overwritten
            del self._cached[key]
        self._ref_counts[block] = 1
        return block

    def free(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)
        for block in reversed(self.block_tables.pop(request_id, [])):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if block not in self._hash_of:  # nothing to keep: reuse it first
                    self._free.move_to_end(block, last=False)


def prefix_block_hashes(token_ids: list[int], block_size: int) -> list[BlockHash]:
    """The keys of the blocks a prefix hit on `token_ids` could use, in order: whole
    blocks followed by a known token (so at least one token is left to compute)."""
    keys: list[BlockHash] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size, block_size):
        end = start + block_size
        parent = _block_hash(parent, token_ids[start:end], token_ids[end])
        keys.append(parent)
    return keys


def _block_hash(parent: BlockHash, block_tokens: list[int], next_token: int) -> BlockHash:
    """The key of a block: its parent's key, its token ids and the token after it."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", [*block_tokens, next_token]).tobytes())
    return digest.digest()
