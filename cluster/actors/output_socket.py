"""The scheduler actor's outputs pushed to its replica over one socket, as they exist.

`OutputSender` (in the scheduler actor) listens on its node's address; a thread accepts
the replica's connection (which must open with the engine's secret, handed out through
Ray) and writes each `OutputBatch` as soon as the step loop publishes outputs, merging
whatever was published while the previous write went out. `read_batches` (in the
replica) is the other end: an asyncio reader, so the pump costs no Ray call per step and
nothing waits on a polling interval. A replica whose loop ends may connect again; a
scheduler that dies closes the socket, which the reader sees at once.

Frames: 4 bytes of big-endian length, then the msgpack `OutputBatch`.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import select
import socket
import threading
from collections.abc import AsyncIterator, Callable

from cluster.actors.wire import OutputBatch

SECRET_BYTES = 32


class OutputSender:
    def __init__(self, host: str, take: Callable[[float], OutputBatch | None]) -> None:
        """Listen on `host`; `take(timeout_s)` blocks until outputs are published (or
        the loop died) and returns them as one batch, or None after `timeout_s`."""
        self.secret = os.urandom(SECRET_BYTES)
        self._take = take
        self._server = socket.create_server((host, 0))
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="cluster-outputs", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            with conn:
                if self._authenticated(conn):
                    self._send_until_closed(conn)

    def _authenticated(self, conn: socket.socket) -> bool:
        conn.settimeout(10.0)
        try:
            received = b""
            while len(received) < SECRET_BYTES:
                chunk = conn.recv(SECRET_BYTES - len(received))
                if not chunk:
                    return False
                received += chunk
        except OSError:
            return False
        conn.settimeout(None)
        return hmac.compare_digest(received, self.secret)

    def _send_until_closed(self, conn: socket.socket) -> None:
        """Send batches until the replica closes its end (it never writes after the
        secret, so a readable socket means it left: a new pump then connects again)."""
        while not self._stopped.is_set() and not _closed_by_peer(conn):
            batch = self._take(0.5)
            if batch is None:
                continue
            payload = batch.encode()
            try:
                conn.sendall(len(payload).to_bytes(4, "big") + payload)
            except OSError:
                return
            if batch.error is not None:
                return  # the engine is dead: the replica fails its streams and leaves

    def close(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()


def _closed_by_peer(conn: socket.socket) -> bool:
    readable, _, _ = select.select([conn], [], [], 0)
    if not readable:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


async def read_batches(address: tuple[str, int], secret: bytes) -> AsyncIterator[OutputBatch]:
    """Every batch the scheduler sends; ends with ConnectionError when it is gone."""
    import asyncio

    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(secret)
        await writer.drain()
        while True:
            try:
                size = int.from_bytes(await reader.readexactly(4), "big")
                payload = await reader.readexactly(size)
            except asyncio.IncompleteReadError as e:
                raise ConnectionError("the scheduler actor closed its output socket") from e
            yield OutputBatch.decode(payload)
    finally:
        writer.close()
