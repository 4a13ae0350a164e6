"""`ClusterArgs`: the typed `args` of a manifest's application (what `build_app` receives).

Frozen pydantic models that refuse unknown keys. The engine sections reuse the engine's
own configs (`ParallelConfig`, `CacheConfig`, `SchedulerConfig`), so a manifest and
`LLM(...)` accept the same values; `speculative` is passed through to the engine as
`speculative_config`. Schema checks need nothing on disk; `check_model` adds the checks
that read the checkpoint's config.json (heads vs TP, context length, KV room).
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.config import (
    CacheConfig,
    CompileConfig,
    DTypeName,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    engine_config_from_args,
)
from cluster.config.hub import is_hub_id, resolve_model_path
from cluster.config.placement import PlacementConfig

LLM_DEPLOYMENT = "LLMServer"  # the name of the one deployment an app has

Device = Literal["auto", "cpu", "cuda"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


class ModelArgs(_Frozen):
    """Which checkpoint to serve; `path: null` is the embedded default (SmolLM2)."""

    id: str | None = Field(
        default=None, description="served model name (default: the Hub id, or the folder name)"
    )
    path: str | None = None  # a local folder or a Hugging Face id (`cluster.config.hub`)
    revision: str | None = None
    tokenizer: str | None = None
    dtype: DTypeName = "auto"
    max_model_len: int | None = Field(default=None, ge=1)
    device: Device = "auto"
    batch_invariant: bool = True


class ServerArgs(_Frozen):
    """The replica's HTTP-facing behaviour."""

    # Bearer key required on every route but /health; `api_key_env` names an environment
    # variable holding it instead (so the key need not be written in the manifest).
    api_key: str | None = None
    api_key_env: str | None = None
    # Requests waiting for admission (KV blocks, sequence slots) beyond which new ones get 429.
    max_waiting_requests: int | None = Field(default=None, ge=1)
    # The replica's streams together send about this many chunks per second at most: a
    # stream sends its next chunk no sooner than (live requests) / this rate after the
    # previous one (tokens arriving sooner merge into it; a token arriving later goes out at
    # once). One stream gets every step's tokens as they come (10 ms at the default), 16
    # streams one chunk each per 160 ms, 64 per 640 ms. A chunk costs CPU in the replica,
    # the ingress and the client, taken from the model's cores on a small node: at 16
    # streams on 2 cores behind HAProxy, 200 chunks/s ran at 0.89-0.91x of in-process
    # tokens/s, 100 at 0.95-0.99x (benchmarks/results/serving_overhead.md).
    stream_chunks_per_s: float = Field(default=100.0, gt=0)
    # A single engine step running longer than this makes the health check fail.
    stall_timeout_s: float = Field(default=60.0, gt=0)
    health_timeout_s: float = Field(default=10.0, gt=0)
    # A dead engine (a worker or the scheduler killed, its node gone, a stalled step) is
    # restarted inside its replica, in the same placement group, at most this many times in
    # 10 minutes (`engine_supervisor.py`); past that (or with 0) the health check fails and
    # Serve replaces the whole replica.
    max_engine_restarts: int = Field(default=3, ge=0)
    # Tool calling with tool_choice "auto" (vLLM's --enable-auto-tool-choice and
    # --tool-call-parser): the parser that reads the model's calls out of its text.
    enable_auto_tool_choice: bool = False
    tool_call_parser: Literal["hermes"] | None = None
    # Which replica takes an HTTP request: "prefix", the one whose prefix cache holds the
    # longest start of its prompt (`prefix_router.py`; needs Serve's HAProxy ingress);
    # "least_loaded", HAProxy's own choice; "auto", prefix when the engine caches
    # prefixes and Serve runs HAProxy.
    request_router: Literal["auto", "prefix", "least_loaded"] = "auto"
    # "prefix": a replica holding the longest match still loses to the least-loaded one
    # when it has more than this many requests above it (a batching engine serves a few
    # more requests at little cost, hence 8).
    prefix_max_imbalance: int = Field(default=8, ge=0)

    @model_validator(mode="after")
    def _auto_tools_need_a_parser(self) -> ServerArgs:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("server.enable_auto_tool_choice needs server.tool_call_parser")
        return self

    def resolved_api_key(self) -> str | None:
        """The key (read where each replica runs); a named but unset variable is an error,
        never a silently open server."""
        if self.api_key is not None or self.api_key_env is None:
            return self.api_key
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"server.api_key_env names {self.api_key_env!r}, which is not set")
        return key


class ClusterArgs(_Frozen):
    model: ModelArgs = ModelArgs()
    parallel: ParallelConfig = ParallelConfig()
    placement: PlacementConfig = PlacementConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    # The engine's `speculative_config` (method, k, draft model, ...). Its keys and k are
    # checked here; the rest (the draft checkpoint) with the model checks.
    speculative: dict[str, Any] | None = None
    server: ServerArgs = ServerArgs()
    compile: CompileConfig = Field(default_factory=CompileConfig)
    seed: int = 0

    @field_validator("speculative")
    @classmethod
    def _check_speculative(cls, spec: dict[str, Any] | None) -> dict[str, Any] | None:
        if spec is None:
            return None
        if not isinstance(spec.get("method"), str) and not isinstance(spec.get("model"), str):
            raise ValueError(
                "speculative needs a method (ngram, eagle, eagle3, mtp, draft_model) or a "
                "draft model folder to detect it from"
            )
        from cluster.config.speculative import SpeculativeConfig

        unknown = sorted(set(spec) - set(SpeculativeConfig.model_fields))
        if unknown:
            raise ValueError(
                f"speculative: unknown keys {unknown} (allowed: "
                f"{sorted(SpeculativeConfig.model_fields)})"
            )
        k = spec.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"speculative.num_speculative_tokens must be an integer >= 1, got {k!r}"
            )
        return spec

    @model_validator(mode="after")
    def _check_sections(self) -> ClusterArgs:
        if "use_gpu" in self.placement.model_fields_set:
            raise ValueError("placement.use_gpu follows model.device; set model.device instead")
        return self

    # ---- derived values ------------------------------------------------------------------
    @property
    def served_model_name(self) -> str:
        if self.model.id:
            return self.model.id
        if self.model.path:
            if is_hub_id(self.model.path):
                return self.model.path  # as vLLM names it
            return os.path.basename(os.path.normpath(self.model.path))
        from cluster.models.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME

    def model_path(self) -> str:
        """The checkpoint folder (converting the embedded default model on first use)."""
        if self.model.path is not None:
            return resolve_model_path(self.model.path, self.model.revision)
        from cluster.models.default_model import ensure_default_model

        return ensure_default_model()

    def with_device(self, device: Literal["cpu", "cuda"]) -> ClusterArgs:
        return self.model_copy(update={"model": self.model.model_copy(update={"device": device})})

    def placement_config(self) -> PlacementConfig:
        return self.placement.model_copy(update={"use_gpu": self.model.device == "cuda"})

    def engine_args(self, model_path: str | None = None) -> dict[str, Any]:
        """Flat engine arguments (`LLM(**...)`, `engine_config_from_args(**...)`)."""
        args: dict[str, Any] = {"model": model_path or self.model_path(), "seed": self.seed}
        # model_path() resolved the revision into the snapshot folder
        args.update(self.model.model_dump(exclude={"id", "path", "revision"}, exclude_none=True))
        for name, value in self.parallel.model_dump(exclude_unset=True).items():
            args["distributed_backend" if name == "backend" else name] = value
        args.update(self.cache.model_dump(exclude_unset=True))
        args.update(self.scheduler.model_dump(exclude_unset=True))
        for name, value in self.compile.model_dump(exclude_unset=True).items():
            args["compile" if name == "mode" else f"compile_{name}"] = value
        if self.speculative is not None:
            args["speculative_config"] = dict(self.speculative)
        return args

    def engine_config(self, model_path: str | None = None) -> EngineConfig:
        """The engine's config, checked against the model (reads config.json)."""
        args = self.engine_args(model_path)
        config = engine_config_from_args(args.pop("model"), **args)
        blocks = config.cache.num_kv_blocks
        max_len = config.model.resolved_max_model_len
        if blocks is not None and blocks * config.cache.block_size < max_len:
            raise ValueError(
                f"cache.num_kv_blocks={blocks} x block_size={config.cache.block_size} holds "
                f"fewer tokens than one sequence of max_model_len={max_len}"
            )
        return config

    def model_is_present(self) -> bool:
        """False when `model.path` names a folder that is not here (dry runs skip model checks)."""
        if self.model.path is not None and is_hub_id(self.model.path):
            try:  # in the local Hub cache?
                return bool(
                    resolve_model_path(self.model.path, self.model.revision, cached_only=True)
                )
            except ValueError:
                return False
        return self.model.path is None or os.path.isfile(
            os.path.join(self.model.path, "config.json")
        )
