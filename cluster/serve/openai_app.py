"""The OpenAI-compatible routes, served by the `LLMServer` replicas themselves
(`@serve.ingress` on a subclass): a FastAPI app, one Serve hop from the HTTP proxy.

Routes: `/v1/completions` (one prompt or a list), `/v1/chat/completions` (streamed as
server-sent events when `stream` is set), `/v1/models`, `/v1/models/{id}`, and vLLM's
`/tokenize`, `/detokenize`, `/version`, `/health`, and `/metrics` (this replica's, with
vLLM's metric names; no key needed, as for `/health`). Every error, FastAPI's own included (a body
that is not JSON or not UTF-8, an unknown route), is OpenAI-style JSON with a real
status: the first chunk of a stream is awaited before the response starts, so a bad
request, a full engine queue or a dead engine is a 400/429/503, not a 200 with a broken
body.
When the client goes away the stream is cancelled, which aborts the request in the
engine and frees its KV blocks. A list of prompts is one request per prompt (awaited
together, their streams merged chunk by chunk); prompt i's `n` choices (fanned out by
the engine's front end) are the response's choices i * n to i * n + n - 1. A Bearer
API key, when configured, guards every path but `/health` and `/metrics` (the OpenAPI
schema and docs pages included), and is checked before the body is read, so an
unauthenticated caller learns nothing about the schema.
"""

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from cluster import __version__ as cluster_version
from cluster.serve.args import ClusterArgs
from cluster.serve.errors import (
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
    classify,
    error_body,
)
from cluster.serve.openai_http import (
    error_response,
    make_openai_app,
    validation_message,
)
from cluster.serve.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from cluster.serve.openai_responses import ResponseFormatter
from cluster.serve.protocol import GenerateOutput, GenerateRequest
from cluster.serve.server import LLMServer

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


async def _merged(streams: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """(index, item) from every stream as items come; the first error is raised."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def drain(index: int, stream: Any) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
            queue.put_nowait((index, _END))
        except Exception as e:
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_END = object()


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def make_server_class() -> type:
    """The deployment class: `LLMServer` (one engine, the handle API) serving the OpenAI
    routes itself, with its own FastAPI app (nothing at module level). HTTP then takes one
    Serve hop (proxy -> replica), and a route runs its request in the replica's engine
    client directly."""
    app = make_openai_app()

    @serve.ingress(app)
    class OpenAIServer(LLMServer):
        def __init__(self, args: ClusterArgs | dict[str, Any]) -> None:
            server = ClusterArgs.model_validate(args).server
            app.state.api_key = server.resolved_api_key()  # before any actor starts
            super().__init__(args)

        def _check_model(self, model: str) -> None:
            if model != self.model_id:
                raise ModelNotFoundError(
                    f"the model {model!r} does not exist; this server serves {self.model_id!r}"
                )

        @app.get("/health")
        async def health_route(self) -> JSONResponse:
            """200 only when the engine answers its own health check (scheduler, every
            worker, a step loop that is not stalled); 503 otherwise, or after the manifest's
            `server.health_timeout_s`."""
            try:
                timeout = self.args.server.health_timeout_s  # the manifest's
                await asyncio.wait_for(self.health(), timeout=timeout)
            except TimeoutError:
                return error_response(
                    EngineUnavailableError(f"no engine answered within {timeout:g} s")
                )
            except Exception as e:  # whatever failed, the service is not available
                _, _, message = classify(e)
                return error_response(EngineUnavailableError(message))
            return JSONResponse({"status": "ok"})

        @app.get("/v1/models")
        async def models(self) -> JSONResponse:
            return JSONResponse({"object": "list", "data": [await self._model_entry()]})

        @app.get("/v1/models/{model_id:path}")
        async def model(self, model_id: str) -> JSONResponse:
            try:
                self._check_model(model_id)
            except Exception as e:
                return error_response(e)
            return JSONResponse(await self._model_entry())

        async def _model_entry(self) -> dict[str, Any]:
            card = await self.model_card()
            entry = {"id": card["id"], "object": "model", "created": 0, "owned_by": "cluster"}
            return {**entry, "max_model_len": card["max_model_len"]}

        @app.get("/metrics")
        async def metrics(self) -> Response:
            """This replica's metrics, vLLM's names, Prometheus' text format."""
            return Response(self.metrics.exposition(), media_type=PROMETHEUS_TEXT)

        @app.get("/version")
        async def version(self) -> JSONResponse:
            return JSONResponse({"version": cluster_version})

        @app.post("/tokenize")
        async def tokenize(self, body: TokenizeRequest) -> JSONResponse:
            """The prompt's token ids as a completion or chat request would see them."""
            try:
                self._check_model(body.model)
                if body.messages is not None:
                    turns = [m.template_dict() for m in body.messages]
                    chat = self.engine.frontend.chat_prompt(
                        turns,
                        body.add_generation_prompt,
                        chat_template_kwargs=body.chat_template_kwargs,
                    )
                    ids = chat["prompt_token_ids"]
                else:
                    ids = self.engine.tokenizer.encode(body.prompt)
            except Exception as e:
                return error_response(e)
            limit = self.max_model_len
            return JSONResponse({"count": len(ids), "max_model_len": limit, "tokens": ids})

        @app.post("/detokenize")
        async def detokenize(self, body: DetokenizeRequest) -> JSONResponse:
            try:
                self._check_model(body.model)
                vocab = self.engine.frontend.vocab_size
                bad = [t for t in body.tokens if not 0 <= t < vocab]
                if bad:
                    raise ValueError(f"tokens: ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            except Exception as e:
                return error_response(e)
            return JSONResponse({"prompt": self.engine.tokenizer.decode(body.tokens)})

        @app.post("/v1/completions")
        async def completions(self, body: CompletionRequest) -> Any:
            return await self._serve(body, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(self, body: ChatCompletionRequest) -> Any:
            return await self._serve(body, chat=True)

        async def _serve(self, body: CompletionRequest | ChatCompletionRequest, chat: bool) -> Any:
            try:
                self._check_model(body.model)
                params = body.sampling_params()
                requests = [  # prompt i's n choices are the response's i * n ... i * n + n - 1
                    GenerateRequest(**fields, sampling_params=params, stream=body.stream)
                    for fields in body.prompts()
                ]
            except ValidationError as e:
                return error_response(InvalidRequestError(validation_message(e)))
            except Exception as e:
                return error_response(e)
            echo_only = isinstance(body, CompletionRequest) and body.echo_only
            parser = self.args.server.tool_call_parser
            tools = body.tool_calling() if isinstance(body, ChatCompletionRequest) else None
            if (
                tools is not None
                and tools.mode == "auto"
                and not (parser and self.args.server.enable_auto_tool_choice)
            ):
                return error_response(
                    InvalidRequestError(
                        "tool_choice: 'auto' (the default with tools) needs the server's "
                        "server.enable_auto_tool_choice and server.tool_call_parser (cluster "
                        "serve: --enable-auto-tool-choice --tool-call-parser hermes); or ask "
                        "for 'none', 'required' or a named function"
                    )
                )
            formatter = ResponseFormatter(self.model_id, chat, echo_only, body.n, tools, parser)
            if not body.stream:
                try:  # one request per prompt; the first failure cancels the rest
                    answers = await _all_or_none([self._whole(r) for r in requests])
                except Exception as e:
                    return error_response(e)
                return JSONResponse(formatter.full([a for choices in answers for a in choices]))
            streams = [self._run(r) for r in requests]
            try:
                # A stream's first chunk is awaited here, so that errors are statuses.
                firsts = await _all_or_none([anext(s) for s in streams])
            except BaseException as e:
                await _close(streams)  # the client left, or a request failed
                if isinstance(e, Exception):
                    return error_response(e)
                raise
            events = _events(firsts, streams, formatter, body.include_usage, body.n)
            return StreamingResponse(events, media_type="text/event-stream")

    return OpenAIServer


async def _all_or_none(calls: list[Awaitable[Any]]) -> list[Any]:
    """Every call's result; if one fails (or this is cancelled), the others are cancelled
    (which aborts their engine requests) and the error is raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def _close(streams: list[AsyncGenerator[Any, None]]) -> None:
    """Close every stream: a request not finished is aborted and its blocks freed."""
    for stream in streams:
        with contextlib.suppress(Exception):
            await stream.aclose()


async def _events(
    firsts: list[GenerateOutput],
    streams: list[AsyncGenerator[GenerateOutput, None]],
    formatter: ResponseFormatter,
    include_usage: bool,
    n: int,
) -> AsyncIterator[str]:
    """Server-sent events of every prompt's stream; prompt i's choice j is index i * n + j."""
    lasts: dict[int, GenerateOutput] = {}

    def event(i: int, out: GenerateOutput) -> str | None:
        index = i * n + out.index
        lasts[index] = out
        chunk = formatter.chunk(out, index)
        return None if chunk is None else _sse(chunk)

    try:
        for i, first in enumerate(firsts):
            if (text := event(i, first)) is not None:
                yield text
        async for i, out in _merged(streams):
            if (text := event(i, out)) is not None:
                yield text
        if include_usage:
            yield _sse(formatter.usage_chunk([lasts[k] for k in sorted(lasts)]))
        yield _sse("[DONE]")
    except Exception as e:  # the status is already 200: report in the stream
        status, error_type, message = classify(e)
        yield _sse(error_body(status, message, error_type))
    finally:  # the client left early: abort in the engine
        await _close(streams)
