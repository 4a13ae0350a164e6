"""`WorkerActor`: one (PP, TP) rank of an engine, hosting a `Worker` inside a Ray actor.

The actor starts empty (cheap: no torch.distributed, no weights), reports where it
landed, and only becomes rank `r` when the executor calls `init_worker` after ranking
every worker. Model steps run in the default concurrency group (one at a time, in
order), as tasks, inside a compiled graph's loop (`StepGraph`) or inside the call that
serves the step socket (`StepSockets`); `ping` and
`stage_timings` have their own group so they answer while a step or that loop runs. A
step that raised makes every later ping raise its error.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Listener

import ray
import torch

from cluster.actors.placement import WorkerSlot
from cluster.actors.step_sockets import serve_steps
from cluster.config import EngineConfig
from cluster.parallel.spawn import free_port
from cluster.worker.worker import Worker


@ray.remote(concurrency_groups={"health": 1})
class WorkerActor:
    def __init__(self, bundle_index: int, torch_threads: int) -> None:
        torch.set_num_threads(torch_threads)
        self.bundle_index = bundle_index
        self.rank: int | None = None
        self.worker: Worker | None = None
        self.step_error: BaseException | None = None
        self.step_listener: Listener | None = None

    def slot(self) -> WorkerSlot:
        context = ray.get_runtime_context()
        node_ip = ray.util.get_node_ip_address()
        return WorkerSlot(self.bundle_index, context.get_node_id(), node_ip, os.getpid())

    def rendezvous(self, host: str | None) -> str:
        """A `tcp://host:port` init method on this node, the port free right now."""
        host = host or ray.util.get_node_ip_address()
        return f"tcp://{host}:{free_port(host)}"

    def init_worker(self, config_json: str, rank: int, init_method: str) -> None:
        """Join the process group as `rank` and load this rank's shard."""
        self.rank = rank
        self.worker = Worker(EngineConfig.model_validate_json(config_json), rank, init_method)

    def _worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("init_worker must be called first")
        return self.worker

    def available_kv_blocks(self) -> int:
        return self._worker().available_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._worker().initialize_kv_cache(num_blocks)

    def execute_model(self, payload: bytes) -> bytes | None:
        """One step: msgpack `SchedulerOutput` in, msgpack `ModelRunnerOutput` out (or None
        on every rank but TP rank 0 of the last pipeline stage)."""
        try:
            return self._worker().execute_model(payload)
        except BaseException as e:
            self.step_error = e
            raise

    def open_step_socket(self, host: str, authkey: bytes) -> tuple[str, int]:
        """Listen on `host` for the executor's step connection (`StepSockets`); returns
        the address to connect to. `serve_step_socket` then serves it."""
        self.step_listener = Listener((host, 0), authkey=authkey)
        return self.step_listener.address

    def serve_step_socket(self) -> None:
        """Answer steps from the step socket until the executor closes it: one long call
        in the default group, so steps run on the thread that runs this actor's tasks."""
        serve_steps(self.step_listener, self.execute_model)

    @ray.method(concurrency_group="health")
    def stage_timings(self) -> dict[str, float]:
        return self._worker().stage_timings()

    @ray.method(concurrency_group="health")
    def ping(self) -> int | None:
        """This rank, or raises the error of its failed step again."""
        if self.step_error is not None:
            raise self.step_error
        return self.rank
