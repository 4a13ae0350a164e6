"""`RayExecutor`: the engine's executor with one `WorkerActor` per rank.

Shaped like `MultiprocExecutor`: every call goes to every rank as msgpack bytes and the
one reporting rank's reply is the step's output. Differences: workers are Ray actors
pinned to the bundles of a placement group (the Serve replica's, one passed in, or one
created here), they are ranked by node then bundle before torch.distributed starts, and
the rendezvous address is found at run time on the rank-0 worker's node.

Waiting is fail-fast: the first rank that dies or raises ends the call with its error,
so a lost worker fails the step within seconds instead of hanging on its peers. Ray can
take many seconds to report a worker process that simply exited (a kill, the OOM
killer) on a loaded machine, so the wait also checks, twice a second, that the processes
of the ranks on this node still exist.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group, remove_placement_group

from cluster.actors.placement import (
    ACTOR_NAMESPACE,
    WorkerSlot,
    bundle_strategy,
    create_placement_group,
    rank_order,
    rendezvous_host,
)
from cluster.actors.worker_actor import WorkerActor
from cluster.config import EngineConfig
from cluster.engine.executor import Executor, PendingOutput
from cluster.engine.messages import ModelRunnerOutput, SchedulerOutput
from cluster.placement_config import PlacementConfig

logger = logging.getLogger(__name__)

# How often a wait looks for worker processes that exited before Ray noticed.
_LIVENESS_CHECK_S = 0.5


class RayExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        placement: PlacementConfig | None = None,
        placement_group: Any = None,
        name_prefix: str | None = None,
        init_timeout_s: float = 600.0,
        step_timeout_s: float = 600.0,
        health_timeout_s: float = 10.0,
    ) -> None:
        self.config = config
        self.placement = placement or PlacementConfig(
            use_gpu=config.model.resolved_device == "cuda"
        )
        self.step_timeout_s = step_timeout_s
        self.health_timeout_s = health_timeout_s
        world_size = config.parallel.world_size
        self.workers: list[Any] = []
        self.slots: list[WorkerSlot] = []
        self._own_pg = None
        pg = placement_group or get_current_placement_group()
        if pg is None:
            pg = self._own_pg = create_placement_group(self.placement, world_size)
        if pg.bundle_count < world_size:
            raise ValueError(
                f"the placement group has {pg.bundle_count} bundles, {world_size} needed"
            )
        self.placement_group = pg
        try:
            self._start_workers(world_size, name_prefix, init_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        tp = config.parallel.tensor_parallel_size
        self.output_rank = world_size - tp  # TP rank 0 of the last pipeline stage

    def _start_workers(self, world_size: int, name_prefix: str | None, timeout_s: float) -> None:
        start = time.monotonic()
        actors = []
        for bundle in range(world_size):
            options: dict[str, Any] = {
                "num_cpus": self.placement.worker_cpus,
                "num_gpus": 1 if self.placement.use_gpu else 0,
                "scheduling_strategy": bundle_strategy(self.placement_group, bundle),
            }
            if name_prefix:
                options.update(name=f"{name_prefix}-worker-{bundle}", namespace=ACTOR_NAMESPACE)
            actors.append(
                WorkerActor.options(**options).remote(bundle, self.placement.torch_threads)
            )
        self.workers = actors  # so that shutdown() reaches them if ranking fails
        slots = self._get_all([a.slot.remote() for a in actors], timeout_s)
        order = rank_order(slots, ray.get_runtime_context().get_node_id())
        self.workers = [actors[i] for i in order]
        self.slots = [slots[i] for i in order]
        init_method = ray.get(
            self.workers[0].rendezvous.remote(rendezvous_host(self.slots)), timeout=timeout_s
        )
        config_json = self.config.model_dump_json()
        self._get_all(
            [w.init_worker.remote(config_json, r, init_method) for r, w in enumerate(self.workers)],
            timeout_s,
        )
        logger.info(
            "%d workers ready in %.1f s (init %s, nodes %s)",
            world_size,
            time.monotonic() - start,
            init_method,
            [s.node_id[:8] for s in self.slots],
        )

    def _get_all(self, refs: list[Any], timeout_s: float) -> list[Any]:
        """Results by rank; raises the first failure at once (dead actor or exception)."""
        index = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = ray.wait(
                pending, num_returns=1, timeout=max(0.0, min(remaining, _LIVENESS_CHECK_S))
            )
            if not ready:
                ranks = sorted(index[r] for r in pending)
                if remaining <= _LIVENESS_CHECK_S:
                    raise TimeoutError(f"worker ranks {ranks} did not answer in {timeout_s} s")
                self._raise_if_exited(ranks)
                continue
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                raise RuntimeError(f"worker rank {index[ready[0]]} is dead ({e})") from e
        return ray.get(refs)

    def _raise_if_exited(self, ranks: list[int]) -> None:
        """Raise if the process of any of `ranks` that runs on this node has exited."""
        if len(self.slots) != len(self.workers):  # not ranked yet
            return
        here = ray.get_runtime_context().get_node_id()
        for rank in ranks:
            slot = self.slots[rank]
            if slot.node_id == here and not _process_exists(slot.pid):
                raise RuntimeError(f"worker rank {rank} is dead (its process {slot.pid} exited)")

    def available_kv_blocks(self) -> int:
        return min(self._get_all([w.available_kv_blocks.remote() for w in self.workers], 600))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._get_all([w.initialize_kv_cache.remote(num_blocks) for w in self.workers], 600)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit_model(scheduler_output)()

    def submit_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        # An actor runs its calls in submission order: stage 0 starts the next step while
        # the later stages finish this one.
        payload = scheduler_output.encode()
        refs = [w.execute_model.remote(payload) for w in self.workers]

        def wait() -> ModelRunnerOutput:
            replies = self._get_all(refs, self.step_timeout_s)
            return ModelRunnerOutput.decode(replies[self.output_rank])

        return wait

    def stage_timings(self) -> list[dict[str, Any]]:
        return self._get_all([w.stage_timings.remote() for w in self.workers], 60)

    def check_health(self) -> None:
        """Every worker answers a ping within `health_timeout_s`, or this raises."""
        self._get_all([w.ping.remote() for w in self.workers], self.health_timeout_s)

    def describe(self) -> list[dict[str, Any]]:
        """Rank -> bundle and node, for operators and tests."""
        return [
            {"rank": r, "bundle": s.bundle_index, "node_id": s.node_id, "pid": s.pid}
            for r, s in enumerate(self.slots)
        ]

    def shutdown(self) -> None:
        # Killing is the shutdown: a rank may be blocked in a collective with a dead peer,
        # and the process exit frees its memory and its process group either way.
        for worker in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(worker, no_restart=True)
        self.workers = []
        if self._own_pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._own_pg)
            self._own_pg = None


def _process_exists(pid: int) -> bool:
    """False once `pid` has exited (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): signal 0 tells existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
