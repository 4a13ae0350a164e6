"""A worker: one rank's model shard, its KV cache and its model runner.

The in-process executor, the multiprocess executor and (later) the Ray worker actor
all host this same class. `execute_model` takes and returns msgpack bytes, the form
in which scheduler outputs travel.
"""

from __future__ import annotations

import torch

from cluster.config import EngineConfig
from cluster.engine.messages import SchedulerOutput
from cluster.models.llama import head_dim_of
from cluster.models.loader import load_model
from cluster.parallel import ParallelState, destroy_parallel_state, init_parallel_state
from cluster.worker.kv_cache import PagedKVCache
from cluster.worker.model_runner import ModelRunner


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, init_method: str | None = None) -> None:
        self.config = config
        parallel = config.parallel
        device = config.model.resolved_device
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = f"cuda:{torch.cuda.current_device()}"
        if parallel.world_size > 1 and init_method is None:
            raise ValueError("a worker of a multi-rank engine needs init_method")
        self.state: ParallelState = init_parallel_state(
            rank,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            init_method or "",
            parallel.distributed_backend,
            device,
        )
        torch.manual_seed(config.seed)
        self.model = load_model(config.model, self.state)
        self.runner: ModelRunner | None = None

    @property
    def reports(self) -> bool:
        """The one rank whose output goes back to the engine core."""
        return self.state.is_last_stage and self.state.tp_rank == 0

    def _kv_geometry(self) -> tuple[int, int, int]:
        hf = self.model.config
        num_kv_heads = self.model.model.layers[0].self_attn.qkv_proj.num_kv_heads
        return int(hf.num_hidden_layers), num_kv_heads, head_dim_of(hf)

    def available_kv_blocks(self) -> int:
        """How many KV blocks fit in the memory this rank may use for the cache."""
        num_layers, num_kv_heads, head_dim = self._kv_geometry()
        cache = self.config.cache
        per_block = PagedKVCache.bytes_per_block(
            num_layers, cache.block_size, num_kv_heads, head_dim, self.config.model.torch_dtype
        )
        if self.state.device.type == "cuda":
            free, total = torch.cuda.mem_get_info()
            budget = free - (1 - cache.gpu_memory_utilization) * total
        else:
            budget = cache.cpu_kv_cache_gib * 2**30
        return max(0, int(budget // per_block))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        num_layers, num_kv_heads, head_dim = self._kv_geometry()
        kv_cache = PagedKVCache(
            num_layers,
            num_blocks,
            self.config.cache.block_size,
            num_kv_heads,
            head_dim,
            self.config.model.torch_dtype,
            self.state.device,
        )
        self.runner = ModelRunner(self.model, kv_cache, self.state.device)

    def execute_model(self, payload: bytes) -> bytes | None:
        if self.runner is None:
            raise RuntimeError("initialize_kv_cache must be called before execute_model")
        output = self.runner.execute_model(SchedulerOutput.decode(payload))
        return output.encode() if self.reports else None

    def shutdown(self) -> None:
        destroy_parallel_state(self.state)
