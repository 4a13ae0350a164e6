"""`RayRanks`: the rank channel of one `WorkerActor` per rank, and `RayExecutor`, the
engine's executor over it.

Shaped like `ProcessRanks`: every call goes to every rank as msgpack bytes and the
one reporting rank's reply is the step's output. Differences: workers are Ray actors
pinned to the bundles of a placement group (the Serve replica's, one passed in, or one
created here), they are ranked by node then bundle before torch.distributed starts, and
the rendezvous address is found at run time on the rank-0 worker's node.

Once the KV cache exists, steps go through the channel `placement.step_channel` names: a
Ray Compiled Graph (`StepGraph`, the default with GPUs), one socket per rank
(`StepSockets`, the default on CPUs) or one Ray task per rank. Every other call, and
every step when a channel cannot be opened (a log line says why), is one Ray task per rank.

Waiting is fail-fast: the first rank that dies or raises ends the call with its error,
so a lost worker fails the step within seconds instead of hanging on its peers. Ray can
take many seconds to report a worker process that simply exited (a kill, the OOM
killer) on a loaded machine, so the wait also checks, twice a second, that the processes
of the ranks on this node still exist. A compiled graph returns all ranks' replies at
once, so while a step runs long its wait also asks each rank (outside the graph)
whether its last step raised: its peers may be stuck in a collective meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
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
from cluster.actors.step_graph import StepGraph
from cluster.actors.step_sockets import StepSockets
from cluster.actors.worker_actor import WorkerActor
from cluster.config import EngineConfig
from cluster.config.placement import PlacementConfig
from cluster.engine.executor import Executor, PendingReplies, RankChannel

logger = logging.getLogger(__name__)

# How often a wait looks for worker processes that exited before Ray noticed.
_LIVENESS_CHECK_S = 0.5
# How long a failed step looks for a dead peer to blame before reporting its own error.
_PEER_DEATH_WAIT_S = 1.0


class RayRanks(RankChannel):
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
        self.call_timeout_s = init_timeout_s
        self.health_timeout_s = health_timeout_s
        world_size = config.parallel.world_size
        self.workers: list[Any] = []
        self.slots: list[WorkerSlot] = []
        self.step_channel: StepGraph | StepSockets | None = None
        self._failed = False  # a step failed: workers may be stuck in a collective
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
            self.close()
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
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                raise _worker_error(index[ready[0]], e) from e
        return ray.get(refs)

    def _raise_if_failed(self) -> None:
        """Raise if a rank's process exited or its last step raised (run between the slices
        of a step channel's wait; a rank that does not answer within a tick is skipped)."""
        self._raise_if_exited(list(range(len(self.workers))))
        pings = [w.ping.remote() for w in self.workers]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=_LIVENESS_CHECK_S)
        for rank, ref in enumerate(pings):
            if ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:
                    raise _worker_error(rank, e) from e

    def _dead_peer(self, error: BaseException) -> BaseException:
        """A rank whose step failed inside a collective (gloo: "connection reset") failed
        because a peer died: the error that names the dead rank, when a rank's process
        is found gone within `_PEER_DEATH_WAIT_S`; otherwise `error` itself."""
        if not isinstance(error, RuntimeError) or "is dead" in str(error):
            return error
        deadline = time.monotonic() + _PEER_DEATH_WAIT_S
        while True:
            try:
                self._raise_if_exited(list(range(len(self.workers))))
            except RuntimeError as dead:
                return dead
            if time.monotonic() >= deadline:
                return error
            time.sleep(0.05)

    def _raise_if_exited(self, ranks: list[int]) -> None:
        """Raise if the process of any of `ranks` that runs on this node has exited."""
        if len(self.slots) != len(self.workers):  # not ranked yet
            return
        here = ray.get_runtime_context().get_node_id()
        for rank in ranks:
            slot = self.slots[rank]
            if slot.node_id == here and not _process_exists(slot.pid):
                raise RuntimeError(f"worker rank {rank} is dead (its process {slot.pid} exited)")

    def call(self, method: str, *args: Any) -> PendingReplies:
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return lambda: self._get_all(refs, self.call_timeout_s)

    def ready(self) -> None:
        self.step_channel = self._open_step_channel()

    def _open_step_channel(self) -> StepGraph | StepSockets | None:
        kind = self.placement.resolved_step_channel
        try:
            if kind == "compiled_graph":
                inflight = self.config.parallel.pipeline_parallel_size + 1
                channel: StepGraph | StepSockets = StepGraph(self.workers, inflight)
            elif kind == "sockets":
                hosts = [slot.node_ip for slot in self.slots]
                channel = StepSockets(self.workers, hosts, timeout_s=60)
            else:
                logger.info("placement.step_channel is 'tasks': one Ray task per rank per step")
                return None
        except Exception as e:  # an older Ray, or channels this layout cannot have
            logger.warning(
                "the %s step channel is unavailable here (%s: %s); each step is one Ray "
                "task per rank instead",
                kind,
                type(e).__name__,
                e,
            )
            return None
        logger.info("steps reach the %d ranks through %s", len(self.workers), kind)
        return channel

    def step(self, payload: bytes) -> Callable[[], bytes]:
        # Every rank takes its steps in submission order: stage 0 starts the next step
        # while the later stages finish this one.
        channel = self.step_channel
        if channel is None:
            refs = [w.execute_model.remote(payload) for w in self.workers]
            return lambda: self._get_all(refs, self.step_timeout_s)[self.output_rank]
        submitted = channel.submit(payload)

        def wait() -> bytes:
            try:
                replies = channel.wait(
                    submitted, self.step_timeout_s, _LIVENESS_CHECK_S, self._raise_if_failed
                )
            except BaseException as e:
                self._failed = True
                cause = self._dead_peer(e)
                if cause is e:
                    raise
                raise cause from e
            return replies[self.output_rank]

        return wait

    def check_health(self) -> None:
        """Every worker answers a ping within `health_timeout_s`, or this raises."""
        self._get_all([w.ping.remote() for w in self.workers], self.health_timeout_s)

    def describe(self) -> list[dict[str, Any]]:
        """Rank -> bundle and node, for operators and tests."""
        return [
            {"rank": r, "bundle": s.bundle_index, "node_id": s.node_id, "pid": s.pid}
            for r, s in enumerate(self.slots)
        ]

    def close(self) -> None:
        # Killing is the shutdown: a rank may be blocked in a collective with a dead peer,
        # and the process exit frees its memory and its process group either way. A healthy
        # graph is torn down first (its loops leave cleanly), a failed one after the kill.
        channel, self.step_channel = self.step_channel, None
        if channel is not None and not self._failed:
            channel.close(workers_alive=True)
        for worker in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(worker, no_restart=True)
        if channel is not None and self._failed:
            channel.close(workers_alive=False)
        self.workers = []
        if self._own_pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._own_pg)
            self._own_pg = None


class RayExecutor(Executor):
    """The engine's executor over `RayRanks` (the same arguments)."""

    def __init__(self, config: EngineConfig, *args: Any, **kwargs: Any) -> None:
        self.ranks = RayRanks(config, *args, **kwargs)
        super().__init__(self.ranks)

    def describe(self) -> list[dict[str, Any]]:
        return self.ranks.describe()


def _worker_error(rank: int | str, error: Exception) -> RuntimeError:
    """`error` from a worker call as the engine reports it: which rank, dead or failed."""
    if isinstance(error, ray.exceptions.RayActorError):
        return RuntimeError(f"worker rank {rank} is dead ({error})")
    cause = getattr(error, "cause", None) or error
    return RuntimeError(f"worker rank {rank}'s step failed: {type(cause).__name__}: {cause}")


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
