"""The FastAPI app the OpenAI routes hang on: the Bearer-key middleware (checked before
routing or parsing, so an unauthenticated caller learns nothing about the schema) and
OpenAI-style JSON errors with real statuses, FastAPI's own failures included."""

import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from cluster.serve.errors import AuthenticationError, InvalidRequestError, classify, error_body


def error_response(exc: BaseException) -> JSONResponse:
    status, error_type, message = classify(exc)
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(error_body(status, message, error_type), status, headers=headers)


def validation_message(e: RequestValidationError | ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts)


# Paths (below the route prefix) that answer without the API key.
OPEN_PATHS = frozenset({"/health", "/metrics"})  # as vLLM: scrapers send no key


class BearerAuth:
    """ASGI middleware: with an API key set (`app.state.api_key`), every HTTP path but
    `OPEN_PATHS` needs `Authorization: Bearer <key>`; checked before routing or parsing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            key = scope["app"].state.api_key
            if key is not None and _path(scope) not in OPEN_PATHS and not _authorized(scope, key):
                response = error_response(
                    AuthenticationError("a valid 'Authorization: Bearer <key>' is required")
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _path(scope: Scope) -> str:
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _authorized(scope: Scope, key: str) -> bool:
    headers = dict(scope["headers"])
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def make_openai_app() -> FastAPI:
    app = FastAPI(title="cluster: OpenAI-compatible API")
    app.state.api_key = None  # each replica sets it where it runs
    app.add_middleware(BearerAuth)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(InvalidRequestError(validation_message(e)))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        # FastAPI's own errors: a body it cannot parse (400), an unknown path (404), ...
        kind = "invalid_request_error" if e.status_code < 500 else "internal_error"
        if e.status_code == 404:
            kind = "not_found_error"
        return JSONResponse(error_body(e.status_code, str(e.detail), kind), e.status_code)

    return app
