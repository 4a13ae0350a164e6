"""A float32 row sum that adds in the order ATen's CPU `torch.sum` adds, written as
torch ops, so a compiled graph sums a row exactly as the eager op (and transformers) do.

Why: RMSNorm's `mean(x**2)` is a float32 sum of a few hundred to a few thousand squares.
Inductor generates its own reduction loop (one vector accumulator, then a lane tree),
ATen adds in another order, and where one activation dwarfs the rest (late layers of
SmolLM2 carry values near 25,000) the two sums can differ in their last bit. One bit of
the variance moves the bfloat16 rounding of a few normalised values, and by the last
layer a compiled forward's logits differed from eager's by up to 0.8: greedy output then
diverged from transformers' at the first near-tie ("What is the capital of France?"
answered "L'Étoile..." compiled, "The capital of France is Paris." eager).

ATen's order (`aten/src/ATen/native/cpu/SumKernel.cpp`, contiguous inner reduction):
the row is read as vectors of `width` floats; vector `4 * i + k` goes to accumulator `k`
(four of them, for instruction-level parallelism), each accumulator adding its vectors
in order, in chunks of 16 whose sums are added in a cascade; vectors left over after the
last group of four go to accumulator 0; then accumulators 1, 2, 3 are added to 0 in
turn; finally a float starting at 0 takes the scalars past the last whole vector, then
the lanes of the accumulated vector, one by one. `width` is the float vector width of
the ATen kernels this torch build dispatches to (8 on both CPUs seen so far, AVX-512
ones included), found by `cpu_sum_width`, which checks the emulation against
`torch.sum` on rows built to expose any difference of order.

Every step is an explicit elementwise add on slices, which inductor keeps in order (its
C++ is built without unsafe math: no reassociation, no contraction), so the compiled
sum equals the eager one bit for bit. It costs a few dozen adds per row, fused into the
norm's one generated loop.
"""

from __future__ import annotations

import functools

import torch

ILP = 4  # ATen's accumulators per row
CHUNK = 16  # ATen's cascade: chunk sums of 16 (its minimum chunk; larger rows use larger)
NUM_LEVELS = 4


def _add(acc: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return x if acc is None else acc + x


def _cascade_sum(items: list[torch.Tensor]) -> torch.Tensor | None:
    """`multi_row_sum`: items (each [rows, ILP * width]) added in ATen's cascade."""
    size = len(items)
    level_power = max(4, (size - 1).bit_length() // NUM_LEVELS)  # ATen: CeilLog2(size) / 4
    step = 1 << level_power
    mask = step - 1
    acc: list[torch.Tensor | None] = [None] * NUM_LEVELS
    i = 0
    while i + step <= size:
        for _ in range(step):
            acc[0] = _add(acc[0], items[i])
            i += 1
        for j in range(1, NUM_LEVELS):
            acc[j] = _add(acc[j], acc[j - 1])  # type: ignore[arg-type]
            acc[j - 1] = None
            if i & (mask << (j * level_power)):
                break
    while i < size:
        acc[0] = _add(acc[0], items[i])
        i += 1
    total = acc[0]
    for j in range(1, NUM_LEVELS):
        if acc[j] is not None:
            total = _add(total, acc[j])  # type: ignore[arg-type]
    return total


def aten_row_sum(x: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, d] float32 -> [rows]: each row's sum, added in ATen's CPU order for float
    vectors of `width` lanes (see the module docstring). Rows shorter than one vector
    use `torch.sum` itself (ATen's scalar path)."""
    d = x.shape[1]
    num_vectors = d // width
    if num_vectors == 0:
        return x.sum(-1)
    size_ilp = num_vectors // ILP
    group = ILP * width
    # [rows, ILP * width] each: four vectors side by side, one per accumulator
    items = [x[:, i * group : (i + 1) * group] for i in range(size_ilp)]
    grouped = _cascade_sum(items)
    parts: list[torch.Tensor | None] = [None] * ILP
    if grouped is not None:
        parts = [grouped[:, k * width : (k + 1) * width] for k in range(ILP)]
    for v in range(size_ilp * ILP, num_vectors):
        parts[0] = _add(parts[0], x[:, v * width : (v + 1) * width])
    vector = parts[0]
    for k in range(1, ILP):
        if parts[k] is not None:
            vector = _add(vector, parts[k])  # type: ignore[arg-type]
    assert vector is not None
    total: torch.Tensor | None = None
    for t in range(num_vectors * width, d):
        total = _add(total, x[:, t])
    for lane in range(width):
        total = _add(total, vector[:, lane])
    assert total is not None
    return total


@functools.cache
def cpu_sum_width() -> int | None:
    """The vector width at which `aten_row_sum` reproduces this torch build's CPU
    `torch.sum` bit for bit, or None if no width does (compiled norms then sum in
    inductor's order). Checked once per process on rows where every order differs."""
    gen = torch.Generator().manual_seed(0)
    for width in (8, 16, 4, 32):
        matches = True
        for d in (576, 64 * width + 3 * width + 5, 3 * width + 1):
            x = torch.randn(64, d, generator=gen)
            x[:, 3] *= 5000.0  # one large value per row, as in a late decoder layer
            x = x * x
            with torch.inference_mode():
                if not torch.equal(x.sum(-1), aten_row_sum(x, width)):
                    matches = False
                    break
        if matches:
            return width
    return None
