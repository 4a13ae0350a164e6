"""`EngineLoop`: the one step loop of an engine core, on a thread of its own.

Callers on any thread only queue commands (add a request, abort, end one at a stop
string); the loop applies them in order, steps the core while it has work, and hands
each round's outputs to `publish`. Nothing else touches the core while the loop runs, so
a caller never waits for a step. `AsyncLLM` (in-process) and `SchedulerActor` (behind
Ray) both run their core through this class; the offline `LLM` steps in its own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cluster.engine.core import EngineCore
from cluster.engine.messages import EngineCoreOutput
from cluster.engine.request import Request

logger = logging.getLogger(__name__)

# publish(outputs): one round's outputs (its step's, and those of aborts applied first)
Publish = Callable[[list[EngineCoreOutput]], None]
# How long an idle loop sleeps between looks at its core (commands wake it at once).
_IDLE_WAIT_S = 1.0


class EngineLoop:
    def __init__(
        self,
        core: EngineCore,
        publish: Publish,
        on_error: Callable[[BaseException], None] | None = None,
        name: str = "cluster-engine-loop",
    ) -> None:
        self.core = core
        self._publish = publish
        self._on_error = on_error
        self._cv = threading.Condition()
        self._commands: list[tuple[str, Any]] = []
        self._stopped = False
        self.error: BaseException | None = None
        self.step_started: float | None = None  # monotonic start of the running step
        self.step_s_total = 0.0  # every step so far
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- commands (any thread) -----------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a new request; the loop adds it to the core before its next step."""
        self._queue("add", request)

    def abort(self, request_ids: list[str]) -> None:
        self._queue("abort", list(request_ids))

    def finish_by_stop_string(self, request_id: str, stop: str) -> None:
        self._queue("stop", (request_id, stop))

    def _queue(self, kind: str, arg: Any) -> None:
        with self._cv:
            self._commands.append((kind, arg))
            self._cv.notify_all()

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=timeout_s)

    # ---- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(
                        lambda: self._stopped or self._commands or core.has_unfinished_requests(),
                        timeout=_IDLE_WAIT_S,
                    )
                    if self._stopped:
                        return
                    commands, self._commands = self._commands, []
                outputs = self._apply(commands)
                stepped = core.has_unfinished_requests()
                if stepped:
                    self.step_started = started = time.monotonic()
                    outputs += core.step()
                    self.step_s_total += time.monotonic() - started
                    self.step_started = None
                if stepped or outputs:
                    self._publish(outputs)
        except BaseException as e:  # every waiter must hear about it
            logger.exception("the engine loop died")
            self.error = e
            if self._on_error is not None:
                self._on_error(e)

    def _apply(self, commands: list[tuple[str, Any]]) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for kind, arg in commands:
            if kind == "add":
                self.core.add_request(arg)
            elif kind == "abort":
                outputs += self.core.abort_requests(arg)
            else:
                self.core.finish_by_stop_string(*arg)
        return outputs
