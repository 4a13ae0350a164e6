"""The offline API, following vLLM's names: `LLM(...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from cluster.config import EngineConfig, engine_config_from_args
from cluster.engine.core import EngineCore
from cluster.engine.executor import Executor
from cluster.engine.frontend import ChatMessages, Prompt
from cluster.engine.llm_engine import LLMEngine
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams


def make_executor(config: EngineConfig) -> Executor:
    """In-process for one rank, spawned local processes for tensor/pipeline parallelism."""
    from cluster.worker.executors import InProcessExecutor, MultiprocExecutor

    if config.parallel.world_size == 1:
        return InProcessExecutor(config)
    return MultiprocExecutor(config)


def build_engine(config: EngineConfig, executor: Executor | None = None) -> LLMEngine:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path)
    core = EngineCore(config, executor or make_executor(config))
    return LLMEngine(core, tokenizer)


class LLM:
    """An engine in this process. `model=None` serves the embedded default model."""

    def __init__(
        self,
        model: str | None = None,
        *,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        dtype: str = "auto",
        max_model_len: int | None = None,
        speculative_config: dict[str, Any] | None = None,
        seed: int = 0,
        **engine_args: Any,
    ) -> None:
        if model is None:
            from cluster.models.default_model import ensure_default_model

            model = ensure_default_model()
        self.config = engine_config_from_args(
            model,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            dtype=dtype,
            max_model_len=max_model_len,
            speculative_config=speculative_config,
            **engine_args,
        )
        self.engine = build_engine(self.config)

    @classmethod
    def from_manifest(cls, path: str, **overrides: Any) -> LLM:
        """The engine a Serve manifest describes, in this process (same model, parallelism,
        cache, scheduler and speculation). Any engine argument can be overridden;
        `speculative_config=None` turns speculation off."""
        from cluster.serve.manifest import read_manifest_args  # imports no Ray

        engine_args = read_manifest_args(path).engine_args()
        engine_args.update(overrides)
        return cls(**engine_args)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, continuously batched; outputs in prompt order.

        A bad prompt or parameter raises ValueError (naming the prompt's index) before any
        request of this call is added.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling_params")
        engine = self.engine
        request_ids = [engine.next_request_id() for _ in prompts]
        added: list[str] = []
        try:
            for i, (request_id, prompt, p) in enumerate(
                zip(request_ids, prompts, params, strict=True)
            ):
                try:
                    engine.add_request(request_id, prompt, p)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from e
                added.append(request_id)
        except ValueError:
            for request_id in added:
                engine.abort_request(request_id)
            raise
        finished = self._run(request_ids, use_tqdm)
        return [finished[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (with the `tools` it may
        call, in OpenAI's form, for templates that render them, and any extra template
        variables), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        frontend = self.engine.frontend
        prompts = [
            frontend.chat_prompt(conv, add_generation_prompt, tools, chat_template_kwargs)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as bar:
            while len(finished) < len(request_ids) and self.engine.has_unfinished_requests():
                for request in self.engine.advance():
                    if request.finished and request.request_id in wanted:
                        finished[request.request_id] = request.output()
                        bar.update(1)
        return finished

    def get_metrics(self) -> dict[str, object]:
        """Aggregated speculative-decoding statistics (num_drafts, num_draft_tokens,
        num_accepted_tokens, acceptance_rate, mean_acceptance_length,
        mean_draft_tokens_per_step, acceptance_per_position: per depth for draft trees)
        and scheduler counters."""
        return self.engine.core.get_metrics()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
