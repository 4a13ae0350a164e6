"""Which matrix units oneDNN uses on this CPU, for the choices batch invariance depends on.

On AMX CPUs (Intel Sapphire Rapids and later) oneDNN's bfloat16 products round a row
differently depending on the shape around it: a linear layer's rows once a product has
more than 32 rows (`cluster.kernels.packed_linear` then runs blocks of 32 rows), and
an attention row's weighted sum of values with the zero-padded context length (CPU
attention runs no oneDNN product: `cluster.kernels.cpu_attention`, or the torch path's
float64 sums). Inductor's
products have the first problem too, so compiled graphs there call the packed products
as an opaque op (`cluster::packed_linear`) instead of inductor's. With AVX-512 BF16
alone (AMD Zen 4) none of this happens. (`cluster.config.dtypes` reads the CPU flags
for its own question; kernels import nothing of ours, hence this small reader.)
"""

from __future__ import annotations

from typing import Final


def _read_amx_flag() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any("amx_bf16" in line.split() for line in f if line.startswith("flags"))
    except OSError:
        return False


# Read once, at import: a compiled graph then reads a constant (no file access to trace).
_HAS_AMX: Final[bool] = _read_amx_flag()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX bfloat16 tiles (which oneDNN then uses)."""
    return _HAS_AMX
