"""The ASGI middleware every request of the HTTP servers goes through before the app.

`RequestGuard` (outermost, on the query app and the operations app) gives each request its
id, checks the bearer token on every path but `OPEN_PATHS`, reads the bodies of
`JSON_PATHS` as JSON whatever their Content-Type, and answers an exception that escaped the
app with a JSON 500. `BodyLimit` (query app) refuses bodies above ``query.max_request_bytes``
with 413, on Content-Length or while reading a chunked body. Both answer with
`sink.http.errors.error_response`: they run outside the app's exception handlers.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import structlog

from sink.http.errors import error_response, request_id_of

log = structlog.get_logger("lance_sink.http")

#: Paths that answer without the bearer token: Prometheus scrapes and the kubelet's probes
#: carry none, and none of them tells anything about the table's contents.
OPEN_PATHS = frozenset({"/metrics", "/healthz", "/readyz"})
#: Paths whose bodies are read as JSON whatever their Content-Type.
JSON_PATHS = frozenset({"/v1/search", "/v1/lookup"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class RequestGuard:
    """ASGI middleware, outermost: what every request goes through before the app.

    1. gives the request an id (``scope["state"]["request_id"]``, and the ``X-Request-Id``
       header of the answer);
    2. checks the bearer token (if `token` is set) on every path but `open_paths`, before
       the body is read: an unauthenticated request gets 401 whatever its body;
    3. marks the body of `JSON_PATHS` as JSON whatever its Content-Type;
    4. answers an exception that escaped the app with a JSON 500 naming the request id, and
       logs it once as the structured event ``query_request_failed`` (so no server prints a
       plain traceback).
    """

    def __init__(
        self, app: ASGIApp, token: bytes | None, open_paths: frozenset[str] = OPEN_PATHS
    ) -> None:
        self.app = app
        self.token = token
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        path = scope.get("path", "")
        headers = scope.get("headers", [])
        if self.token is not None and path not in self.open_paths:
            given = b""
            for name, value in headers:
                if name == b"authorization":
                    given = value
            scheme, _, credential = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(
                credential.strip(), self.token
            ):
                response = error_response(
                    401, "unauthorized", "missing or wrong bearer token", request_id
                )
                await response(scope, receive, send_with_id)
                return
        if path in JSON_PATHS and scope.get("method") == "POST":
            scope["headers"] = [
                *((n, v) for n, v in headers if n != b"content-type"),
                (b"content-type", b"application/json"),
            ]
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            log.error(
                "query_request_failed",
                request_id=request_id,
                path=path,
                error=f"{type(exc).__name__}: {exc}",
                exc_info=exc,
            )
            if started:
                return  # the answer is under way: the client sees the connection end
            message = f"internal error (request id {request_id}); the server log has details"
            await error_response(500, "internal", message, request_id)(scope, receive, send_with_id)


class BodyLimit:
    """ASGI middleware: 413 for bodies above `limit` bytes (Content-Length or streamed)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._reject(scope, receive, send)
                return
        # Read the whole body here (it is bounded by the limit), then replay it to the app.
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([], message), send)
                return
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.limit:
                await self._reject(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(chunks, None), send)

    def _message(self) -> str:
        return f"request body larger than {self.limit} bytes (query.max_request_bytes)"

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, "request_too_large", self._message(), request_id_of(scope))
        await response(scope, receive, send)


def _replay(chunks: list[bytes], final: Message | None) -> Receive:
    """A `receive` that returns the buffered body once, then waits like the server would."""
    sent = False
    never = asyncio.Event()

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            if final is not None:
                return final
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await never.wait()  # a disconnect is not reported after the body was delivered
        return {"type": "http.disconnect"}

    return receive
