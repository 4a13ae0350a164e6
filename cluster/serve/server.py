"""`LLMServer`: the Serve deployment class. One replica = one engine.

The replica runs in bundle 0 of the placement group Serve made for it from
`ClusterArgs.placement` (one bundle per rank); its `EngineClient` starts the scheduler
actor there, which starts one worker per bundle. When the replica goes, they go.

`check_health` asks the scheduler, which pings every worker and checks that its step
loop is alive and not stalled. A dead engine is restarted inside the replica
(`EngineSupervisor`); a health check that times out, or an engine past its restarts,
makes Serve replace the whole replica.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from math import inf
from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.util.placement_group import get_current_placement_group

from cluster.actors.client import EngineClient
from cluster.engine.errors import EngineDeadError
from cluster.engine.frontend import FrontEnd, Prompt
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams
from cluster.serve.args import ClusterArgs
from cluster.serve.autoscaling import KV_USAGE, ONGOING_SEQUENCES, WAITING_SEQUENCES
from cluster.serve.engine_supervisor import EngineSupervisor
from cluster.serve.errors import EngineUnavailableError, InvalidRequestError, OverloadedError
from cluster.serve.logprobs import token_logprob, token_logprobs
from cluster.serve.metrics import ServerMetrics
from cluster.serve.prefix_router import (
    CACHED_BLOCKS,
    ENGINE_UNAVAILABLE,
    MAX_REPORTED_BLOCKS,
    ONGOING_REQUESTS,
    REPORTED_AT,
)
from cluster.serve.protocol import GenerateOutput, GenerateRequest, TokenLogprob, joined

logger = logging.getLogger("ray.serve")


def http_ingress() -> str:
    """How HTTP reaches this replica: Serve decides it from its environment at start."""
    from ray.serve._private import constants

    if getattr(constants, "RAY_SERVE_ENABLE_HA_PROXY", False):
        return "haproxy"  # HAProxy forwards to this replica's own HTTP server
    return "proxy"  # Serve's Python proxy, then a Ray call per request


def request_prompt(request: GenerateRequest, frontend: FrontEnd) -> Prompt:
    """The engine prompt of a request: its text or token ids, or its chat through the
    model's chat template."""
    if request.prompt is not None:
        return request.prompt
    if request.prompt_token_ids is not None:
        return {"prompt_token_ids": request.prompt_token_ids}
    turns = [m.template_dict() for m in request.messages or []]
    return frontend.chat_prompt(
        turns, tools=request.tools, chat_template_kwargs=request.chat_template_kwargs
    )


def _replica_id() -> str:
    """This Serve replica's id ("" outside a Serve replica)."""
    try:
        context = serve.get_replica_context()
    except Exception:
        return ""
    replica = getattr(context, "replica_id", None)
    return str(getattr(replica, "unique_id", None) or getattr(context, "replica_tag", "") or "")


class LLMServer:
    def __init__(self, args: ClusterArgs | dict[str, Any]) -> None:
        started = time.monotonic()
        self.args = ClusterArgs.model_validate(args)
        self.model_id = self.args.served_model_name
        self.engine_config = self.args.engine_config()
        self.max_model_len = self.engine_config.model.resolved_max_model_len
        self.metrics = ServerMetrics(self.model_id, _replica_id())
        self.placement_group = get_current_placement_group()
        from transformers import AutoTokenizer

        # loaded once: every engine this replica starts (restarts included) shares it
        self.tokenizer = AutoTokenizer.from_pretrained(self.engine_config.model.tokenizer_path)
        self.supervisor = EngineSupervisor(self._start_engine, self.args.server.max_engine_restarts)
        logger.info(
            "LLMServer %s: replica %s started in %.1f s (engine loaded, HTTP ingress %s)",
            self.model_id,
            _replica_id() or "-",
            time.monotonic() - started,
            http_ingress(),
        )

    def _start_engine(self, on_death: Callable[[str], object], restart: bool) -> EngineClient:
        """A new engine (scheduler and workers) in this replica's placement group. One that
        replaces a dead engine serves while its graphs compile (eagerly, same answers)."""
        config = self.engine_config
        if restart and config.compiles and not config.compile.background:
            compile = config.compile.model_copy(update={"background": True})
            config = config.model_copy(update={"compile": compile})
        return EngineClient(
            config,
            self.args.placement_config(),
            self.placement_group,
            stall_timeout_s=self.args.server.stall_timeout_s,
            observer=self.metrics.observe_batch,
            on_death=on_death,
            tokenizer=self.tokenizer,
        )

    @property
    def engine(self) -> EngineClient:
        """The engine serving now (a new one after a restart)."""
        return self.supervisor.engine

    # ---- the handle API ------------------------------------------------------------------
    async def generate(
        self, request: GenerateRequest | dict[str, Any]
    ) -> GenerateOutput | list[GenerateOutput] | AsyncIterator[GenerateOutput]:
        """The whole answer (with `sampling_params.n` > 1, the list of the `n` answers,
        choice j at index j), or (when `request.stream`) an async iterator of new pieces,
        each naming its choice (`index`)."""
        try:
            request = GenerateRequest.model_validate(request)
        except ValidationError as e:
            raise InvalidRequestError(str(e)) from None
        if request.stream:
            return self._run(request)
        answers = await self._whole(request)
        return answers[0] if len(answers) == 1 else answers

    async def _whole(self, request: GenerateRequest) -> list[GenerateOutput]:
        """Every choice's whole answer, choice j at index j (a request not streamed)."""
        pieces: dict[int, list[GenerateOutput]] = {}
        async for chunk in self._run(request):
            pieces.setdefault(chunk.index, []).append(chunk)
        return [joined(pieces[j]) for j in sorted(pieces)]

    async def _run(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """New pieces of every choice as they come: a choice's first piece (possibly
        empty) comes with the request's first output, later ones when it has advanced."""
        self._admit()
        request_id = request.request_id or uuid.uuid4().hex
        params = request.sampling_params
        start = time.monotonic()
        first_token_at: dict[int, float] = {}
        lasts: dict[int, GenerateOutput] = {}
        sent: dict[int, tuple[int, int]] = {}  # choice -> (characters, tokens) sent
        failed = False
        try:
            prompt = self._prompt(request)
            # Without streaming, only the final output matters: wait for it (inf).
            interval = self._stream_interval if request.stream else inf
            async for out in self._outputs(prompt, params, request_id, interval):
                for completion in out.outputs:
                    j, last = completion.index, lasts.get(completion.index)
                    sent_text, sent_tokens = sent.get(j, (0, 0))
                    if last is not None and not (
                        len(completion.token_ids) > sent_tokens
                        or len(completion.text) > sent_text
                        or (completion.finished and not last.finished)
                    ):
                        continue
                    if j not in first_token_at and completion.token_ids:
                        first_token_at[j] = time.monotonic()
                    chunk = GenerateOutput(
                        request_id=request_id,
                        index=j,
                        text=completion.text[sent_text:],
                        token_ids=completion.token_ids[sent_tokens:],
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        num_prompt_tokens=len(out.prompt_token_ids),
                        num_output_tokens=len(completion.token_ids),
                        num_draft_tokens=completion.num_draft_tokens,
                        num_accepted_tokens=completion.num_accepted_tokens,
                        logprobs=token_logprobs(completion, sent_tokens, params.logprobs or 0),
                        engine_id=self.engine.engine_id,
                        # the prompt's parts go out once per choice, with its first piece
                        prompt=self._echo(request, out) if last is None else None,
                        prompt_logprobs=(
                            self._prompt_logprobs(out, params) if last is None else None
                        ),
                    )
                    sent[j] = (len(completion.text), len(completion.token_ids))
                    lasts[j] = chunk
                    yield chunk
        except EngineDeadError as e:
            failed = True
            raise EngineUnavailableError(str(e)) from None
        except ValueError as e:
            failed = True
            raise InvalidRequestError(str(e)) from None
        finally:
            for j in range(params.n):
                last = lasts.get(j)
                outcome = "error" if failed else (last.finish_reason if last else None) or "abort"
                self._record(outcome, last, start, first_token_at.get(j))

    async def _outputs(
        self, prompt: Prompt, params: SamplingParams, request_id: str, interval: Any
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one request. A request whose engine died before it
        produced anything goes once more to the restarted engine; one that had produced
        something ends with the engine's death (a 503 or an error event)."""
        for attempt in range(2):
            engine = await self.supervisor.ready()
            produced = False
            try:
                async for out in engine.generate(prompt, params, request_id, interval):
                    produced = True
                    yield out
                return
            except EngineDeadError:
                if produced or attempt > 0 or not self.supervisor.restarting:
                    raise
                logger.info("request %s: its engine died before it started; sent again", request_id)

    def _echo(self, request: GenerateRequest, out: RequestOutput) -> str | None:
        if not request.echo:
            return None
        if out.prompt is not None:
            return out.prompt
        return self.engine.tokenizer.decode(out.prompt_token_ids)

    def _prompt_logprobs(
        self, out: RequestOutput, params: SamplingParams
    ) -> list[TokenLogprob] | None:
        """The prompt tokens' logprobs, when asked for (the first token has none)."""
        if out.prompt_logprobs is None or params.prompt_logprobs is None:
            return None
        first = out.prompt_token_ids[0]
        head = TokenLogprob(
            token_id=first, token=self.engine.tokenizer.decode([first]), logprob=None
        )
        return [head] + [
            token_logprob(token_id, entry, params.prompt_logprobs)
            for token_id, entry in zip(
                out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True
            )
            if entry is not None  # (always: only the first entry is None)
        ]

    def _stream_interval(self) -> float:
        """How long a stream merges newer tokens after a chunk (`stream_chunks_per_s`)."""
        return self.engine.num_unfinished_requests / self.args.server.stream_chunks_per_s

    def _admit(self) -> None:
        if self.supervisor.dead is not None:
            raise EngineUnavailableError(f"the engine is dead: {self.supervisor.dead}")
        limit = self.args.server.max_waiting_requests
        if limit is not None and self.engine.stats.num_waiting >= limit:
            raise OverloadedError(
                f"{self.engine.stats.num_waiting} requests are waiting for the engine "
                f"(server.max_waiting_requests={limit}); retry later"
            )

    def _prompt(self, request: GenerateRequest) -> Prompt:
        return request_prompt(request, self.engine.frontend)

    def _record(
        self, outcome: str, last: GenerateOutput | None, start: float, first: float | None
    ) -> None:
        n = last.num_output_tokens if last else 0
        now = time.monotonic()
        self.metrics.request_finished(
            outcome,
            last.num_prompt_tokens if last else 0,
            n,
            None if first is None else first - start,
            None if first is None or n < 2 else (now - first) / (n - 1),
            now - start,
        )

    # ---- operations ----------------------------------------------------------------------
    async def check_health(self) -> None:
        """Serve's periodic check: a failure makes Serve replace the replica. A dead
        worker or a stalled step restarts the engine in place instead (while restarts
        remain); a check that times out is left to Serve."""
        if self.supervisor.restarting:
            return
        try:
            await self.health()
        except (TimeoutError, EngineDeadError):
            raise
        except Exception as e:
            if not self.supervisor.engine_failed(f"health check: {type(e).__name__}: {e}"):
                raise

    async def health(self) -> dict[str, Any]:
        """What `/health` asks: raises unless the engine answers its health check."""
        if self.supervisor.restarting:
            raise EngineUnavailableError("the engine is restarting")
        return await self.engine.check_health(self.args.server.health_timeout_s)

    async def model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "max_model_len": self.max_model_len}

    async def stats(self) -> dict[str, Any]:
        """The engine's state and this replica's counters (for tests and operators); during
        an engine restart, the new engine's once it is ready."""
        engine = await self.supervisor.ready()
        describe = await engine.describe()
        return {
            "engine_id": engine.engine_id,
            "engine_restarts": self.supervisor.num_restarts,
            "http_ingress": http_ingress(),
            "num_unfinished_requests": engine.num_unfinished_requests,
            "engine": asdict(engine.stats),
            **describe,
            "metrics": self.metrics.snapshot(),
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling signal, read by `autoscaling.LLMLoadPolicy`."""
        ongoing = self.engine.num_unfinished_requests
        stats = self.engine.stats  # as of the last step; stale once the engine is idle
        return {
            ONGOING_SEQUENCES: float(ongoing),
            WAITING_SEQUENCES: float(stats.num_waiting if ongoing else 0),
            KV_USAGE: float(stats.kv_usage if ongoing else 0.0),
        }

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the prefix-aware router reads (`prefix_router.py`), every second: the keys
        of the engine's cached KV blocks and this replica's load."""
        report: dict[str, Any] = {
            ONGOING_REQUESTS: self.engine.num_unfinished_requests,
            REPORTED_AT: time.time(),
            ENGINE_UNAVAILABLE: self.engine.error is not None,  # restarting, or dead
        }
        if self.engine.error is None:
            report[CACHED_BLOCKS] = await self.engine.cached_block_hashes(MAX_REPORTED_BLOCKS)
        return report

    def __del__(self) -> None:
        supervisor = getattr(self, "supervisor", None)
        if supervisor is not None:
            supervisor.shutdown()
