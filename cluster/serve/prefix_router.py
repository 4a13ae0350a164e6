"""A Serve request router that sends a request to the replica holding its prompt's prefix.

Each `LLMServer` replica reports the keys of the KV blocks in its engine's prefix cache
(`LLMServer.record_routing_stats`, every `ROUTING_STATS_PERIOD_S`). The keys are the
engine's own (`block_manager.prefix_block_hashes`: a BLAKE2b chain over token blocks),
so the router computes a prompt's keys from its token ids and counts, per replica, how
many leading blocks it holds. Between reports it also remembers the blocks of the
prompts it sent each replica, which that replica caches as it computes them.

The replica with the longest match wins unless it is overloaded (more than
`max_imbalance` requests above the least-loaded one); a replica whose engine is
restarting or dead (`ENGINE_UNAVAILABLE`) comes last, and what it was sent is forgotten
(its new engine's cache starts empty). A prompt nobody caches goes to the
replica that was sent the fewest prompt blocks, so that the prompts divide among the
replicas' caches (if each took a share of every prompt, each cache would need room for
all of them); a request without token ids goes to the least-loaded replica. A replica's
load is what it last reported plus what this router sent it since. The answer is a
ranking: Serve takes the first replica with room and falls back down the list.

HTTP requests get here through `route_server.py` (HAProxy asks it where to forward each
request, and it tokenizes the body); a handle call passes `prompt_token_ids=` itself.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.engine.block_manager import BlockHash, prefix_block_hashes

ROUTER_PATH = "cluster.serve.prefix_router:PrefixCacheRouter"
ROUTING_STATS_PERIOD_S = 1.0
PROMPT_TOKEN_IDS = "prompt_token_ids"  # the `choose_replica` keyword with the prompt
# What a replica reports (`LLMServer.record_routing_stats`).
CACHED_BLOCKS = "prefix_block_hashes"  # its prefix cache's keys, newest last
ONGOING_REQUESTS = "ongoing_requests"
REPORTED_AT = "reported_at"  # time.time() when it reported
ENGINE_UNAVAILABLE = "engine_unavailable"  # True while its engine restarts or is dead
MAX_REPORTED_BLOCKS = 16384  # 256 KiB of keys a report at most


class PrefixCacheRouter(RequestRouter):
    def initialize_state(
        self, block_size: int = 16, max_imbalance: int = 8, remembered_blocks: int = 16384
    ) -> None:
        """`request_router_kwargs` of the manifest's deployment (set by `builder.py`)."""
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.remembered_blocks = remembered_blocks
        self._sent: dict[ReplicaID, OrderedDict[BlockHash, None]] = {}
        self._sent_at: dict[ReplicaID, list[float]] = {}
        # replica -> (its last report's list, that list as a set)
        self._reported: dict[ReplicaID, tuple[Any, frozenset[BlockHash]]] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._forget_gone({r.replica_id for r in candidate_replicas})
        keys = prefix_block_hashes(_prompt_token_ids(pending_request), self.block_size)
        loads = {r.replica_id: self._load(r) for r in candidate_replicas}
        balanced = min(loads.values()) + self.max_imbalance

        def rank(replica: RunningReplica) -> tuple[int, int, int, int, float]:
            load = loads[replica.replica_id]
            if replica.routing_stats.get(ENGINE_UNAVAILABLE):  # last of all
                self._sent.pop(replica.replica_id, None)
                return (2, 0, 0, load, random.random())
            if load > balanced:  # overloaded: after the others, the least loaded first
                return (1, 0, 0, load, random.random())
            match = self.matched_blocks(replica, keys)
            # No match anywhere: the replica that was sent the fewest prompts' blocks, so
            # that the prompts divide among the replicas' caches instead of every cache
            # holding a share of every prompt.
            assigned = len(self._sent.get(replica.replica_id, ()))
            return (0, -match, assigned if keys else 0, load, random.random())

        order = sorted(candidate_replicas, key=rank)
        self._note_sent(order[0].replica_id, keys)
        return [[replica] for replica in order]

    def matched_blocks(self, replica: RunningReplica, keys: list[BlockHash]) -> int:
        """How many of the prompt's leading blocks `replica` holds (or was sent)."""
        cached = self._reported_blocks(replica)
        sent = self._sent.get(replica.replica_id, {})
        count = 0
        for key in keys:
            if key not in cached and key not in sent:
                break
            count += 1
        return count

    def _reported_blocks(self, replica: RunningReplica) -> frozenset[BlockHash]:
        hashes = replica.routing_stats.get(CACHED_BLOCKS) or ()
        seen = self._reported.get(replica.replica_id)
        if seen is None or seen[0] is not hashes:  # a new report: index it once
            seen = (hashes, frozenset(hashes))
            self._reported[replica.replica_id] = seen
        return seen[1]

    def _load(self, replica: RunningReplica) -> int:
        stats = replica.routing_stats
        reported_at = stats.get(REPORTED_AT, 0.0)
        sent = self._sent_at.get(replica.replica_id, [])
        sent[:] = [t for t in sent if t > reported_at]
        return int(stats.get(ONGOING_REQUESTS, 0)) + len(sent)

    def _note_sent(self, replica_id: ReplicaID, keys: list[BlockHash]) -> None:
        self._sent_at.setdefault(replica_id, []).append(time.time())
        remembered = self._sent.setdefault(replica_id, OrderedDict())
        for key in keys:
            remembered[key] = None
            remembered.move_to_end(key)
        while len(remembered) > self.remembered_blocks:
            remembered.popitem(last=False)

    def _forget_gone(self, live: set[ReplicaID]) -> None:
        for table in (self._sent, self._sent_at, self._reported):
            for replica_id in [r for r in table if r not in live]:
                del table[replica_id]


def _prompt_token_ids(pending_request: PendingRequest | None) -> list[int]:
    """The prompt's token ids: the route server's keyword, or a handle call's request."""
    if pending_request is None:
        return []
    ids = pending_request.kwargs.get(PROMPT_TOKEN_IDS)
    if ids is None and pending_request.args:
        request: Any = pending_request.args[0]
        ids = (
            request.get(PROMPT_TOKEN_IDS)
            if isinstance(request, dict)
            else getattr(request, PROMPT_TOKEN_IDS, None)
        )
    return list(ids) if isinstance(ids, list | tuple) else []
