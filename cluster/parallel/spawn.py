"""Starting local rank processes: a free port for their rendezvous, and starting them
without re-running the parent's script."""

from __future__ import annotations

import contextlib
import socket
import sys
import types
from collections.abc import Iterator


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
