"""The OpenAI-compatible ingress: a FastAPI app served by Ray Serve (`@serve.ingress`).

Routes: `/v1/completions`, `/v1/chat/completions` (streamed as server-sent events when
`stream` is set), `/v1/models`, `/health`. Errors are OpenAI-style JSON with a real
status: the first chunk of a stream is awaited before the response starts, so a bad
request, back-pressure or a dead engine is a 400/429/503, not a 200 with a broken body.
When the client goes away the stream is cancelled, which aborts the request in the
engine and frees its KV blocks. A Bearer API key, when configured, guards every route
but `/health`.
"""

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponse, DeploymentResponseGenerator

from cluster.serve.args import ServerArgs
from cluster.serve.errors import (
    AuthenticationError,
    InvalidRequestError,
    ModelNotFoundError,
    classify,
    error_body,
)
from cluster.serve.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormatter,
)
from cluster.serve.protocol import GenerateOutput, GenerateRequest


def error_response(exc: BaseException) -> JSONResponse:
    status, error_type, message = classify(exc)
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(error_body(status, message, error_type), status, headers=headers)


def _cancel(response: DeploymentResponse | DeploymentResponseGenerator) -> None:
    """Cancel a handle call (a no-op once it is done; Serve may re-raise its error here)."""
    with contextlib.suppress(Exception):
        response.cancel()


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _validation_message(e: RequestValidationError | ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts)


def make_openai_app() -> FastAPI:
    app = FastAPI(title="cluster: OpenAI-compatible API")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(InvalidRequestError(_validation_message(e)))

    return app


def make_ingress_class() -> type:
    """The ingress deployment class, with its own FastAPI app (nothing at module level)."""
    app = make_openai_app()

    @serve.ingress(app)
    class OpenAIIngress:
        def __init__(self, llm: DeploymentHandle, model_id: str, server: ServerArgs) -> None:
            self.llm = llm
            self.model_id = model_id
            self.api_key = server.resolved_api_key()

        def _authorize(self, request: Request) -> None:
            if self.api_key is None:
                return
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token, self.api_key):
                raise AuthenticationError("a valid 'Authorization: Bearer <key>' is required")

        def _check(self, request: Request, model: str | None = None) -> None:
            self._authorize(request)
            if model is not None and model != self.model_id:
                raise ModelNotFoundError(
                    f"the model {model!r} does not exist; this server serves {self.model_id!r}"
                )

        @app.get("/health")
        async def health(self) -> JSONResponse:
            try:
                await asyncio.wait_for(self.llm.model_card.remote(), timeout=10)
            except Exception as e:
                return error_response(e)
            return JSONResponse({"status": "ok"})

        @app.get("/v1/models")
        async def models(self, request: Request) -> JSONResponse:
            try:
                self._check(request)
                card = await self.llm.model_card.remote()
            except Exception as e:
                return error_response(e)
            entry = {"id": card["id"], "object": "model", "created": 0, "owned_by": "cluster"}
            entry["max_model_len"] = card["max_model_len"]
            return JSONResponse({"object": "list", "data": [entry]})

        @app.post("/v1/completions")
        async def completions(self, body: CompletionRequest, request: Request) -> Any:
            return await self._serve(body, request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
            return await self._serve(body, request, chat=True)

        async def _serve(
            self, body: CompletionRequest | ChatCompletionRequest, request: Request, chat: bool
        ) -> Any:
            try:
                self._check(request, body.model)
                fields = (
                    {"messages": body.messages}
                    if isinstance(body, ChatCompletionRequest)
                    else body.prompt_fields()
                )
                generate = GenerateRequest(
                    **fields, sampling_params=body.sampling_params(), stream=body.stream
                )
            except ValidationError as e:
                return error_response(InvalidRequestError(_validation_message(e)))
            except Exception as e:
                return error_response(e)
            formatter = ResponseFormatter(self.model_id, chat)
            # Serve may refuse the call itself (back-pressure): `.remote()` is guarded too.
            call = self.llm.options(stream=body.stream).generate
            try:
                response = call.remote(generate)
            except Exception as e:
                return error_response(e)
            try:
                # A stream's first chunk is awaited here, so that errors are statuses.
                first = await (response.__anext__() if body.stream else response)
            except asyncio.CancelledError:  # the client left: abort in the engine
                _cancel(response)
                raise
            except Exception as e:  # the call failed: nothing is left to cancel
                return error_response(e)
            if not body.stream:
                return JSONResponse(formatter.full(first))
            events = self._events(first, response, formatter, body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")

        async def _events(
            self,
            first: GenerateOutput,
            stream: DeploymentResponseGenerator,
            formatter: ResponseFormatter,
            include_usage: bool,
        ) -> AsyncIterator[str]:
            last = first
            try:
                yield _sse(formatter.chunk(first))
                async for out in stream:
                    last = out
                    yield _sse(formatter.chunk(out))
                if include_usage:
                    yield _sse(formatter.usage_chunk(last))
                yield _sse("[DONE]")
            except Exception as e:  # the status is already 200: report in the stream
                status, error_type, message = classify(e)
                yield _sse(error_body(status, message, error_type))
            finally:
                _cancel(stream)  # the client left early: abort the request in the engine

    return OpenAIIngress
