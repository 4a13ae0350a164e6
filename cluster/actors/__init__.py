"""Ray actors of one engine: a `SchedulerActor` owning the engine core, one `WorkerActor`
per (PP, TP) rank inside a placement group, the `RayExecutor` between them, and the
`EngineClient` through which a Serve replica (or any asyncio program) uses the engine.

This package and `cluster.serve` are the only places that import Ray.
"""

from cluster.actors.client import EngineClient
from cluster.actors.placement import (
    ACTOR_NAMESPACE,
    WorkerSlot,
    create_placement_group,
    rank_order,
)
from cluster.actors.ray_executor import RayExecutor
from cluster.actors.scheduler_actor import SchedulerActor
from cluster.actors.worker_actor import WorkerActor
from cluster.config.placement import PlacementConfig

__all__ = [
    "ACTOR_NAMESPACE",
    "EngineClient",
    "PlacementConfig",
    "RayExecutor",
    "SchedulerActor",
    "WorkerActor",
    "WorkerSlot",
    "create_placement_group",
    "rank_order",
]
