"""bfloat16 linear layers in C, in oneDNN's order of operations on AVX-512 BF16 CPUs.

oneDNN's bfloat16 product is slow for the few rows of a decode or verification step on
the 2-core AMD EPYC this project measures on: a one-token product over SmolLM2's
layers ran at 17-35 GB/s of weights where the same work in `cpu_linear.c` runs at
30-90 GB/s (weights partly in cache), and is no slower up to 256 rows. The kernel
keeps oneDNN's arithmetic (its header says how: `vdpbf16ps` over input pairs in order, in
K chunks of `onednn_k_block(K)`, one rounding), so on such a CPU it returns oneDNN's bits:
`cluster.kernels.packed_linear` checks that once per weight shape (`reproduces_onednn`
there) and uses this kernel only where it holds. Where oneDNN runs another order (AMX
tiles on Intel Sapphire Rapids, another oneDNN version), it keeps oneDNN.

On CPUs with AVX2 and FMA but no bfloat16 instructions (AMD Zen 3, older Intel), where
torch's oneDNN has no bfloat16 product, the same file builds an AVX2 version with the
same arithmetic (fused multiply-adds of exact products, in the same order): a bfloat16
engine there reads its weights at two bytes each, returns the same bits as on a Zen 4,
and stays batch invariant.

Every output is one thread's and its arithmetic does not depend on the row count, so
the product is batch invariant by construction. `linear_ref` is the torch reference: the
same order emulated in float32 adds, slow, for tests. Built by `cluster.kernels.cpu_build`.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from cluster.kernels.cpu_build import load_library

BLOCK_N = 32  # outputs per packed weight block (cpu_linear.c)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built or this CPU has neither AVX-512
    BF16 nor AVX2 with FMA."""
    lib = load_library("cpu_linear")
    if lib is None or not lib.bf16_linear_available():
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.bf16_linear.restype = None
    lib.bf16_linear.argtypes = [
        ptr, i64, i64, ptr, i64,  # x, rows, inputs, packed weight, outputs
        ptr, ptr, i64, ctypes.c_int,  # bias (or NULL), out, k_block, threads
    ]  # fmt: skip
    return lib


def onednn_k_block(in_features: int) -> int:
    """The inputs per K chunk of oneDNN's bfloat16 product (torch 2.13's oneDNN, AVX-512
    BF16), found by probing it with cancelling products: up to 512 inputs one chunk, up
    to 1024 chunks of 512, above that chunks of 1024."""
    if in_features <= 512:
        return in_features
    return 512 if in_features <= 1024 else 1024


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel can run this weight ([out, in] bfloat16 on a CPU, `in` even)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and load() is not None
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[ceil(out / 32), in / 2, 32, 2] bfloat16: blocks of 32 outputs (zero rows past
    `out`), each with the outputs' two inputs of a pair side by side."""
    out_features, in_features = weight.shape
    padded = -(-out_features // BLOCK_N) * BLOCK_N
    w = weight.detach().new_zeros(padded, in_features)
    w[:out_features] = weight.detach()
    return w.view(padded // BLOCK_N, BLOCK_N, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear(
    x: torch.Tensor,  # [rows, in] bfloat16
    packed: torch.Tensor,  # pack(weight)
    bias: torch.Tensor | None,  # [out] bfloat16
    out_features: int,
) -> torch.Tensor:
    """[rows, out] bfloat16: `x @ weight.T + bias` by the C kernel (`load()` must work)."""
    lib = load()
    assert lib is not None
    x = x.contiguous()
    rows, in_features = x.shape
    if packed.shape[1] * 2 != in_features:
        raise ValueError(f"x has {in_features} inputs, the weight {packed.shape[1] * 2}")
    for name, t in (("x", x), ("bias", bias)):
        if t is not None and t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bfloat16 for the bfloat16 kernel, got {t.dtype}")
    out = x.new_empty(rows, out_features)
    if rows == 0:
        return out
    lib.bf16_linear(
        x.data_ptr(),
        rows,
        in_features,
        packed.data_ptr(),
        out_features,
        None if bias is None else bias.contiguous().data_ptr(),
        out.data_ptr(),
        onednn_k_block(in_features),
        max(1, torch.get_num_threads()),
    )
    return out


def linear_ref(
    x: torch.Tensor,  # [rows, in] bfloat16
    weight: torch.Tensor,  # [out, in] bfloat16
    bias: torch.Tensor | None = None,  # [out]
    k_block: int | None = None,
) -> torch.Tensor:
    """[rows, out] bfloat16: the kernel's arithmetic in torch float32 adds (each pair's odd
    input first, as `vdpbf16ps`; chunks of `k_block` inputs). A test reference: one op per
    input."""
    xf, wf = x.float(), weight.float()
    in_features = x.shape[1]
    k_block = k_block or onednn_k_block(in_features)
    total = None
    for k0 in range(0, in_features, k_block):
        acc = torch.zeros(x.shape[0], weight.shape[0])
        for k in range(k0, min(k0 + k_block, in_features), 2):
            acc = acc + xf[:, k + 1, None] * wf[None, :, k + 1]
            acc = acc + xf[:, k, None] * wf[None, :, k]
        total = acc if total is None else total + acc
    assert total is not None
    if bias is not None:
        total = total + bias.float()
    return total.bfloat16()
