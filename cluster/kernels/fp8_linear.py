"""Block-scaled FP8 linear ("w8a8 block fp8", DeepSeek-V3's `quant_method: fp8`): the torch
reference and `fp8_linear` / `quantize_activations`, which run it or the Triton kernels in
`fp8_linear_triton.py`.

The weight `[N, K]` is float8_e4m3fn with `weight_scale_inv` `[ceil(N / bn), ceil(K / bk)]`
float32, one scale per `(bn, bk)` block (`weight_block_size`, usually 128 x 128). The
activations `[M, K]` are quantised on the fly, per token and per `bk` columns, to
float8_e4m3fn with one float32 scale each: `scale = max|x_group| / 448` (the amax floored
at `MIN_AMAX`, so an all-zero group quantises to zeros) and `x_q = x / scale`, rounded to
nearest even. Then, accumulating in float32 over the column groups `g`,

    y[m, n] = sum_g (x_q[m, g] . w[n, g]) * x_scale[m, g] * w_scale[n // bn, g]

plus the bias, and `y` is returned in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cluster.kernels.backend import _HAS_TRITON, use_triton
from cluster.kernels.fp8_format import FP8_MAX, MIN_AMAX, triton_takes_group

FP8_COMPUTE_CAPABILITY = (8, 9)  # CUDA compute capability with FP8 tensor cores (Ada, Hopper)


def fp8_compute_supported(device: torch.device | str, block: tuple[int, int] | None = None) -> bool:
    """Whether `device` computes FP8 linears natively: CUDA with compute capability 8.9 or
    more, and Triton installed (and, given the checkpoint's `block`, a column block the
    kernel takes). Elsewhere FP8 checkpoints are read dequantised."""
    device = torch.device(device)
    if device.type != "cuda" or not _HAS_TRITON or not torch.cuda.is_available():
        return False
    if block is not None and not triton_takes_group(block[1], device):
        return False
    return torch.cuda.get_device_capability(device) >= FP8_COMPUTE_CAPABILITY


def quantize_activations_ref(
    x: torch.Tensor,  # [M, K] float
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [M, K] float8_e4m3fn, x_scale [M, ceil(K / group)] float32): torch reference."""
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = padded.abs().amax(dim=-1).clamp(min=MIN_AMAX) / FP8_MAX  # [M, groups]
    quantized = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    x_q = quantized.to(torch.float8_e4m3fn).view(m, groups * group)[:, :k].contiguous()
    return x_q, scale


def fp8_matmul_ref(
    x_q: torch.Tensor,  # [M, K] float8_e4m3fn
    x_scale: torch.Tensor,  # [M, ceil(K / bk)] float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale_inv: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    bias: torch.Tensor | None,  # [N]
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """[M, N] in `out_dtype`: each column group's float32 product times both scales, the
    groups summed in order in float32 (torch reference)."""
    bn, bk = block
    n = weight.shape[0]
    w_scale = weight_scale_inv.float().repeat_interleave(bn, dim=0)[:n]  # [N, groups]
    acc = torch.zeros(x_q.shape[0], n, dtype=torch.float32, device=x_q.device)
    for g in range(x_scale.shape[1]):
        cols = slice(g * bk, (g + 1) * bk)
        part = x_q[:, cols].float() @ weight[:, cols].float().T  # [M, N]
        acc += part * x_scale[:, g : g + 1] * w_scale[None, :, g]
    if bias is not None:
        acc += bias.float()
    return acc.to(out_dtype)


def fp8_linear_ref(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale_inv: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    bias: torch.Tensor | None = None,  # [N]
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """[..., N] in x's dtype: the torch reference of `fp8_linear`."""
    flat = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_activations_ref(flat, block[1])
    out = fp8_matmul_ref(x_q, x_scale, weight, weight_scale_inv, bias, block, x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


def _triton_for(backend: str, device: torch.device, group: int) -> bool:
    """Triton where `backend` asks for it and the kernels take `group`; on CUDA only with
    FP8 tensor cores (the kernel's native float8 dot): the reference on older GPUs."""
    if not use_triton(backend, device) or not triton_takes_group(group, device):
        return False
    return device.type != "cuda" or fp8_compute_supported(device)


def quantize_activations(
    x: torch.Tensor,  # [M, K] float
    group: int = 128,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [M, K] float8_e4m3fn, x_scale [M, ceil(K / group)] float32); see the module."""
    if _triton_for(backend, x.device, group):
        from cluster.kernels.fp8_linear_triton import quantize_activations_triton

        return quantize_activations_triton(x, group)
    return quantize_activations_ref(x, group)


def fp8_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale_inv: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    bias: torch.Tensor | None = None,  # [N]
    block: tuple[int, int] = (128, 128),
    backend: str = "auto",
) -> torch.Tensor:
    """[..., N] in x's dtype: `x @ dequantised(weight).T + bias` computed in FP8 (see the
    module for the exact maths)."""
    if _triton_for(backend, x.device, block[1]):
        from cluster.kernels.fp8_linear_triton import fp8_linear_triton

        return fp8_linear_triton(x, weight, weight_scale_inv, bias, block)
    return fp8_linear_ref(x, weight, weight_scale_inv, bias, block)
