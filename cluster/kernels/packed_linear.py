"""Linear layers with weights prepacked for the CPU's bfloat16 units (oneDNN).

`F.linear` on a plain `[out, in]` bfloat16 weight lets oneDNN reorder the weight into
its blocked layout (bfloat16 pairs interleaved along the input dimension) on every call,
which reads and writes the whole weight again: on the 2-core AMD EPYC this project
measures on, a one-token product over a weight too large for the caches ran at about
12 GB/s plainly and about 22 GB/s prepacked. Packing once at load time leaves only the
product. The packed product's rows are bitwise equal to `F.linear`'s (`tests/test_packed_linear.py`
checks it on the machine it runs on), so packing changes speed, never results.

Row blocks: with AVX-512 BF16 (AMD Zen 4) a row's result does not depend on the row
count, but oneDNN's AMX kernels (Intel Sapphire Rapids and later) round a few rows
differently once a product has more than 32 rows. On a CPU with AMX the packed product
therefore runs in blocks of at most `AMX_ROW_BLOCK` rows (never a block of one row, which
oneDNN computes as a matrix-vector product): every row then comes out as it would in a
two-row product, which batch invariance needs. Decode and verification steps are within
one block; a long prefill pays a few more calls.

`linear_ref` (plain `F.linear`) is the reference and the path everywhere else: CUDA,
float32, float16, CPUs without oneDNN's bfloat16 support, inputs that are not 2-D and
autograd (training never packs). A compiled graph calls the packed product as the opaque
op `cluster::packed_linear`, with the packed weight as a graph input: the graph then runs
the rows as eager steps do, and holds no weight, so inductor can cache it on disk
(`cluster.models.compiled`).
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

from cluster.kernels.cpu_isa import cpu_has_amx

# The row count oneDNN tunes the packed layout for; decode and verification steps are
# a few rows, and the layout serves every row count.
PACK_ROWS_HINT = 2
# The most rows one AMX product takes with every row rounded as in a two-row product.
AMX_ROW_BLOCK = 32


@functools.cache
def cpu_can_pack_bf16() -> bool:
    """Whether this torch has oneDNN with bfloat16 support on this CPU."""
    return bool(
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def row_blocks(rows: int, block: int) -> list[tuple[int, int]]:
    """`[start, end)` blocks of at most `block` rows covering `rows`, none of one row
    (unless `rows` is 1): a 1-row remainder takes a row from the block before it."""
    bounds = [*range(0, rows, block), rows]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        bounds[-2] -= 1
    return list(itertools.pairwise(bounds))


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
    """[rows, out]: `x @ weight.T + bias`, through the packed weight when there is one
    (in a compiled graph as the opaque op `cluster::packed_linear`)."""
    if packed is None or x.dim() != 2 or (torch.is_grad_enabled() and x.requires_grad):
        return linear_ref(x, weight, bias)
    if torch.compiler.is_compiling():
        return torch.ops.cluster.packed_linear(x, packed, bias, weight.shape[0])
    return packed_product(x, packed, bias)


def packed_product(
    x: torch.Tensor,  # [rows, in]
    packed: torch.Tensor,  # pack_weight(weight)
    bias: torch.Tensor | None,  # [out]
) -> torch.Tensor:
    """[rows, out] through the packed weight, in row blocks on AMX CPUs."""
    x = x.contiguous()
    if x.shape[0] <= AMX_ROW_BLOCK or not cpu_has_amx():
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.cat(
        [
            torch.ops.mkldnn._linear_pointwise(x[start:end], packed, bias, "none", [], "")
            for start, end in row_blocks(x.shape[0], AMX_ROW_BLOCK)
        ]
    )


@torch.library.custom_op("cluster::packed_linear", mutates_args=())
def _packed_linear_op(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """`packed_product` as one opaque op of a compiled graph."""
    return packed_product(x, packed, bias)


@_packed_linear_op.register_fake
def _(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)
