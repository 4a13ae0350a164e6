"""Linear layers with weights prepacked for the CPU's bfloat16 units (oneDNN).

`F.linear` on a plain `[out, in]` bfloat16 weight lets oneDNN reorder the weight into
its blocked layout (bfloat16 pairs interleaved along the input dimension) on every call,
which reads and writes the whole weight again: on the 2-core AMD EPYC this project
measures on, a one-token product over a weight too large for the caches ran at about
12 GB/s plainly and about 22 GB/s prepacked. Packing once at load time leaves only the
product. The packed product's rows are bitwise equal to `F.linear`'s at every row count
(`tests/test_packed_linear.py` checks it on the machine it runs on), so packing changes
speed, never results.

`linear_ref` (plain `F.linear`) is the reference and the path everywhere else: CUDA,
float32, float16, CPUs without oneDNN's bfloat16 support, inputs that are not 2-D,
autograd (training never packs), and compiled graphs (inductor, freezing the weights,
packs them the same way itself: `cluster.models.compiled`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The row count oneDNN tunes the packed layout for; decode and verification steps are
# a few rows, and the layout serves every row count.
PACK_ROWS_HINT = 2


@functools.cache
def cpu_can_pack_bf16() -> bool:
    """Whether this torch has oneDNN with bfloat16 support on this CPU."""
    return bool(
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` ([out, in]) runs faster prepacked: bfloat16 on a CPU with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and cpu_can_pack_bf16()
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in] bfloat16 on CPU) in oneDNN's blocked layout (an opaque tensor
    that only `linear` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear(
    x: torch.Tensor,  # [rows, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
    packed: torch.Tensor | None = None,  # pack_weight(weight), or None
) -> torch.Tensor:
    """[rows, out]: `x @ weight.T + bias`, through the packed weight when there is one."""
    if (
        packed is None
        or x.dim() != 2
        or torch.compiler.is_compiling()  # inductor packs frozen weights itself
        or (torch.is_grad_enabled() and x.requires_grad)
    ):
        return linear_ref(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
