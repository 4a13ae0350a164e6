"""Run a function on several local ranks (spawned processes) and collect the results.

Used for in-process tensor parallelism on one machine (tests, benchmarks, the
offline engine). The rendezvous address takes a free port found at run time.
"""

from __future__ import annotations

import contextlib
import io
import socket
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def main_script_hidden() -> Iterator[None]:
    """While processes start inside this block, they do not re-run the parent's script.

    A spawned process normally imports the parent's `__main__` again (as `__mp_main__`),
    so a script that builds a multi-rank engine at module level, without an
    `if __name__ == "__main__":` guard, would build it again in every rank and die. Our
    ranks' entry points live in this package and need nothing from the script, so
    multiprocessing is shown an empty `__main__` while it records what to prepare.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _run_rank(
    fn: Callable[..., Any], rank: int, init_method: str, args: tuple, results: Any
) -> None:
    try:
        # Serialized to bytes: tensors sent through shared memory would vanish with this process.
        buffer = io.BytesIO()
        torch.save(fn(rank, init_method, *args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report every failure to the parent, whatever it is
        results.put((rank, False, traceback.format_exc()))


def spawn_ranks(
    fn: Callable[..., Any], world_size: int, args: tuple = (), timeout_s: float = 600.0
) -> list[Any]:
    """Call `fn(rank, init_method, *args)` in `world_size` processes; return results by rank.

    `fn` must be importable (a module-level function). A failure on any rank raises
    `RuntimeError` carrying that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_run_rank, args=(fn, rank, init_method, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [outputs[r] for r in range(world_size)]
