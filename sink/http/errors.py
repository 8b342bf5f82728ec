"""How the query API refuses a request: the JSON error body and the exception handlers.

Every refusal is ``{"error": {"type": ..., "message": ..., "request_id": ...}}`` with its
status (the statuses and types are listed in `sink.http`): a 401 also says
``WWW-Authenticate: Bearer``, a 503 ``Retry-After: 1``. Code that refuses raises
`HttpError` (the routes, `sink.http.pool.QueryPool`) or builds the body itself with
`error_response` (the middleware of `sink.http.guard`, which runs outside the app's
handlers). `add_error_handlers` answers `HttpError`, FastAPI's own refusals (a body it
cannot parse, an unknown path or method) and pydantic's validation errors in that form.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException


class HttpError(Exception):
    """A refusal with its answer: raised inside the app, answered by `add_error_handlers`.

    Attributes:
        status: the HTTP status (400, 503, 504, ...).
        kind: the error's ``type`` in the body (``invalid_query``, ``overloaded``, ...).
        message: the error's ``message`` in the body.
    """

    def __init__(self, status: int, kind: str, message: str) -> None:
        self.status = status
        self.kind = kind
        self.message = message
        super().__init__(message)


def error_response(status: int, kind: str, message: str, request_id: str | None = None) -> Response:
    """The JSON error answer (see the module docstring); `request_id` is named when given."""
    error = {"type": kind, "message": message}
    if request_id is not None:
        error["request_id"] = request_id
    body = orjson.dumps({"error": error})
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if status == 503:
        headers = {"Retry-After": "1"}
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _refusal(exc: StarletteHTTPException) -> str:
    """The message of one of FastAPI's refusals; for a body its JSON parser could not read,
    why (FastAPI's own says only that there was an error)."""
    cause = exc.__cause__
    if exc.status_code != 400 or cause is None:
        return str(exc.detail)
    if isinstance(cause, UnicodeDecodeError):
        return (
            f"the body is not UTF-8 text (byte {cause.start}); it is read as JSON whatever "
            "its Content-Type"
        )
    if isinstance(cause, RecursionError):
        return "the body's JSON nests too deeply to be read"
    return f"{exc.detail}: {type(cause).__name__}: {cause}"


def request_id_of(scope: Mapping[str, Any]) -> str | None:
    """The id `sink.http.guard.RequestGuard` gave this request (None outside it)."""
    state = scope.get("state")
    value = state.get("request_id") if isinstance(state, dict) else None
    return value if isinstance(value, str) else None


def add_error_handlers(app: FastAPI) -> None:
    """Answer `HttpError`, FastAPI's refusals and validation errors of `app` as JSON errors
    naming the request id."""

    @app.exception_handler(HttpError)
    async def http_error(request: Request, exc: HttpError) -> Response:
        return error_response(exc.status, exc.kind, exc.message, request_id_of(request.scope))

    @app.exception_handler(StarletteHTTPException)
    async def starlette_error(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI's own refusals (a body it cannot parse, an unknown path or method).
        kind = "invalid_request" if exc.status_code == 400 else "http_error"
        return error_response(exc.status_code, kind, _refusal(exc), request_id_of(request.scope))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        parts = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            message = str(e.get("msg", "invalid"))
            if e.get("type") == "json_invalid":
                message += " (the body is read as JSON whatever its Content-Type)"
            parts.append(f"{where or 'body'}: {message}")
        return error_response(
            400, "invalid_request", "; ".join(parts), request_id_of(request.scope)
        )
