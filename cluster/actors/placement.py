"""Where one engine's actors run: one placement-group bundle per (PP, TP) rank.

Bundle `i` hosts the worker created for it; bundle 0 also hosts the Serve replica and the
scheduler actor (their CPUs are merged into it, as Ray Serve LLM does, so STRICT_SPREAD
needs no extra node). GPU engines get `{GPU: 1, CPU: c}` bundles, CPU engines fractional
`{CPU: c}` bundles, so several ranks share a small machine.

Ranks are assigned after the workers exist, deterministically: nodes in a fixed order
(the scheduler's node first, then by IP and node id), bundles in index order within a
node. The ranks of one node are therefore contiguous whatever order Ray placed them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.config.placement import PlacementConfig

# Named actors live here, so tests and operators can find (and count) them.
ACTOR_NAMESPACE = "cluster"


def bundle_strategy(pg: Any, bundle_index: int) -> Any:
    """The scheduling strategy pinning an actor to one bundle of `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        placement_group=pg,
        placement_group_bundle_index=bundle_index,
        placement_group_capture_child_tasks=True,
    )


def create_placement_group(
    placement: PlacementConfig, world_size: int, timeout_s: float = 120.0
) -> Any:
    """A placement group for an engine outside Serve (Serve creates one per replica)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(placement.bundles(world_size), strategy=placement.strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise TimeoutError(
            f"placement group {placement.bundles(world_size)} ({placement.strategy}) could "
            f"not be scheduled in {timeout_s} s; the cluster has {ray.available_resources()}"
        )
    return pg


@dataclass(frozen=True)
class WorkerSlot:
    """Where a worker landed: its bundle, its node and its process."""

    bundle_index: int
    node_id: str
    node_ip: str
    pid: int = 0


def rank_order(slots: list[WorkerSlot], driver_node_id: str) -> list[int]:
    """Positions of `slots` in rank order: by node (driver's first), then bundle index."""

    def key(i: int) -> tuple[bool, str, str, int]:
        s = slots[i]
        return (s.node_id != driver_node_id, s.node_ip, s.node_id, s.bundle_index)

    return sorted(range(len(slots)), key=key)


def rendezvous_host(slots: list[WorkerSlot]) -> str | None:
    """Loopback when every rank is on one host (None: use rank 0's node address)."""
    return "127.0.0.1" if len({s.node_ip for s in slots}) == 1 else None
