"""Errors the engine's APIs raise to their callers (besides `ValueError` for bad input)."""


class EngineDeadError(RuntimeError):
    """The engine (its loop, or a worker) died: every in-flight request fails with this,
    and every later one is refused with it."""
