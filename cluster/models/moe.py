"""Sparse mixture-of-experts MLP (Qwen3-MoE's): a router picks the top-k experts of each
token, each expert is a SiLU-gated MLP, and a token's output is the routing-weighted sum
of its experts' outputs.

Tensor parallelism splits every expert's intermediate dimension across the TP ranks
(each rank holds a slice of every expert, as a row/column-parallel MLP does), so the
ranks' partial sums are all-reduced once per block and no token moves between ranks.
Expert parallelism (`expert_parallel_size` = the TP size) instead gives each rank whole
experts and sends tokens to them (`cluster.models.expert_parallel`); the block's
all-reduce is the same.

The experts run fused (`cluster.kernels.fused_moe`): the (token, expert) pairs sorted by
expert, then grouped GEMMs on CUDA (Triton) and one matmul per expert over contiguous rows
on CPU, as one opaque op inside compiled graphs (no data-dependent shape escapes it).
`experts_by_expert` is the reference in transformers' order of computation.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cluster.kernels.fp8_format import FP8Experts
from cluster.kernels.fused_moe import fused_moe
from cluster.kernels.library import define_op
from cluster.models.expert_parallel import expert_parallel_experts
from cluster.parallel import ParallelState, ReplicatedLinear
from cluster.parallel.comm import all_reduce
from cluster.parallel.linear import divide
from cluster.parallel.weights import TensorLike, copy_shard

# `...mlp.experts.7.gate_proj.weight` -> ("...mlp", 7, "gate")
_EXPERT_TENSOR = re.compile(r"^(.*)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def experts_by_expert(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    top_ids: torch.Tensor,  # [num_tokens, top_k] int64
    top_weights: torch.Tensor,  # [num_tokens, top_k], x's dtype
) -> torch.Tensor:
    """[num_tokens, hidden]: every expert over the tokens routed to it (transformers' order
    of computation)."""
    out = torch.zeros_like(x)
    for expert in top_ids.unique().tolist():
        token, slot = torch.where(top_ids == expert)
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * top_weights[token, slot, None]
        out.index_add_(0, token, y)
    return out


def _fused_moe_op(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_ids: torch.Tensor,
    top_weights: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    block: list[int] | None,
) -> torch.Tensor:
    fp8 = None if block is None else FP8Experts(w13_scale, w2_scale, (block[0], block[1]))
    return fused_moe(x, w13, w2, top_ids, top_weights, fp8)


def _fused_moe_fake(x, w13, w2, top_ids, top_weights, w13_scale, w2_scale, block):
    return torch.empty_like(x)


# Opaque to the compiler: the CPU path's per-expert row counts are data, not shapes.
define_op(
    "fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor top_ids, Tensor top_weights, "
    "Tensor? w13_scale, Tensor? w2_scale, SymInt[]? block) -> Tensor",
    _fused_moe_op,
    _fused_moe_fake,
)


class SparseMoeBlock(nn.Module):
    """Router (`gate`), then the experts. `w13` / `w2` hold every expert's TP slice, or,
    with expert parallelism (`state.ep_size > 1`), this rank's whole experts from
    `first_expert` on (`cluster.models.expert_parallel`). Qwen3-MoE's routing (softmax,
    top-k, optionally renormalised); `route` is what other families change."""

    def __init__(
        self, config: Any, state: ParallelState, dtype: torch.dtype, num_experts: int | None = None
    ) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        self.state = state
        self.top_k = int(config.num_experts_per_tok)
        self.norm_topk_prob = bool(config.norm_topk_prob)
        num_experts = num_experts or int(config.num_experts)
        hidden = int(config.hidden_size)
        self.intermediate = int(config.moe_intermediate_size)
        self.expert_parallel = state.ep_size > 1
        if self.expert_parallel:
            experts = divide(num_experts, state.ep_size, "the number of experts")
            self.first_expert, local = state.tp_rank * experts, self.intermediate
        else:
            self.first_expert, experts = 0, num_experts
            local = divide(self.intermediate, state.tp_size, "moe_intermediate_size")
        self.gate = ReplicatedLinear(hidden, num_experts, state, dtype=dtype)
        self.w13 = nn.Parameter(
            torch.empty(experts, 2 * local, hidden, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(experts, hidden, local, dtype=dtype), requires_grad=False
        )
        self.fp8_block: tuple[int, int] | None = None  # see `use_fp8_experts`
        self._declare_shards()

    def _local(self, expert: int) -> int | None:
        """The expert's index in `w13` / `w2`, or None when another rank holds it."""
        index = expert - self.first_expert
        return index if 0 <= index < self.w2.shape[0] else None

    def _copy_expert(
        self, param: nn.Parameter, loaded: TensorLike, expert: int, dim: int, part: int | None
    ) -> None:
        """This rank's slice of one expert's checkpoint tensor (a weight or its FP8 block
        scales: `dim` is the intermediate dimension) into the expert's place in `param`,
        into gate's or up's half of it for w13 (`part` 0 or 1)."""
        index = self._local(expert)
        if index is None:
            return
        dst = param.data[index]
        local = dst.shape[dim] if part is None else dst.shape[0] // 2
        if part is not None:
            dst = dst.narrow(0, part * local, local)
        start = 0 if self.expert_parallel else self.state.tp_rank * local
        full = local if self.expert_parallel else local * self.state.tp_size
        copy_shard(dst, loaded, dim, start, local, full=full)

    def _load_w13(self, param: nn.Parameter, loaded: TensorLike, shard: tuple[int, int]) -> None:
        self._copy_expert(param, loaded, shard[0], 0, shard[1])  # part 0: gate, 1: up

    def _load_w2(self, param: nn.Parameter, loaded: TensorLike, expert: int) -> None:
        self._copy_expert(param, loaded, expert, 1, None)

    def use_fp8_experts(self, block: tuple[int, int]) -> None:
        """Hold the experts as float8_e4m3fn with the checkpoint's block scales
        (`w13_scale_inv`, `w2_scale_inv`; FP8 checkpoints where the device computes in
        FP8). A rank's slice of the intermediate dimension must be whole blocks."""
        if self.fp8_block is not None:
            return
        bn, bk = block
        experts, two_local, hidden = self.w13.shape
        local = two_local // 2
        sliced = not self.expert_parallel and self.state.tp_size > 1
        if sliced and (local % bn or local % bk):
            raise ValueError(
                f"moe_intermediate_size={self.intermediate} over tensor_parallel_size="
                f"{self.state.tp_size} gives {local} rows per rank, not whole {bn}x{bk} FP8 "
                "blocks; use a TP size whose shards are whole blocks, or expert parallelism"
            )
        shapes = {
            "w13": (two_local, hidden),
            "w2": (hidden, local),
            "w13_scale_inv": (2 * -(-local // bn), -(-hidden // bk)),
            "w2_scale_inv": (-(-hidden // bn), -(-local // bk)),
        }
        for name, shape in shapes.items():
            dtype = torch.float32 if name.endswith("scale_inv") else torch.float8_e4m3fn
            empty = torch.empty(experts, *shape, dtype=dtype, device=self.w13.device)
            setattr(self, name, nn.Parameter(empty, requires_grad=False))
        self._declare_shards()
        self.fp8_block = block

    def _declare_shards(self) -> None:
        """Loaders, and what a checkpoint must provide (other ranks' experts are skipped)."""
        mine = range(self.first_expert, self.first_expert + self.w2.shape[0])
        for name in ("w13", "w13_scale_inv"):
            if hasattr(self, name):
                getattr(self, name).weight_loader = self._load_w13
                getattr(self, name).checkpoint_shards = {(e, j) for e in mine for j in (0, 1)}
        for name in ("w2", "w2_scale_inv"):
            if hasattr(self, name):
                getattr(self, name).weight_loader = self._load_w2
                getattr(self, name).checkpoint_shards = set(mine)

    def _fp8(self) -> FP8Experts | None:
        if self.fp8_block is None:
            return None
        return FP8Experts(self.w13_scale_inv, self.w2_scale_inv, self.fp8_block)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([num_tokens, top_k] expert ids, their weights in x's dtype)."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [num_tokens, experts]
        top_weights, top_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return top_ids, top_weights.to(x.dtype)

    def experts(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the routed experts' outputs ([num_tokens, hidden])."""
        top_ids, top_weights = self.route(x)
        fp8 = self._fp8()
        if self.expert_parallel:
            args = (x, self.w13, self.w2, top_ids, top_weights, self.state, fp8)
            return expert_parallel_experts(*args)
        if torch.compiler.is_compiling():
            scales = (None, None, None) if fp8 is None else (*fp8[:2], list(fp8.block))
            op = torch.ops.cluster.fused_moe
            return op(x, self.w13, self.w2, top_ids, top_weights, *scales)
        return fused_moe(x, self.w13, self.w2, top_ids, top_weights, fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.experts(x), self.state)


def expert_checkpoint_shard(name: str) -> tuple[str, object] | None:
    """`...mlp.experts.E.{gate,up,down}_proj.weight` -> (`...mlp.w13`, (E, 0 | 1)) or
    (`...mlp.w2`, E); None for any other tensor."""
    match = _EXPERT_TENSOR.match(name)
    if match is None:
        return None
    prefix, expert, which = match.group(1), int(match.group(2)), match.group(3)
    if which == "down":
        return f"{prefix}.w2", expert
    return f"{prefix}.w13", (expert, 0 if which == "gate" else 1)
