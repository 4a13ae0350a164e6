"""Typed, validated engine configuration (pydantic v2, frozen).

Every invalid value is rejected here, at the edge, with a message that names
the field and what is allowed. Checks that need the model (heads, layers,
context length) run in `EngineConfig`, which reads the checkpoint's
`config.json` once through `ModelConfig.hf_config`.
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.config.architectures import (
    check_expert_parallel,
    check_target_config,
    has_recurrent_layers,
)
from cluster.config.dtypes import resolve_dtype
from cluster.config.hub import resolve_model_path
from cluster.config.speculative import SpeculativeConfig

DTypeName = Literal["auto", "float32", "float16", "bfloat16"]


def stage_layer_counts(
    num_layers: int, pp_size: int, partition: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """Layers per stage: `partition` when given (checked), else an even split with the
    remainder going to the earliest stages (the last stage also runs the LM head and
    the draft, so it gets no extra layer)."""
    if partition is not None:
        if len(partition) != pp_size:
            raise ValueError(
                f"parallel.pipeline_layer_partition={list(partition)} has {len(partition)} "
                f"entries; pipeline_parallel_size={pp_size} needs one per stage"
            )
        if any(n < 1 for n in partition) or sum(partition) != num_layers:
            raise ValueError(
                f"parallel.pipeline_layer_partition={list(partition)} must give every stage "
                f"at least one layer and sum to the model's num_hidden_layers={num_layers}"
            )
        return tuple(partition)
    if pp_size > num_layers:
        raise ValueError(
            f"parallel.pipeline_parallel_size={pp_size} exceeds the model's "
            f"num_hidden_layers={num_layers}"
        )
    base, extra = divmod(num_layers, pp_size)
    return tuple(base + (1 if stage < extra else 0) for stage in range(pp_size))


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


class ModelConfig(_Frozen):
    """Which checkpoint to serve and at what precision and length."""

    # The local HF folder (config.json, tokenizer, *.safetensors), or a Hugging Face id
    # found in the Hub cache (`cluster.config.hub`), which becomes its snapshot folder here. The
    # default model is resolved to its converted folder by `cluster.models.default_model`.
    path: str = Field(description="local folder or Hugging Face id of a checkpoint")
    # A Hub id's branch, tag or commit (vLLM's `revision`); the commit once resolved.
    revision: str | None = None
    tokenizer: str | None = Field(default=None, description="tokenizer folder; defaults to path")
    dtype: DTypeName = "auto"
    max_model_len: int | None = Field(default=None, ge=1)
    # Where the model runs; "auto" means CUDA when available, else CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Every token's logits independent of how many other tokens share its step (no matrix
    # product runs on a single row, and every step's products use one kernel shape family),
    # so greedy speculation equals greedy decoding token for token in 16-bit dtypes and a
    # request's answer does not depend on the server's load (`cluster.worker.model_runner`).
    batch_invariant: bool = True

    @model_validator(mode="before")
    @classmethod
    def _resolve_hub_ids(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("path"), str):
            return data
        path = resolve_model_path(data["path"], data.get("revision"))
        data = {**data, "path": path}
        if data.get("revision") is not None:  # pinned: the commit, so a copy re-validates
            data["revision"] = os.path.basename(path)
        if isinstance(data.get("tokenizer"), str):
            data["tokenizer"] = resolve_model_path(data["tokenizer"])
        return data

    @field_validator("path")
    @classmethod
    def _path_exists(cls, path: str) -> str:
        if not os.path.isdir(path):
            raise ValueError(f"model path {path!r} is not a folder")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model path {path!r} has no config.json")
        return path

    @cached_property
    def hf_config(self) -> Any:
        """The checkpoint's transformers config (read from disk once, never downloaded)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path, local_files_only=True)

    @cached_property
    def generation_eos_token_ids(self) -> tuple[int, ...]:
        """`eos_token_id` of the checkpoint's generation_config.json (an int or a list:
        Llama-3 lists <|eot_id|> and <|eom_id|> there); () without one."""
        file = os.path.join(self.path, "generation_config.json")
        if not os.path.isfile(file):
            return ()
        with open(file) as f:
            eos = json.load(f).get("eos_token_id")
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype; "auto" as `cluster.config.dtypes.resolve_dtype` resolves it
        (bfloat16 on CPUs with bfloat16 matrix instructions, the checkpoint's 16-bit
        dtype on CUDA)."""
        return resolve_dtype(self.dtype, self.hf_config, self.resolved_device)

    @property
    def max_position_embeddings(self) -> int:
        return int(getattr(self.hf_config, "max_position_embeddings", 2048))

    @property
    def resolved_max_model_len(self) -> int:
        return self.max_model_len or self.max_position_embeddings


class ParallelConfig(_Frozen):
    """How the target is split: tensor shards within a stage, pipeline stages across layers."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    # Decoder layers per stage (e.g. (16, 14)); None splits evenly, earlier stages first.
    pipeline_layer_partition: tuple[int, ...] | None = None
    expert_parallel_size: int = Field(default=1, ge=1)
    backend: Literal["auto", "nccl", "gloo"] = "auto"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def distributed_backend(self) -> str:
        """nccl when CUDA is available, gloo otherwise (unless set explicitly)."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if torch.cuda.is_available() else "gloo"


class CacheConfig(_Frozen):
    """The paged KV cache: block size and how much memory it may take."""

    block_size: int = Field(default=16, ge=1, le=1024)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    # Memory for KV blocks on CPU, where there is no device to measure.
    cpu_kv_cache_gib: float = Field(default=1.0, gt=0.0)
    # Overrides the measured number of KV blocks (tests use it to force preemption).
    num_kv_blocks: int | None = Field(default=None, ge=1)
    # Reuse the KV (the draft's too) of whole blocks whose tokens an earlier request had.
    enable_prefix_caching: bool = True


class SchedulerConfig(_Frozen):
    """The per-step token budget."""

    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    enable_chunked_prefill: bool = True


class CompileConfig(_Frozen):
    """torch.compile of the target's and the draft's forwards, one graph per token-count
    bucket (cluster/models/compiled.py); eager stays the reference.

    `mode`: "on", "off", or "auto" (the default; `$CLUSTER_COMPILE` overrides it): compile
    on a single rank when the target is large enough for compiled kernels to pay (about
    50M parameters and up); tensor- and pipeline-parallel ranks run eagerly unless "on".
    """

    mode: Literal["auto", "on", "off"] = Field(
        default_factory=lambda: os.environ.get("CLUSTER_COMPILE", "auto"), validate_default=True
    )
    # Token counts with a compiled graph; a step with more tokens runs eagerly (on CPU the
    # compiled graphs gain at small token counts; at 64 they measured no faster than eager).
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    # CPU: let inductor time its C++ GEMM templates against BLAS per shape (slower start).
    autotune: bool = True
    # Serve at once, eagerly, while the graphs compile on a thread (a single rank only; a
    # batch-invariant engine's answers are the same either way). A Serve replica's
    # in-place restarts always do this.
    background: bool = False

    @field_validator("sizes")
    @classmethod
    def _check_sizes(cls, sizes: tuple[int, ...]) -> tuple[int, ...]:
        if not sizes or any(n < 1 for n in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"compile.sizes must be ascending positive ints, got {sizes}")
        if sizes[-1] > 4096:
            raise ValueError(f"compile.sizes must not exceed 4096 tokens, got {sizes[-1]}")
        return sizes

    def enabled(self, hf_config: Any, world_size: int) -> bool:
        """Whether this engine compiles (resolving "auto")."""
        if self.mode != "auto":
            return self.mode == "on"
        hidden, layers = int(hf_config.hidden_size), int(hf_config.num_hidden_layers)
        params = 12 * layers * hidden**2 + int(hf_config.vocab_size) * hidden
        return world_size == 1 and params >= 50_000_000


class EngineConfig(_Frozen):
    """Everything one engine needs; cross-checks the parts against the model."""

    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig | None = None
    compile: CompileConfig = Field(default_factory=CompileConfig)
    seed: int = 0

    @property
    def compiles(self) -> bool:
        return self.compile.enabled(self.model.hf_config, self.parallel.world_size)

    @property
    def prefix_caching(self) -> bool:
        """Whether cached KV blocks are reused: as configured, except for targets with
        recurrent layers, whose per-request state no cached block holds."""
        return self.cache.enable_prefix_caching and not has_recurrent_layers(self.model.hf_config)

    @model_validator(mode="after")
    def _check_against_model(self) -> EngineConfig:
        hf = self.model.hf_config
        max_len = self.model.resolved_max_model_len
        check_target_config(hf, self.parallel.tensor_parallel_size, max_len)
        check_expert_parallel(
            hf, self.parallel.tensor_parallel_size, self.parallel.expert_parallel_size
        )
        stage_layer_counts(
            int(hf.num_hidden_layers),
            self.parallel.pipeline_parallel_size,
            self.parallel.pipeline_layer_partition,
        )
        if max_len > self.model.max_position_embeddings:
            raise ValueError(
                f"model.max_model_len={max_len} exceeds the model's "
                f"max_position_embeddings={self.model.max_position_embeddings}"
            )
        if self.speculative is not None:
            self.speculative.check_against_target(self.model.path, hf)
            if self.speculative.tree is not None and has_recurrent_layers(hf):
                raise ValueError(
                    "speculative.tree is not supported on targets with recurrent layers (their "
                    "state follows one sequence, not a tree of drafts)"
                )
            if self.speculative.adaptive and self.parallel.pipeline_parallel_size > 1:
                raise ValueError(
                    "speculative.adaptive needs pipeline_parallel_size=1 (with several batches "
                    "in flight a step's duration is not its own); set num_speculative_tokens"
                )
        sched = self.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_len:
            raise ValueError(
                f"scheduler.max_num_batched_tokens={sched.max_num_batched_tokens} must be at "
                f"least max_model_len={max_len} when chunked prefill is off"
            )
        return self


# Flat engine arguments (vLLM's names) -> (section, field).
FLAT_ENGINE_ARGS = {
    "revision": ("model", "revision"),
    "tokenizer": ("model", "tokenizer"),
    "dtype": ("model", "dtype"),
    "max_model_len": ("model", "max_model_len"),
    "device": ("model", "device"),
    "batch_invariant": ("model", "batch_invariant"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "pipeline_parallel_size": ("parallel", "pipeline_parallel_size"),
    "pipeline_layer_partition": ("parallel", "pipeline_layer_partition"),
    "expert_parallel_size": ("parallel", "expert_parallel_size"),
    "distributed_backend": ("parallel", "backend"),
    "block_size": ("cache", "block_size"),
    "gpu_memory_utilization": ("cache", "gpu_memory_utilization"),
    "cpu_kv_cache_gib": ("cache", "cpu_kv_cache_gib"),
    "num_kv_blocks": ("cache", "num_kv_blocks"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "enable_chunked_prefill": ("scheduler", "enable_chunked_prefill"),
    "compile": ("compile", "mode"),
    "compile_sizes": ("compile", "sizes"),
    "compile_autotune": ("compile", "autotune"),
    "compile_in_background": ("compile", "background"),
}


def engine_config_from_args(
    model: str,
    seed: int = 0,
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
    **kwargs: Any,
) -> EngineConfig:
    """Build an `EngineConfig` from flat keyword arguments; unknown names are refused."""
    unknown = sorted(set(kwargs) - set(FLAT_ENGINE_ARGS))
    if unknown:
        raise ValueError(
            f"unknown engine arguments: {unknown} (allowed: {sorted(FLAT_ENGINE_ARGS)})"
        )
    sections: dict[str, dict[str, Any]] = {"model": {"path": model}}
    for name, value in kwargs.items():
        if value is not None:
            section, field_name = FLAT_ENGINE_ARGS[name]
            sections.setdefault(section, {})[field_name] = value
    return EngineConfig(**sections, speculative=speculative_config, seed=seed)
