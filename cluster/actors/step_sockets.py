"""`StepSockets`: the step loop's scheduler -> workers round trip over one socket per rank.

Each worker actor listens once (`WorkerActor.open_step_socket`, a random key per engine
authenticates the connection) and serves steps inside one long call
(`serve_step_socket`): read a msgpack `SchedulerOutput`, run the step, write a one-byte
status and the reply. Waiting is a
blocking read in the kernel, so an idle rank costs no CPU (Ray's compiled-graph channels
spin instead), and a step costs one write and one read per rank. A rank whose process
dies closes its socket, which reads as end-of-file at once, whatever killed it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

import ray

Replies = list[bytes | None]  # one per rank

# The first byte of a reply.
_OK, _NONE, _FAILED = b"\x00", b"\x01", b"\x02"


def serve_steps(listener: Listener, step: Callable[[bytes], bytes | None]) -> None:
    """Accept the executor's connection and answer steps until it closes (worker side)."""
    with listener:
        conn = listener.accept()
    with conn:
        while True:
            try:
                payload = conn.recv_bytes()
            except (EOFError, OSError):
                return  # the executor is gone or closed the channel
            try:
                reply = step(payload)
                message = _NONE if reply is None else _OK + reply
            except BaseException as e:  # the executor raises it; the loop goes on
                message = _FAILED + f"{type(e).__name__}: {e}".encode(errors="replace")
            try:
                conn.send_bytes(message)
            except OSError:
                return


class StepSockets:
    def __init__(self, workers: list[Any], hosts: list[str], timeout_s: float) -> None:
        """Connect to every worker (actor handles and their node's address, by rank)."""
        authkey = os.urandom(32)
        addresses = ray.get(
            [w.open_step_socket.remote(h, authkey) for w, h in zip(workers, hosts, strict=True)],
            timeout=timeout_s,
        )
        self._serving = [w.serve_step_socket.remote() for w in workers]  # until closed
        self.conns: list[Connection] = []
        try:
            for address in addresses:
                self.conns.append(Client(tuple(address), authkey=authkey))
        except BaseException:
            self.close()
            raise
        self._num_sent = 0
        self._num_read = 0

    def submit(self, payload: bytes) -> int:
        """Send one step to every rank; returns its number (replies come in that order)."""
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except OSError as e:
                raise RuntimeError(f"worker rank {rank} is dead ({e!r})") from e
        self._num_sent += 1
        return self._num_sent - 1

    def wait(
        self, submitted: int, timeout_s: float, tick_s: float, on_tick: Callable[[], None]
    ) -> Replies:
        """Every rank's reply to step `submitted` (steps are collected in order); the
        first rank that fails or dies raises at once; `on_tick` runs every `tick_s`."""
        if submitted != self._num_read:
            raise RuntimeError(f"step {submitted} collected out of order ({self._num_read} next)")
        replies: dict[int, bytes | None] = {}
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + timeout_s
        while pending:
            ready = wait(list(pending.values()), timeout=tick_s)
            if not ready:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"worker ranks {sorted(pending)} did not answer in {timeout_s} s"
                    )
                on_tick()
                continue
            for rank in [r for r, c in pending.items() if c in ready]:
                replies[rank] = _read_reply(rank, pending.pop(rank))
        self._num_read += 1
        return [replies[rank] for rank in range(len(self.conns))]

    def close(self, workers_alive: bool = True) -> None:
        """Close every connection; each worker's step thread then ends."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()
        self.conns = []


def _read_reply(rank: int, conn: Connection) -> bytes | None:
    try:
        message = conn.recv_bytes()
    except (EOFError, OSError) as e:
        raise RuntimeError(f"worker rank {rank} is dead (its step socket closed: {e!r})") from e
    status, body = message[:1], message[1:]
    if status == _FAILED:
        raise RuntimeError(f"worker rank {rank}'s step failed: {body.decode()}")
    return body if status == _OK else None
