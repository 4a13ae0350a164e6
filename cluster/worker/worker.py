"""A worker: one rank's model shard (and draft), its KV cache and its model runner.

The in-process executor, the multiprocess executor and the Ray worker actor all host
this same class. `execute_model` takes and returns msgpack bytes, the form in which
scheduler outputs travel.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from cluster.config import EngineConfig
from cluster.engine.messages import SchedulerOutput
from cluster.kernels import cpu_attention
from cluster.models.attention import AttentionLayer
from cluster.models.compiled import CompileOptions
from cluster.models.default_model import cache_dir
from cluster.models.gated_delta import RecurrentLayer, RecurrentShape
from cluster.models.loader import load_model
from cluster.parallel import ParallelState, destroy_parallel_state, init_parallel_state
from cluster.parallel.linear import pack_linears
from cluster.spec_decode.hybrid import HybridProposer
from cluster.worker.kv_cache import LayerShape, PagedKVCache
from cluster.worker.memory_check import check_layout_fits
from cluster.worker.model_runner import ModelRunner
from cluster.worker.state_cache import RecurrentStateCache

logger = logging.getLogger(__name__)


def attention_layer_shapes(model: nn.Module) -> dict[int, LayerShape]:
    """Layer index -> (kv_heads on this rank, head_dim) of every attention layer."""
    return {m.layer_idx: m.kv_shape for m in model.modules() if isinstance(m, AttentionLayer)}


def recurrent_layer_shapes(model: nn.Module) -> dict[int, RecurrentShape]:
    """Layer index -> state shape of every recurrent (linear-attention) layer."""
    return {
        m.layer_idx: m.recurrent_shape for m in model.modules() if isinstance(m, RecurrentLayer)
    }


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
            pp_layer_partition=parallel.pipeline_layer_partition,
            expert_parallel_size=parallel.expert_parallel_size,
        )
        torch.manual_seed(config.seed)
        check_layout_fits(config, self.state)  # before a byte is loaded
        self.model = load_model(config.model, self.state)
        spec = config.speculative
        # The draft, the sampler and the rejection sampler live on the last pipeline stage.
        self.draft_method = spec.draft_method if spec is not None else None
        self.draft: nn.Module | None = None
        if self.draft_method is not None and self.state.is_last_stage:
            self.draft = self.draft_method.load_draft(spec, config.model, self.model, self.state)
        # bfloat16 on CPU: every linear layer's weight prepacked, once, now that the last
        # weight is in (eager steps and compiled graphs both read them). Our C kernels are
        # built once per machine, under the cache folder.
        if self.state.device.type == "cpu":
            os.environ.setdefault("CLUSTER_KERNEL_CACHE_DIR", os.path.join(cache_dir(), "kernels"))
        self.num_packed_weights = sum(
            pack_linears(module) for module in (self.model, self.draft) if module is not None
        )
        # The target layers a draft reads may live on earlier stages: every stage collects
        # the ones it runs.
        self.aux_hidden_layers: tuple[int, ...] = ()
        if self.draft_method is not None:
            self.aux_hidden_layers = self.draft_method.target_layers(config.model.hf_config)
        self.runner: ModelRunner | None = None

    @property
    def reports(self) -> bool:
        """The one rank whose output goes back to the engine core."""
        return self.state.is_last_stage and self.state.tp_rank == 0

    @property
    def _draft_kv(self) -> str:
        """Where this rank's draft keeps its KV ("target", "own" or "none")."""
        if self.draft is None or self.draft_method is None:
            return "none"
        return self.draft_method.kv_cache

    def _layer_shapes(self) -> tuple[dict[int, LayerShape], dict[int, LayerShape]]:
        """(layers in the target's cache, layers of a draft with a cache of its own)."""
        shapes = attention_layer_shapes(self.model)
        draft = attention_layer_shapes(self.draft) if self.draft is not None else {}
        if self._draft_kv == "target":
            return shapes | draft, {}
        return shapes, draft

    def _state_cache_size(self) -> tuple[int, int]:
        """(slots, snapshots per slot) of the recurrent state cache: one slot per request
        the scheduler may run, and the states after each token a step may verify."""
        spec = self.config.speculative
        num_drafts = spec.num_speculative_tokens if spec is not None else 0
        return self.config.scheduler.max_num_seqs, 1 + num_drafts

    def available_kv_blocks(self) -> int:
        """How many KV blocks fit in the memory this rank may use for the cache (after the
        recurrent states, which every running request holds whatever its length)."""
        cache, dtype = self.config.cache, self.config.model.torch_dtype
        per_block = sum(
            PagedKVCache.bytes_per_block(shapes, cache.block_size, dtype)
            for shapes in self._layer_shapes()
        )
        if self.state.device.type == "cuda":
            free, total = torch.cuda.mem_get_info()
            budget = free - (1 - cache.gpu_memory_utilization) * total
        else:
            budget = cache.cpu_kv_cache_gib * 2**30
        slots, snapshots = self._state_cache_size()
        shapes = recurrent_layer_shapes(self.model)
        budget -= slots * RecurrentStateCache.bytes_per_slot(shapes, snapshots, dtype)
        return max(0, int(budget // per_block))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        block_size, dtype = self.config.cache.block_size, self.config.model.torch_dtype
        shapes, draft_lm_shapes = self._layer_shapes()
        device = self.state.device
        if device.type == "cpu":  # the C attention kernel (built at most once per machine)
            cpu_attention.load()
        kv_cache = PagedKVCache(shapes, num_blocks, block_size, dtype, device)
        state_cache = None
        recurrent_shapes = recurrent_layer_shapes(self.model)
        if recurrent_shapes:
            slots, snapshots = self._state_cache_size()
            state_cache = RecurrentStateCache(recurrent_shapes, slots, snapshots, dtype, device)
        spec = self.config.speculative
        compile_options = self._compile_options()
        proposer = None
        if spec is not None and self.draft_method is not None and self.state.is_last_stage:
            draft_kv = None
            if self._draft_kv == "target":
                draft_kv = kv_cache
            elif self._draft_kv == "own":
                draft_kv = PagedKVCache(draft_lm_shapes, num_blocks, block_size, dtype, device)
            proposer = self.draft_method.make_proposer(
                spec, self.draft, draft_kv, block_size, compile_options
            )
            if spec.hybrid_lookup_min is not None:
                min_match, max_n = spec.hybrid_lookup_min, spec.prompt_lookup_max
                proposer = HybridProposer(proposer, spec.num_speculative_tokens, min_match, max_n)
        self.runner = ModelRunner(
            self.model,
            kv_cache,
            device,
            proposer,
            self.aux_hidden_layers,
            state=self.state,
            compile_options=compile_options,
            state_cache=state_cache,
            batch_invariant=self.config.model.batch_invariant,
        )
        if compile_options is not None and compile_options.background:
            self.runner.warm_up()  # returns at once; its thread logs when the graphs are built
            logger.info("compiling the forwards in the background; eager until they are built")
        elif compile_options is not None:
            seconds = self.runner.warm_up()
            logger.info(
                "compiled the forwards for %s tokens in %.1f s", compile_options.sizes, seconds
            )

    def _compile_options(self) -> CompileOptions | None:
        """The compile settings of this engine, or None when it runs eagerly. Compiled
        artefacts are cached on disk under the cluster cache folder unless inductor's own
        `TORCHINDUCTOR_CACHE_DIR` says otherwise (set when `cluster` is imported:
        `cluster/_env.py`). A batch-invariant engine on CPU compiles
        one graph for every token count, with one GEMM kernel family (no autotuning; the
        products of prepacked weights are our own opaque op: `cluster.kernels.packed_linear`)."""
        if not self.config.compiles:
            return None
        compile = self.config.compile
        freeze = self.num_packed_weights == 0  # prepacked weights stay graph inputs
        # A rank of several runs collectives in its warm-up: it compiles before serving.
        background = compile.background and self.config.parallel.world_size == 1
        if compile.background and not background:
            logger.info(
                "compile.background is ignored with %d ranks: their warm-up runs collectives, "
                "so each rank compiles before serving",
                self.config.parallel.world_size,
            )
        if self.config.model.batch_invariant and self.state.device.type == "cpu":
            return CompileOptions(
                compile.sizes, autotune=False, dynamic=True, freeze=freeze, background=background
            )
        return CompileOptions(compile.sizes, compile.autotune, freeze=freeze, background=background)

    def execute_model(self, payload: bytes) -> bytes | None:
        if self.runner is None:
            raise RuntimeError("initialize_kv_cache must be called before execute_model")
        output = self.runner.execute_model(SchedulerOutput.decode(payload))
        return output.encode() if self.reports else None

    def stage_timings(self) -> dict[str, float]:
        """This rank's cumulative step time, and the parts of it spent receiving from the
        previous stage and sending to the next (the pipeline benchmark's idle fraction)."""
        runner = self.runner
        return {
            "pp_rank": self.state.pp_rank,
            "tp_rank": self.state.tp_rank,
            "steps": runner.num_steps if runner else 0,
            "step_s": runner.step_s if runner else 0.0,
            "recv_wait_s": runner.recv_wait_s if runner else 0.0,
            "send_wait_s": runner.send_wait_s if runner else 0.0,
        }

    def shutdown(self) -> None:
        destroy_parallel_state(self.state)
