"""Linear layers with weights prepacked for the CPU's bfloat16 units (our C kernel or oneDNN).

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

Where our C kernel (`cluster.kernels.cpu_linear`, AVX-512 BF16) returns oneDNN's bits for
a weight's shape on this CPU, checked once per shape on random data (`reproduces_onednn`),
the weight is packed for it instead: it runs the few rows of decode and verification
steps about twice as fast as oneDNN, and is no slower up to hundreds of rows (AMD EPYC).
Its product is row invariant by construction, so every row count takes it. Elsewhere
(oneDNN on AMX tiles, which round otherwise) the weight is packed for oneDNN. On CPUs
where oneDNN has no bfloat16 product (AVX2 without bfloat16 instructions) the kernel's
AVX2 build is the only packed path, and it replaces `F.linear`'s emulated bfloat16 (its
bits are the AVX-512 BF16 kernel's, so a bfloat16 engine answers the same there).

`linear_ref` (plain `F.linear`) is the reference and the path everywhere else: CUDA,
float32, float16, CPUs with neither, inputs that are not 2-D and autograd (training
never packs). A compiled graph calls the packed product as the opaque
op `cluster::packed_linear`, with the packed weight as a graph input: the graph then runs
the rows as eager steps do, and holds no weight, so inductor can cache it on disk
(`cluster.models.compiled`).
"""

from __future__ import annotations

import functools
import itertools
import logging

import torch
import torch.nn.functional as F

from cluster.kernels import cpu_linear
from cluster.kernels.cpu_isa import cpu_has_amx
from cluster.kernels.library import define_op

logger = logging.getLogger(__name__)

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
    """Whether `weight` ([out, in]) runs faster prepacked: bfloat16 on a CPU with oneDNN's
    bfloat16 support or our C kernel."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and (cpu_can_pack_bf16() or cpu_linear.supports(weight))
    )


def pack_weight(weight: torch.Tensor, kernel: str = "auto") -> torch.Tensor:
    """`weight` ([out, in] bfloat16 on CPU) packed for the faster of our C kernel (a plain
    4-D tensor, where it reproduces oneDNN on this CPU, or where oneDNN has no bfloat16
    product here) and oneDNN (an opaque tensor in its blocked layout); `kernel="onednn"`
    packs for oneDNN in any case (benchmarks compare the two). Only `linear` reads either."""
    if kernel not in ("auto", "onednn"):
        raise ValueError(f"kernel must be 'auto' or 'onednn', got {kernel!r}")
    if kernel == "onednn" and not cpu_can_pack_bf16():
        raise ValueError("kernel='onednn': this torch has no oneDNN bfloat16 product on this CPU")
    weight = weight.detach()
    if (
        kernel == "auto"
        and cpu_linear.supports(weight)
        and (not cpu_can_pack_bf16() or reproduces_onednn(*weight.shape))
    ):
        return cpu_linear.pack(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)


@functools.cache
def reproduces_onednn(out_features: int, in_features: int) -> bool:
    """Whether `cpu_linear` returns oneDNN's packed product bit for bit for weights of this
    shape on this CPU, with and without a bias: checked on random data with enough outputs
    (~2^19 per case) that a different order of operations shows (a K chunk boundary off
    by 64 inputs changed ~1e-4 of the roundings); logged where it does not hold."""
    gen = torch.Generator().manual_seed(out_features * 7919 + in_features)
    rows = max(4, -(-(1 << 19) // out_features))
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
    packed = cpu_linear.pack(weight)
    with torch.no_grad():
        same = all(
            torch.equal(
                cpu_linear.linear(x, packed, b, out_features),
                _onednn_product(x, onednn, b),
            )
            for b in (None, bias)
        )
    if not same:
        logger.info(
            "bfloat16 %dx%d products run in oneDNN: the C kernel rounds otherwise on this CPU",
            out_features,
            in_features,
        )
    return same


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
    return packed_product(x, packed, bias, weight.shape[0])


def packed_product(
    x: torch.Tensor,  # [rows, in]
    packed: torch.Tensor,  # pack_weight(weight)
    bias: torch.Tensor | None,  # [out]
    out_features: int,
) -> torch.Tensor:
    """[rows, out] through the packed weight: our C kernel, or oneDNN (in row blocks on
    AMX CPUs)."""
    if not packed.is_mkldnn:
        return cpu_linear.linear(x, packed, bias, out_features)
    return _onednn_product(x.contiguous(), packed, bias)


def _onednn_product(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if x.shape[0] <= AMX_ROW_BLOCK or not cpu_has_amx():
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.cat(
        [
            torch.ops.mkldnn._linear_pointwise(x[start:end], packed, bias, "none", [], "")
            for start, end in row_blocks(x.shape[0], AMX_ROW_BLOCK)
        ]
    )


def _packed_linear_fake(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


# `packed_product` as one opaque op of a compiled graph
define_op(
    "packed_linear(Tensor x, Tensor packed, Tensor? bias, SymInt out_features) -> Tensor",
    packed_product,
    _packed_linear_fake,
)
