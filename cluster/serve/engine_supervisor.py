"""`EngineSupervisor`: a replica's engine, restarted in place when it dies.

When a worker or the scheduler actor dies (killed, out of memory, its node gone) the
engine fails the steps in flight at once (`EngineClient`): the streams it was serving end
with a 503, and the supervisor starts a new engine in the replica's placement group (the
same bundles). A health check that finds a dead worker or a stalled step does the same;
one that merely times out does not (a loaded engine answers late), and Serve decides.

Restarting in place keeps what did not die: the replica's HTTP server, its place in the
routers, its tokenizer. The new workers read the weights through the page cache, and serve
eagerly while their graphs compile on a thread (`compile.background`; the graphs load
from inductor's disk cache, but dynamo traces the forward again, 4-9 s on 2 cores).
Requests that arrive meanwhile wait for the new engine (`ready`), and a request the engine
died under before it produced anything is sent once more, to the new engine (`LLMServer`).
Timings against Serve's replacement: `benchmarks/results/fleet.md`.

After `max_restarts` restarts within `RESTART_WINDOW_S`, or when a restart fails, the
engine stays dead: requests get a 503 and the health check fails, so Serve replaces the
replica.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import deque
from collections.abc import Callable

from cluster.actors.client import EngineClient
from cluster.engine.errors import EngineDeadError

logger = logging.getLogger("ray.serve")

# The window over which `max_restarts` counts restarts.
RESTART_WINDOW_S = 600.0

# Builds an engine that calls the given function (with the reason) when it dies; the flag
# says whether it replaces a dead one (a restart in place).
EngineFactory = Callable[[Callable[[str], object], bool], EngineClient]


class EngineSupervisor:
    def __init__(self, start: EngineFactory, max_restarts: int) -> None:
        self._start = start
        self.max_restarts = max_restarts
        self.engine = start(self.engine_failed, False)
        self.num_restarts = 0
        self._restarted_at: deque[float] = deque()
        self._restart: asyncio.Task | None = None
        self._failure: str | None = None  # why the engine stays dead

    @property
    def restarting(self) -> bool:
        return self._restart is not None and not self._restart.done()

    @property
    def dead(self) -> str | None:
        """Why the engine is dead for good (None while it serves or is being restarted)."""
        if self.restarting:
            return None
        if self._failure is not None:
            return self._failure
        return self.engine.error

    def engine_failed(self, reason: str) -> bool:
        """Restart the engine (unless a restart is running); False when it may not be
        restarted again. Called on the replica's event loop."""
        if self.restarting:
            return True
        now = time.monotonic()
        while self._restarted_at and now - self._restarted_at[0] > RESTART_WINDOW_S:
            self._restarted_at.popleft()
        if len(self._restarted_at) >= self.max_restarts:
            self._failure = (
                f"{reason} (not restarted: {len(self._restarted_at)} restarts in the last "
                f"{RESTART_WINDOW_S:.0f} s, server.max_engine_restarts={self.max_restarts})"
            )
            logger.error("engine %s died: %s", self.engine.engine_id, self._failure)
            return False
        self._restarted_at.append(now)
        # A fresh context: the restart is no request's child and outlives whichever
        # request or health check noticed the failure (see `client.detached`).
        loop = asyncio.get_running_loop()
        self._restart = loop.create_task(self._replace(reason), context=contextvars.Context())
        return True

    async def ready(self) -> EngineClient:
        """The engine, once a restart in progress has finished; raises EngineDeadError
        when it is dead for good."""
        if self.restarting:
            assert self._restart is not None
            await asyncio.shield(self._restart)
        if self.dead is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead}")
        return self.engine

    async def _replace(self, reason: str) -> None:
        dead, started = self.engine, time.monotonic()
        logger.warning(
            "engine %s failed (%s); restarting it in place (restart %d of at most %d in %.0f s)",
            dead.engine_id,
            reason,
            len(self._restarted_at),
            self.max_restarts,
            RESTART_WINDOW_S,
        )
        dead.fail(reason)  # its streams end now, whatever noticed the failure
        # The new engine starts while the dead one stops: its workers take their bundles'
        # CPUs (or GPUs) as the dead engine's ranks give them back.
        stopped = asyncio.ensure_future(asyncio.to_thread(dead.stop_actors))
        try:
            self.engine = await asyncio.to_thread(self._start, self.engine_failed, True)
        except Exception as e:
            await stopped
            self._failure = f"{reason}; its restart failed: {type(e).__name__}: {e}"
            logger.exception("engine restart failed")
            return
        await stopped
        self.num_restarts += 1
        logger.warning(
            "engine %s replaced the dead %s in %.1f s",
            self.engine.engine_id,
            dead.engine_id,
            time.monotonic() - started,
        )

    def shutdown(self) -> None:
        if self._restart is not None:
            self._restart.cancel()
        self.engine.shutdown()
