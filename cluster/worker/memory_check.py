"""The check a worker runs before it loads a weight: does this rank's share of the model
fit the memory it may use? It is `cluster plan`'s computation
(`cluster.models.memory_plan`), and a refusal carries the plan's table."""

from __future__ import annotations

import os

import torch

from cluster.config import EngineConfig
from cluster.kernels.fp8_linear import fp8_compute_supported
from cluster.models.fp8 import block_size_of
from cluster.models.memory_plan import GIB, MemoryPlan, memory_plan
from cluster.parallel import ParallelState


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_for(config: EngineConfig, state: ParallelState, budget_bytes: int) -> MemoryPlan:
    """The memory plan of `config`'s layout with `budget_bytes` per rank, weights stored
    as this rank will store them (FP8 kept where the device computes in FP8)."""
    hf = config.model.hf_config
    spec = config.speculative
    dtype = config.model.torch_dtype
    mtp = spec is not None and spec.draft_method is not None and spec.draft_method.name == "mtp"
    mtp_layers = 0
    if mtp:
        mtp_layers = int(
            getattr(hf, "num_nextn_predict_layers", None)
            or getattr(hf, "mtp_num_hidden_layers", None)
            or 1
        )
    block = block_size_of(hf)
    fp8 = block if block is not None and fp8_compute_supported(state.device, block) else None
    return memory_plan(
        hf,
        config.parallel.tensor_parallel_size,
        config.parallel.pipeline_parallel_size,
        budget_bytes=budget_bytes,
        dtype_bytes=dtype.itemsize,
        fp8_block=fp8,
        max_model_len=config.model.resolved_max_model_len,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
        mtp_layers=mtp_layers,
        pipeline_layer_partition=config.parallel.pipeline_layer_partition,
        dtype_name=str(dtype).removeprefix("torch."),
    )


def check_layout_fits(
    config: EngineConfig, state: ParallelState, budget_bytes: int | None = None
) -> None:
    """Raise ValueError, with the plan's table, when this rank cannot hold its weights and
    one `max_model_len` sequence of KV (on a GPU: within `gpu_memory_utilization` of its
    memory; on a CPU: beside `cpu_kv_cache_gib` of KV, within the host's memory)."""
    device = state.device
    on_gpu = device.type == "cuda"
    if budget_bytes is None:
        if on_gpu:
            total = torch.cuda.get_device_properties(device).total_memory
            budget_bytes = int(total * config.cache.gpu_memory_utilization)
        else:
            budget_bytes = host_memory_bytes() - int(config.cache.cpu_kv_cache_gib * GIB)
    plan = plan_for(config, state, budget_bytes)
    stage = plan.stages[state.pp_rank]
    short = stage.kv_tokens < plan.min_kv_tokens if on_gpu else stage.kv_bytes < 0
    if short:
        where = "GPU" if on_gpu else "host (beside cpu_kv_cache_gib of KV)"
        raise ValueError(
            f"the model does not fit this layout: rank {state.rank}'s {where} memory cannot "
            f"hold its weights and KV; use more tensor/pipeline ranks, FP8 weights or a "
            f"smaller max_model_len. Plan (`cluster plan`):\n{plan.table()}"
        )
