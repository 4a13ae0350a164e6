"""Building our C kernels for the CPU they run on, once per machine, and loading them.

A kernel's source (`cpu_attention.c`, `cpu_linear.c`) is compiled with the system's C
compiler (`$CC`, else `cc`, else `gcc`; gcc 12 or later, or clang) for this CPU
(`-march=native`), without contraction of multiplies and adds into FMAs (the kernels
fix their order of operations) and with OpenMP (the runtime torch already loaded). The
library goes to `$CLUSTER_KERNEL_CACHE_DIR` (the engine points it under its cache folder;
default: a folder in the temp dir), named by a hash of the source, the flags and the
CPU's flags, through a temporary file (racing builds are safe), and is loaded with ctypes
(which releases the GIL during a call). Where no compiler is found or the build fails,
`load_library` logs why and returns None: the caller runs its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")
KERNEL_DIR = os.path.dirname(os.path.abspath(__file__))


def kernel_cache_dir() -> str:
    return os.environ.get("CLUSTER_KERNEL_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"cluster-kernels-{os.getuid()}"
    )


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(compiler: str, source: str, path: str) -> None:
    """Compile `source` to `path` (through a temporary file: racing builds are safe)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, source, "-o", tmp], check=True, capture_output=True, text=True
        )
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_library(name: str) -> ctypes.CDLL | None:
    """`<name>.c` of this folder, compiled for this CPU (the first time on this machine)
    and loaded; None (logged) where it cannot be built. Callers cache the result."""
    source = os.path.join(KERNEL_DIR, f"{name}.c")
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: %s runs its torch path", name)
        return None
    with open(source, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join(FLAGS).encode() + _cpu_flags().encode())
    path = os.path.join(kernel_cache_dir(), f"{name}-{key.hexdigest()[:16]}.so")
    try:
        if not os.path.exists(path):
            _build(compiler, source, path)
        return ctypes.CDLL(path)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("the %s kernel did not build, its torch path runs: %s", name, detail)
        return None
