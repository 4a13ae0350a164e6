"""Tensor-parallel linear layers (Megatron layout).

Each layer allocates only its rank's shard and owns exactly one piece of
sharding knowledge: its `placement`, which says where this rank's slice of a full
checkpoint tensor goes (its `weight_loader` copies it). Weights are
`[out_features, in_features]` as in `nn.Linear`.

FP8 checkpoints on FP8 hardware: `use_fp8_weight` makes a layer hold its weight as
float8_e4m3fn with block scales (`cluster.parallel.fp8_weights`) and compute through
`cluster.kernels.fp8_linear`.
"""

from __future__ import annotations

import torch
from torch import nn

from cluster.kernels.fp8_linear import fp8_linear
from cluster.kernels.packed_linear import can_pack, linear, pack_weight
from cluster.parallel.comm import all_gather, all_reduce
from cluster.parallel.fp8_weights import to_fp8
from cluster.parallel.state import ParallelState
from cluster.parallel.weights import Shard, TensorLike, copy_placed


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}"
        )
    return numerator // denominator


class LinearBase(nn.Module):
    """Holds the local weight `[out_local, in_local]` and optional bias; `tp_dim` is the
    split dim."""

    tp_dim: int | None = None

    def __init__(
        self,
        in_local: int,
        out_local: int,
        bias: bool,
        state: ParallelState,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.state = state
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.weight = nn.Parameter(
            torch.empty(out_local, in_local, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed_weight: torch.Tensor | None = None  # see `pack`
        # False where the model reads the weight as a matrix instead of calling the layer:
        # it then stays dequantised in an FP8 checkpoint.
        self.fp8_allowed = True
        self.weight_block: tuple[int, int] | None = None  # FP8 block, see `use_fp8_weight`

    def use_fp8_weight(self, block: tuple[int, int]) -> None:
        """Hold the weight as float8_e4m3fn plus a float32 `weight_scale_inv` per `block`
        of it (FP8 checkpoints on FP8 hardware); `forward` then runs `fp8_linear`."""
        to_fp8(self, block)

    def pack(self, kernel: str = "auto") -> None:
        """Prepack the loaded weight for this CPU's bfloat16 units, where that pays
        (`cluster.kernels.packed_linear`, which `kernel` goes to); inference only, after
        the last weight is loaded."""
        self.packed_weight = pack_weight(self.weight, kernel) if can_pack(self.weight) else None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[num_tokens, in_local] -> [num_tokens, out_local] on this rank's shard."""
        if self.weight_block is not None:
            scale = self.weight_scale_inv
            return fp8_linear(x, self.weight, scale, bias, self.weight_block)
        return linear(x, self.weight, bias, self.packed_weight)

    def placement(self, shape: tuple[int, ...], shard_id: object = None) -> Shard:
        """Where this rank's slice of a checkpoint tensor goes in a parameter of `shape`
        (the weight's or the bias'); `shard_id` names a part of a fused layer."""
        dim = self.tp_dim if self.tp_dim is not None and self.tp_dim < len(shape) else None
        if dim is None:
            return Shard()
        shard = shape[dim]
        return Shard(dim, 0, shard, self.tp_rank * shard, shard * self.tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded: TensorLike, shard_id: object = None
    ) -> None:
        copy_placed(param.data, loaded, self.placement(tuple(param.shape), shard_id))


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        state: ParallelState,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, state, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; `gather_output` concatenates them back."""

    tp_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        state: ParallelState,
        bias: bool = False,
        gather_output: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        out_local = divide(out_features, state.tp_size, "out_features")
        super().__init__(in_features, out_local, bias, state, dtype)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)  # [num_tokens, out_local]
        return all_gather(y, self.state, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up); `shard_id` picks the part."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        state: ParallelState,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), state, bias, dtype=dtype)

    def placement(self, shape: tuple[int, ...], shard_id: object = None) -> Shard:
        if not isinstance(shard_id, int):
            raise ValueError("MergedColumnParallelLinear needs a shard_id (which output part)")
        part_local = self.output_sizes[shard_id] // self.tp_size
        offset_local = sum(self.output_sizes[:shard_id]) // self.tp_size
        full = self.output_sizes[shard_id]
        return Shard(0, offset_local, part_local, self.tp_rank * part_local, full)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections, grouped-query aware.

    Query heads are split across ranks. KV heads are split when the TP size divides
    them; when the TP size is a multiple of them, each KV head is replicated on
    `tp_size // num_kv_heads` consecutive ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        state: ParallelState,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        tp = state.tp_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads % tp == 0:
            self.num_kv_heads, self.kv_replicas = num_kv_heads // tp, 1
        elif tp % num_kv_heads == 0:
            self.num_kv_heads, self.kv_replicas = 1, tp // num_kv_heads
        else:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide num_key_value_heads={num_kv_heads} "
                "or be a multiple of it"
            )
        out_local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out_local, bias, state, dtype)
        self.gather_output = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def placement(self, shape: tuple[int, ...], shard_id: object = None) -> Shard:
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
            full = size * self.tp_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
            full = size * (self.tp_size // self.kv_replicas)  # every KV head once
        else:
            raise ValueError(
                f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}"
            )
        return Shard(0, offset, size, rank * size, full)


class RowParallelLinear(LinearBase):
    """Input features split across ranks (the input is already split); outputs all-reduced.

    The bias is added once, on TP rank 0, before the reduction.
    """

    tp_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        state: ParallelState,
        bias: bool = False,
        reduce_results: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        in_local = divide(in_features, state.tp_size, "in_features")
        super().__init__(in_local, out_features, bias, state, dtype)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y, self.state) if self.reduce_results else y


def pack_linears(module: nn.Module, kernel: str = "auto") -> int:
    """Prepack every linear layer's and LM head's weight in `module` where that pays
    (bfloat16 on a CPU with oneDNN); returns how many were packed. `kernel`: "auto" (our C
    kernel where it reproduces oneDNN, see `pack_weight`) or "onednn" (benchmarks)."""
    packed = 0
    for m in module.modules():
        if hasattr(m, "pack") and hasattr(m, "packed_weight"):
            m.pack(kernel)
            packed += m.packed_weight is not None
    return packed
