"""A memory plan from a model's `config.json` alone: what one rank of a layout holds
(weights, KV bytes per token, recurrent states, an activation reserve) and how many
tokens of KV fit beside it, before a byte of the checkpoint is read.

The weights per rank come from `cluster.models.weight_count` (the shapes our model
classes build; FP8 checkpoints' linear weights and experts at one byte plus their block
scales, as the engine keeps them on FP8 GPUs), checked against a meta-device
instantiation on real configurations (DeepSeek-V3, Qwen3-235B-A22B) by
`tests/test_memory_plan.py`.

`cluster plan MODEL` prints the plan; the worker runs it before loading and refuses a
layout whose weights do not fit, with the same table in the error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.config.architectures import architecture_of
from cluster.models.weight_count import stage_weights, state_bytes_per_request

GIB = 2**30


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's ranks (every TP rank of a stage holds the same amount)."""

    pp_rank: int
    layers: tuple[int, int]  # [start, end) decoder layers
    weight_bytes: int
    kv_bytes_per_token: int
    state_bytes: int  # recurrent states of `max_num_seqs` requests (hybrid models)
    activation_bytes: int  # an estimate of the forward's peak at the largest step
    budget_bytes: int  # the device memory the engine may use on one rank

    @property
    def kv_bytes(self) -> int:
        return self.budget_bytes - self.weight_bytes - self.state_bytes - self.activation_bytes

    @property
    def kv_tokens(self) -> int:
        per_token = max(1, self.kv_bytes_per_token)
        return max(0, self.kv_bytes) // per_token


@dataclass(frozen=True)
class MemoryPlan:
    architecture: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    weights: str  # "fp8 (block 128x128)" or the dtype name
    kv_cache_dtype: str
    stages: tuple[StagePlan, ...]
    min_kv_tokens: int  # what must fit beside the weights (one max_model_len sequence)

    @property
    def fits(self) -> bool:
        return all(s.kv_tokens >= self.min_kv_tokens for s in self.stages)

    def table(self) -> str:
        head = (
            f"{self.architecture}: tensor_parallel_size={self.tensor_parallel_size}, "
            f"pipeline_parallel_size={self.pipeline_parallel_size}, weights {self.weights}, "
            f"KV {self.kv_cache_dtype}\n"
            "| stage | layers | weights GiB | states GiB | activations GiB (est.) | "
            "budget GiB | KV bytes/token | KV tokens | fits |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---|\n"
        )
        rows = [
            f"| {s.pp_rank} | {s.layers[0]}-{s.layers[1] - 1} | {s.weight_bytes / GIB:.2f} | "
            f"{s.state_bytes / GIB:.2f} | {s.activation_bytes / GIB:.2f} | "
            f"{s.budget_bytes / GIB:.2f} | {s.kv_bytes_per_token:,} | {s.kv_tokens:,} | "
            f"{'yes' if s.kv_tokens >= self.min_kv_tokens else 'NO'} |"
            for s in self.stages
        ]
        verdict = (
            "fits"
            if self.fits
            else f"does NOT fit (each rank needs room for at least {self.min_kv_tokens:,} "
            "tokens of KV: one max_model_len sequence)"
        )
        return head + "\n".join(rows) + f"\nper rank; the layout {verdict}"


def memory_plan(
    config: Any,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    *,
    budget_bytes: int,
    dtype_bytes: int = 2,
    fp8_block: tuple[int, int] | None = None,
    kv_dtype_bytes: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    num_speculative_tokens: int = 0,
    mtp_layers: int = 0,
    pipeline_layer_partition: tuple[int, ...] | None = None,
    dtype_name: str = "bfloat16",
    kv_dtype_name: str | None = None,
) -> MemoryPlan:
    """The plan of a `tensor_parallel_size` x `pipeline_parallel_size` layout whose ranks
    may each use `budget_bytes`. `fp8_block`: the checkpoint's FP8 block when its linear
    weights stay FP8 (None: they are held in the model dtype)."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    kv_dtype_bytes = kv_dtype_bytes or dtype_bytes
    hidden, vocab = int(config.hidden_size), int(config.vocab_size)
    max_len = int(max_model_len or getattr(config, "max_position_embeddings", None) or 4096)
    snapshots = 1 + num_speculative_tokens
    stages = []
    for pp_rank in range(pp):
        weights, kv, layers = stage_weights(
            config, tp, pp, pp_rank, pipeline_layer_partition, mtp_layers
        )
        widest = max((r for r, _, n in weights.linears if n == 1), default=hidden)
        tokens = max_num_batched_tokens
        activations = tokens * dtype_bytes * (6 * hidden + 3 * widest)
        top_k = int(getattr(config, "num_experts_per_tok", None) or 0)  # experts' intermediates
        activations += (
            tokens * top_k * 3 * int(getattr(config, "moe_intermediate_size", None) or 0) // tp
        )
        if pp_rank == pp - 1:  # float32 logits of every row a step samples
            activations += max_num_seqs * snapshots * vocab * 4
        state = max_num_seqs * snapshots
        state *= state_bytes_per_request(config, tp, layers, dtype_bytes)
        stages.append(
            StagePlan(
                pp_rank=pp_rank,
                layers=layers,
                weight_bytes=weights.num_bytes(dtype_bytes, fp8_block),
                kv_bytes_per_token=kv * kv_dtype_bytes,
                state_bytes=state,
                activation_bytes=activations,
                budget_bytes=budget_bytes,
            )
        )
    weights_name = f"fp8 (block {fp8_block[0]}x{fp8_block[1]})" if fp8_block else dtype_name
    return MemoryPlan(
        architecture=architecture_of(config),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        weights=weights_name,
        kv_cache_dtype=kv_dtype_name or dtype_name,
        stages=tuple(stages),
        min_kv_tokens=max_len,
    )
