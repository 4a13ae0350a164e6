"""Rank channels for workers in this process or in spawned local processes, and the
executors made of them.

`LocalRank` calls one `Worker` here. `ProcessRanks` is tensor (and pipeline) parallelism
on one machine without Ray: each rank runs a `Worker` in its own process and receives
every call as msgpack bytes through a pipe.
"""

from __future__ import annotations

import contextlib
import os
import signal
import traceback
import weakref
from typing import Any

import msgpack
import torch
import torch.multiprocessing as mp

from cluster.config import EngineConfig
from cluster.engine.executor import Executor, PendingReplies, RankChannel
from cluster.parallel.spawn import free_port, main_script_hidden
from cluster.worker.worker import Worker


class LocalRank(RankChannel):
    """The one rank of a single-rank engine, in this process. Steps still go through
    the wire format, so this path checks what crosses process boundaries too."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.world_size != 1:
            raise ValueError("LocalRank runs a single rank; use ProcessRanks")
        self.worker = Worker(config)

    def call(self, method: str, *args: Any) -> PendingReplies:
        value = getattr(self.worker, method)(*args)
        return lambda: [value]

    def close(self) -> None:
        self.worker.shutdown()


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.rank = LocalRank(config)
        super().__init__(self.rank)

    @property
    def worker(self) -> Worker:
        return self.rank.worker


def _worker_loop(
    config_json: str, rank: int, init_method: str, conn: Any, torch_threads: int
) -> None:
    """Serve calls `{"method": ..., "arg": ...}` until "shutdown" or until the parent is
    gone (its end of the pipe closed); reply `{"ok", "value"}`. Leaving is silent."""
    # Ranks share this machine's cores: more threads than cores makes every rank crawl.
    torch.set_num_threads(torch_threads)
    # Ctrl-C reaches the whole process group: the parent decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = None
    try:
        worker = Worker(EngineConfig.model_validate_json(config_json), rank, init_method)
        conn.send_bytes(msgpack.packb({"ok": True, "value": None}))
        while True:
            call = msgpack.unpackb(conn.recv_bytes())
            if call["method"] == "shutdown":
                break
            try:
                value = getattr(worker, call["method"])(*call["args"])
                reply = {"ok": True, "value": value}
            except Exception:
                reply = {"ok": False, "value": traceback.format_exc()}
            conn.send_bytes(msgpack.packb(reply))
    except (EOFError, OSError):  # the parent exited or closed the pipe: nobody to tell
        pass
    except Exception:
        with contextlib.suppress(OSError):
            conn.send_bytes(msgpack.packb({"ok": False, "value": traceback.format_exc()}))
    finally:
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.shutdown()
        conn.close()


class ProcessRanks(RankChannel):
    def __init__(self, config: EngineConfig, timeout_s: float = 600.0) -> None:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.timeout_s = timeout_s
        self.conns = []
        self.procs = []
        world_size = config.parallel.world_size
        torch_threads = max(1, (os.cpu_count() or 1) // world_size)
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_loop,
                args=(config.model_dump_json(), rank, init_method, child, torch_threads),
                daemon=True,
            )
            with main_script_hidden():
                proc.start()
            child.close()  # so a dead worker reads as EOF here, not as silence
            self.conns.append(parent)
            self.procs.append(proc)
        # An engine left open until the interpreter exits still stops its ranks in order
        # (before multiprocessing terminates them mid-call), quietly.
        self._finalizer = weakref.finalize(self, _stop_ranks, self.conns, self.procs)
        self._read_round()  # every rank has loaded its shard
        # Calls are answered in order; replies read ahead (a pending step's, while another
        # call waits) are kept by call number until their caller asks.
        self._num_calls = 0
        self._num_read = 0
        self._unclaimed: dict[int, list[Any]] = {}
        self.output_rank = world_size - config.parallel.tensor_parallel_size

    def _replies(self, call: int) -> list[Any]:
        """Every rank's reply to call number `call`."""
        while call not in self._unclaimed:
            self._unclaimed[self._num_read] = self._read_round()
            self._num_read += 1
        return self._unclaimed.pop(call)

    def _read_round(self) -> list[Any]:
        values = []
        for rank, conn in enumerate(self.conns):
            try:
                if not conn.poll(self.timeout_s):
                    raise TimeoutError(f"worker rank {rank} did not answer in {self.timeout_s} s")
                reply = msgpack.unpackb(conn.recv_bytes())
            except (EOFError, OSError) as e:
                raise RuntimeError(f"worker rank {rank} is dead ({e!r})") from e
            if not reply["ok"]:
                raise RuntimeError(f"worker rank {rank} failed:\n{reply['value']}")
            values.append(reply["value"])
        return values

    def _send_all(self, method: str, *args: Any) -> int:
        """Send a call to every rank; returns its call number."""
        message = msgpack.packb({"method": method, "args": list(args)})
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)
            except OSError as e:
                raise RuntimeError(f"worker rank {rank} is dead ({e!r})") from e
        self._num_calls += 1
        return self._num_calls - 1

    def call(self, method: str, *args: Any) -> PendingReplies:
        number = self._send_all(method, *args)
        return lambda: self._replies(number)

    def check_health(self) -> None:
        dead = [rank for rank, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            raise RuntimeError(f"worker ranks {dead} are dead")

    def close(self) -> None:
        self._finalizer()


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, timeout_s: float = 600.0) -> None:
        super().__init__(ProcessRanks(config, timeout_s))


def _stop_ranks(conns: list[Any], procs: list[Any]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send_bytes(msgpack.packb({"method": "shutdown", "args": []}))
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    for conn in conns:
        conn.close()
