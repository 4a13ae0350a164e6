"""Errors that reach clients, each with its HTTP status and OpenAI-style JSON body.

The replica raises these (a handle caller gets them wrapped in `RayTaskError`, which is
also an instance of the original class); `classify` maps anything the OpenAI routes
catch, the engine's actor errors included, to a status and a message. Serve's own
back-pressure (`max_queued_requests`) never reaches our routes: Serve answers it (the
replica's direct-ingress server behind HAProxy, or its proxy) with a 503 and its own text.
"""

from __future__ import annotations

from typing import Any


class ServeError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequestError(ServeError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(ServeError):
    status_code = 401
    error_type = "authentication_error"


class ModelNotFoundError(ServeError):
    status_code = 404
    error_type = "not_found_error"


class OverloadedError(ServeError):
    status_code = 429
    error_type = "rate_limit_error"


class EngineUnavailableError(ServeError):
    status_code = 503
    error_type = "service_unavailable"


def error_body(status_code: int, message: str, error_type: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": status_code}}


def classify(exc: BaseException) -> tuple[int, str, str]:
    """(status, OpenAI error type, message) for an exception a route caught."""
    import ray

    from cluster.engine.errors import EngineDeadError

    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
    if isinstance(cause, ServeError):
        return cause.status_code, cause.error_type, cause.message
    if isinstance(cause, ray.exceptions.RayActorError | EngineDeadError):
        return 503, "service_unavailable", f"the engine is unavailable: {cause}"
    if isinstance(cause, ValueError):
        return 400, "invalid_request_error", str(cause)
    return 500, "internal_error", f"{type(cause).__name__}: {cause}"
