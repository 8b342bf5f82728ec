"""The HTTP query API: `POST /v1/search` and `POST /v1/lookup` over an `engine.reader.Reader`.

Build the app with `create_query_app(reader, settings.query)` and serve it with `run_server`
(uvicorn in a background thread, no signal handlers of its own: the sink's CLI owns
SIGTERM/SIGINT and calls `handle.stop()` during its drain). The app is self-contained: the
metrics and health endpoints live on another app.

Requests and responses are JSON. A request body is read as JSON whatever its
``Content-Type`` (``curl -d`` sends ``application/x-www-form-urlencoded``). A response is
``{"rows": [...], "count": n, "took_ms": t}``; with ``Accept:
application/vnd.apache.arrow.stream`` it is the result as an Arrow IPC stream instead. The
OpenAPI description is at ``/openapi.json`` (it needs the bearer token like every other path
when ``query.auth_token`` is set: it describes the table's schema). No interactive ``/docs``
page is served.

`POST /v1/search` takes any of ``vector``, ``text`` and ``filter``:

- ``vector`` only: kNN (`_distance`, nearest first); ``text`` only: BM25 (`_score`, best
  first); ``filter`` only: up to k matching rows. ``filter`` with either is a pre-filter.
- ``vector`` and ``text``: hybrid. Both searches run with the same filter and k on one
  snapshot (with fan-out: one request per owner pod for both), and are fused by reciprocal
  rank fusion: ``_score = sum over the two lists of 1 / (60 + rank)`` (rank from 1; a row
  missing from a list adds nothing), best first. RRF needs no score calibration between a
  distance and BM25, which is why it is used.

Fresh rows of other pods (several pods in one consumer group, see `engine.reads.remote`): a
query reads every shard's memtables, its own and, within ``query.fanout_timeout_ms``, those
of the pods that own the other shards (``POST /internal/v1/fresh``, same port and token).
When an owner does not answer in time, the answer says so: with ``allow_partial`` (the
default) it is ``{"partial": true, "missing": [{"shard", "partitions", "owner",
"reason"}, ...], ...}`` (Arrow: the headers ``X-Lance-Sink-Partial: true`` and
``X-Lance-Sink-Missing`` with that list as JSON); with ``"allow_partial": false`` it is 503.

Errors (JSON ``{"error": {"type": ..., "message": ..., "request_id": ...}}``; the request
id is also the ``X-Request-Id`` response header of every answer):

- 400: validation (empty request, k outside ``1..query.max_k``, ``nprobes`` or
  ``refine_factor`` out of range, wrong vector dimension, unknown column, bad filter syntax
  with its position, a blank filter, a filter over `engine.filters.MAX_PREDICATES`, text
  that is not valid Unicode, a lookup key not of its column's type, malformed JSON or wrong
  types);
- 401: ``query.auth_token`` is set and the ``Authorization: Bearer <token>`` header is
  missing or wrong (compared in constant time), checked before the body is read or
  validated, on every path including ``/openapi.json`` and ``/v1/status``, except
  ``OPEN_PATHS`` (``/metrics``, ``/healthz``, ``/readyz``: for Prometheus and the kubelet,
  which carry no token; they tell nothing about the table's contents);
- 413: the body is larger than ``query.max_request_bytes`` (checked on Content-Length and
  while reading a chunked body);
- 503: a shard or the table cannot be read right now, or ``query.max_concurrent_queries``
  queries are already running (``Retry-After: 1``), or another pod's fresh rows did not
  arrive in time and the request set ``"allow_partial": false``; retry;
- 504: the query took longer than ``query.timeout_ms``. The work itself cannot be
  interrupted; it finishes in its worker thread and its result is dropped.
- 500: a bug. The body names the request id; the failure is logged once, as the
  structured event ``query_request_failed`` with that id and the traceback.

Query threads. Queries run on the app's own pool (see `QueryPool`):
``query.max_concurrent_queries`` slots for queries someone waits for, plus as many threads
for abandoned work, i.e. queries whose request got 504 but whose work (which cannot be
interrupted) is still running. A 504 hands its slot over to new queries while the
abandoned work is under that second bound; past it, timed-out work keeps its slot until it
ends. So a slot is held by a query nobody waits for at most ``query.timeout_ms`` while fewer
than ``max_concurrent_queries`` such queries run, the threads of the process stay bounded
(twice the setting), and a request that finds every slot taken gets 503 at once instead of
queueing.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import orjson
import pyarrow as pa
import structlog
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from config.settings import QuerySettings
from engine.errors import FatalError, FreshRowsUnavailable, LanceSinkError
from engine.filters import (
    FilterSyntaxError,
    FilterTooComplex,
    Predicate,
    QueryError,
    UnknownColumn,
)
from engine.reader import SCORE, FanoutReport, Reader
from engine.reads.remote import FRESH_PATH
from engine.threads import name_os_thread

log = structlog.get_logger("lance_sink.http")

ARROW_STREAM = "application/vnd.apache.arrow.stream"
#: Reciprocal rank fusion constant: 60 is the value of the original RRF paper (Cormack et
#: al. 2009); it damps the weight of the very first ranks so neither list dominates.
RRF_K = 60
#: Paths that answer without the bearer token: Prometheus scrapes and the kubelet's probes
#: carry none, and none of them tells anything about the table's contents.
OPEN_PATHS = frozenset({"/metrics", "/healthz", "/readyz"})
#: Paths whose bodies are read as JSON whatever their Content-Type.
JSON_PATHS = frozenset({"/v1/search", "/v1/lookup"})
#: Most IVF partitions a request may probe: an IVF index has about sqrt(rows) partitions,
#: so 65 536 covers 4 billion rows; Lance overflows on larger values.
MAX_NPROBES = 65_536
#: Largest re-rank factor a request may ask: Lance re-ranks k * refine_factor candidates
#: exactly, so with `query.max_k` 1 000 this is at most 100 000 rows read (the default is 10).
MAX_REFINE_FACTOR = 100

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _valid_unicode(value: Any) -> Any:
    """Refuse strings (also inside lists) that hold lone surrogates: JSON can carry them
    (``"\\ud800"``) but they are not text, and Lance's tokenizer cannot encode them."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, list):
            _valid_unicode(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = item[exc.start : exc.end].encode("unicode_escape").decode()
                raise ValueError(
                    f"not valid Unicode: lone surrogate {bad} at character {exc.start}"
                ) from exc
    return value


class SearchRequest(BaseModel):
    """Body of `POST /v1/search`: at least one of vector, text, filter."""

    model_config = ConfigDict(extra="forbid")

    _unicode = field_validator("text", "text_column", "filter", "columns")(_valid_unicode)

    vector: list[StrictFloat] | None = Field(
        default=None, description="Query vector (kNN): JSON numbers."
    )
    text: str | None = Field(default=None, description="Full-text query (BM25).")
    text_column: str | None = Field(
        default=None,
        min_length=1,
        description="FTS column to search (default: the first fts_column).",
    )
    phrase: bool = Field(default=False, strict=True, description="Match the text as a phrase.")
    filter: str | None = Field(default=None, description="SQL-like pre-filter.")
    k: int = Field(default=10, strict=True, description="Rows to return (1..query.max_k).")
    columns: list[str] | None = Field(
        default=None, min_length=1, description="Columns (default: all)."
    )
    nprobes: int | None = Field(
        default=None,
        ge=1,
        le=MAX_NPROBES,
        strict=True,
        description="IVF partitions to probe at least (more while a filter leaves fewer than "
        "k rows in them).",
    )
    refine_factor: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REFINE_FACTOR,
        strict=True,
        description="Exact re-rank factor.",
    )
    allow_partial: bool = Field(
        default=True,
        strict=True,
        description="When another pod's fresh rows do not arrive in time: answer without "
        "them, saying so (partial, missing), or fail with 503 (false).",
    )


class LookupRequest(BaseModel):
    """Body of `POST /v1/lookup`: primary-key values (lists for a composite key)."""

    model_config = ConfigDict(extra="forbid")

    _unicode = field_validator("keys", "columns")(_valid_unicode)

    keys: list[Any] = Field(description="Key values; one list per key for composite keys.")
    columns: list[str] | None = Field(
        default=None, min_length=1, description="Columns (default: all)."
    )
    allow_partial: bool = Field(
        default=True,
        strict=True,
        description="When another pod's fresh rows do not arrive in time: answer without "
        "them, saying so (partial, missing), or fail with 503 (false).",
    )


class QueryResponse(BaseModel):
    """A JSON query result."""

    rows: list[dict[str, Any]]
    count: int
    took_ms: float
    partial: bool = Field(
        default=False, description="Present and true when other pods' fresh rows are missing."
    )
    missing: list[dict[str, Any]] = Field(
        default_factory=list, description="The shards whose fresh rows are missing, and why."
    )


class _HttpError(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        self.status = status
        self.kind = kind
        self.message = message
        super().__init__(message)


def _error(status: int, kind: str, message: str, request_id: str | None = None) -> Response:
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


def request_id_of(scope: Scope) -> str | None:
    """The id `RequestGuard` gave this request (None outside it)."""
    state = scope.get("state")
    value = state.get("request_id") if isinstance(state, dict) else None
    return value if isinstance(value, str) else None


class _Task:
    """One query's claim on the pool: a slot, or (once abandoned) an abandoned-work place."""

    __slots__ = ("abandoned", "done")

    def __init__(self) -> None:
        self.abandoned = False
        self.done = False


class QueryPool:
    """At most `size` queries someone waits for, plus at most `size` abandoned ones.

    `submit` takes a slot or raises `_HttpError` 503 when none is free. The worker thread
    gives the slot back when the work ends. A request that gives up on its query (504)
    calls `abandon`: the work (which cannot be interrupted) goes on, counted as abandoned,
    and its slot is free for new queries at once, unless `size` abandoned queries are
    running already; then it keeps its slot until it ends, as every query did before. So a
    query nobody waits for holds a slot at most `query.timeout_ms` (under that bound),
    threads stay bounded (2 * `size`), and a flood of slow queries cannot grow them.

    Lifecycle: built by `create_query_app` (kept as ``app.state.query_pool``);
    `shutdown` (from `ServerHandle.stop`) lets running work finish in the background.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._running = 0
        self._abandoned = 0
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(
            max_workers=2 * size, thread_name_prefix="query", initializer=name_os_thread
        )

    @property
    def running(self) -> int:
        """Slots taken now (queries someone waits for, or abandoned past the bound)."""
        with self._lock:
            return self._running

    @property
    def abandoned(self) -> int:
        """Abandoned queries whose work still runs without holding a slot."""
        with self._lock:
            return self._abandoned

    def _release(self, task: _Task) -> None:
        with self._lock:
            task.done = True
            if task.abandoned:
                self._abandoned -= 1
            else:
                self._running -= 1

    def abandon(self, task: _Task) -> None:
        """Nobody waits for `task` any more: free its slot if abandoned work is under its
        bound (else the slot is freed when the work ends)."""
        with self._lock:
            if task.done or task.abandoned or self._abandoned >= self.size:
                return
            task.abandoned = True
            self._running -= 1
            self._abandoned += 1

    def submit(self, fn: Callable[[], pa.Table]) -> tuple[asyncio.Future[pa.Table], _Task]:
        """Start `fn` on a pool thread (call from the event loop).

        Raises:
            _HttpError: 503, every slot is taken.
        """
        with self._lock:
            if self._running >= self.size:
                raise _HttpError(
                    503,
                    "overloaded",
                    f"{self.size} queries are already running (query.max_concurrent_queries)",
                )
            self._running += 1
        task = _Task()

        def work() -> pa.Table:
            try:
                return fn()
            finally:
                self._release(task)

        try:
            return asyncio.get_running_loop().run_in_executor(self._executor, work), task
        except BaseException:
            self._release(task)
            raise

    def shutdown(self) -> None:
        """Accept no more work; running work finishes in the background."""
        self._executor.shutdown(wait=False, cancel_futures=True)


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
                response = _error(401, "unauthorized", "missing or wrong bearer token", request_id)
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
            await _error(500, "internal", message, request_id)(scope, receive, send_with_id)


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
        response = _error(413, "request_too_large", self._message(), request_id_of(scope))
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


def create_query_app(reader: Reader, settings: QuerySettings) -> FastAPI:
    """The query API over `reader`, configured by `settings` (see the module docstring)."""
    app = FastAPI(
        title="lance-sink query API",
        version="1",
        description="Vector, full-text, filter and primary-key reads over the Lance table "
        "and the unflushed memtables of this pod's shards.",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,  # served below, behind the same auth as the query paths
    )
    token = settings.auth_token.get_secret_value().encode() if settings.auth_token else None
    timeout = settings.timeout_ms / 1000
    max_k = settings.max_k
    pool = QueryPool(settings.max_concurrent_queries)
    app.state.query_pool = pool
    # Other pods' fan-out requests get their own slots: a burst of queries here that wait
    # on another pod cannot take the slots that pod's queries need here.
    fresh_pool = QueryPool(settings.max_concurrent_queries)
    app.state.fresh_pool = fresh_pool
    # The text half of a hybrid query runs here while its query's own thread runs the
    # vector half: the query takes the longer of the two, not their sum (with fan-out,
    # both halves wait for the same one request per owner pod, `Reader.search_hybrid`).
    hybrid_pool = ThreadPoolExecutor(
        settings.max_concurrent_queries, "query-hybrid", initializer=name_os_thread
    )
    app.state.hybrid_pool = hybrid_pool
    app.state.serves = {SERVES_QUERY}

    @app.exception_handler(_HttpError)
    async def http_error(request: Request, exc: _HttpError) -> Response:
        return _error(exc.status, exc.kind, exc.message, request_id_of(request.scope))

    @app.exception_handler(StarletteHTTPException)
    async def starlette_error(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI's own refusals (a body it cannot parse, an unknown path or method).
        kind = "invalid_request" if exc.status_code == 400 else "http_error"
        return _error(exc.status_code, kind, _refusal(exc), request_id_of(request.scope))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        parts = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            message = str(e.get("msg", "invalid"))
            if e.get("type") == "json_invalid":
                message += " (the body is read as JSON whatever its Content-Type)"
            parts.append(f"{where or 'body'}: {message}")
        return _error(400, "invalid_request", "; ".join(parts), request_id_of(request.scope))

    async def run(fn: Callable[[], Any], on: QueryPool = pool) -> Any:
        future, task = on.submit(fn)
        try:
            # shield: a timeout abandons the future instead of cancelling it (the work
            # cannot be interrupted); the pool frees its slot if it can (see `QueryPool`).
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError as exc:
            on.abandon(task)
            raise _HttpError(
                504, "timeout", f"query took longer than {settings.timeout_ms} ms"
            ) from exc
        except FilterSyntaxError as exc:
            raise _HttpError(400, "filter_syntax", str(exc)) from exc
        except FilterTooComplex as exc:
            raise _HttpError(400, "filter_too_complex", str(exc)) from exc
        except UnknownColumn as exc:
            raise _HttpError(400, "unknown_column", str(exc)) from exc
        except QueryError as exc:
            raise _HttpError(400, "invalid_query", str(exc)) from exc
        except FreshRowsUnavailable as exc:
            raise _HttpError(503, "fresh_rows_unavailable", str(exc)) from exc
        except LanceSinkError as exc:
            raise _HttpError(503, "unavailable", str(exc)) from exc

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> Response:
        return Response(orjson.dumps(app.openapi()), media_type="application/json")

    def check_k(k: int) -> None:
        if not 1 <= k <= max_k:
            raise _HttpError(400, "invalid_query", f"k must be between 1 and {max_k}, got {k}")

    @app.post(
        "/v1/search",
        response_model=QueryResponse,
        responses={400: {}, 401: {}, 413: {}, 503: {}, 504: {}},
        summary="Vector, full-text, hybrid or filter search",
    )
    async def search(body: SearchRequest, request: Request) -> Response:
        started = time.monotonic()
        if body.vector is None and body.text is None and body.filter is None:
            raise _HttpError(
                400, "invalid_request", "empty request: give vector, text and/or filter"
            )
        check_k(body.k)
        if body.filter is not None and not body.filter.strip():
            raise _HttpError(
                400,
                "invalid_request",
                "filter is blank: omit it (or send null) to search without a filter",
            )
        predicate: Predicate | None = None
        report = FanoutReport(allow_partial=body.allow_partial)

        def vector_search(k: int, cols: list[str] | None) -> pa.Table:
            assert body.vector is not None
            return reader.search_vector(
                body.vector,
                k=k,
                filter=predicate,
                columns=cols,
                nprobes=body.nprobes,
                refine_factor=body.refine_factor,
                report=report,
            )

        def text_search(k: int, cols: list[str] | None) -> pa.Table:
            assert body.text is not None
            return reader.search_text(
                body.text,
                k=k,
                column=body.text_column,
                phrase=body.phrase,
                filter=predicate,
                columns=cols,
                report=report,
            )

        def execute() -> pa.Table:
            nonlocal predicate
            predicate = reader.parse_filter(body.filter)
            columns = reader.columns(body.columns) if body.columns is not None else None
            if body.vector is not None and body.text is not None:
                return _hybrid(reader, body, predicate, columns, report, hybrid_pool)
            if body.vector is not None:
                return vector_search(body.k, columns)
            if body.text is not None:
                return text_search(body.k, columns)
            return reader.scan(filter=predicate, columns=columns, limit=body.k, report=report)

        try:
            table = await run(execute)
        finally:
            log.debug("query_served", kind="search", seconds=round(time.monotonic() - started, 4))
        return _respond(table, request, started, report)

    @app.post(
        "/v1/lookup",
        response_model=QueryResponse,
        responses={400: {}, 401: {}, 413: {}, 503: {}, 504: {}},
        summary="Rows of many primary keys",
    )
    async def lookup(body: LookupRequest, request: Request) -> Response:
        started = time.monotonic()
        if not body.keys:
            raise _HttpError(400, "invalid_request", "empty request: give at least one key")
        if len(body.keys) > max_k:
            raise _HttpError(
                400, "invalid_query", f"at most {max_k} keys per lookup, got {len(body.keys)}"
            )
        report = FanoutReport(allow_partial=body.allow_partial)
        table = await run(lambda: reader.lookup(body.keys, columns=body.columns, report=report))
        return _respond(table, request, started, report)

    @app.post(FRESH_PATH, include_in_schema=False)
    async def fresh(request: Request) -> Response:
        """Another pod's fan-out request (the same token, checked by `RequestGuard`): this
        pod's memtable part of its query."""
        body = await request.body()
        answer: bytes = await run(lambda: reader.serve_fresh(body), fresh_pool)
        return Response(answer, media_type=ARROW_STREAM)

    app.add_middleware(BodyLimit, limit=int(settings.max_request_bytes))
    app.add_middleware(RequestGuard, token=token)  # added last: runs first
    return app


def _hybrid(
    reader: Reader,
    body: SearchRequest,
    predicate: Predicate | None,
    columns: list[str] | None,
    report: FanoutReport,
    beside: ThreadPoolExecutor,
) -> pa.Table:
    """Reciprocal rank fusion of a kNN and a BM25 result (see the module docstring), both
    searched on one snapshot (`Reader.search_hybrid`: one request per owner pod); the BM25
    search runs on `beside` meanwhile."""
    assert body.vector is not None
    assert body.text is not None
    out_cols = reader.columns(columns)
    key_cols = list(reader.spec.primary_key)
    fetch = list(dict.fromkeys([*out_cols, *key_cols]))
    lists = reader.search_hybrid(
        body.vector,
        body.text,
        k=body.k,
        column=body.text_column,
        phrase=body.phrase,
        filter=predicate,
        columns=fetch,
        nprobes=body.nprobes,
        refine_factor=body.refine_factor,
        report=report,
        beside=beside,
    )
    fused: dict[Any, float] = {}
    rows: dict[Any, dict[str, Any]] = {}
    for table in lists:
        keys = reader.keys_of(table)
        selected = table.select(out_cols).to_pylist()
        for rank, (key, row) in enumerate(zip(keys, selected, strict=True)):
            fused[key] = fused.get(key, 0.0) + 1.0 / (RRF_K + rank + 1)
            rows.setdefault(key, row)
    best = sorted(fused, key=lambda key: -fused[key])[: body.k]
    schema = pa.schema(
        [reader.spec.table_schema.field(c) for c in out_cols] + [pa.field(SCORE, pa.float32())]
    )
    return pa.Table.from_pylist([{**rows[key], SCORE: fused[key]} for key in best], schema=schema)


def _respond(table: pa.Table, request: Request, started: float, report: FanoutReport) -> Response:
    # Report each missing shard once.
    missing = list({m.shard: m.as_dict() for m in report.missing}.values())
    if ARROW_STREAM in request.headers.get("accept", ""):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        headers = None
        if missing:
            headers = {
                "X-Lance-Sink-Partial": "true",
                "X-Lance-Sink-Missing": orjson.dumps(missing).decode(),
            }
        return Response(sink.getvalue().to_pybytes(), media_type=ARROW_STREAM, headers=headers)
    took = round((time.monotonic() - started) * 1000, 3)
    body: dict[str, Any] = {"rows": table.to_pylist(), "count": table.num_rows, "took_ms": took}
    if missing:
        body.update(partial=True, missing=missing)
    return Response(orjson.dumps(body, default=_json_default), media_type="application/json")


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


# --------------------------------------------------------------------------- server


class _ThreadServer(uvicorn.Server):
    """A uvicorn server that never touches process signals (the CLI owns them)."""

    @contextmanager
    def capture_signals(self) -> Any:
        yield


class ServerHandle:
    """A running uvicorn server: `port` is the bound port; `stop()` shuts it down."""

    def __init__(self, server: _ThreadServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        sockets = [s for srv in (self._server.servers or []) for s in srv.sockets]
        return int(sockets[0].getsockname()[1]) if sockets else 0

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, finish in-flight requests (bounded), and join the thread."""
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout)
        state = getattr(self._server.config.app, "state", None)
        for name in ("query_pool", "fresh_pool"):
            pool = getattr(state, name, None)
            if isinstance(pool, QueryPool):
                pool.shutdown()
        hybrid = getattr(state, "hybrid_pool", None)
        if isinstance(hybrid, ThreadPoolExecutor):
            hybrid.shutdown(wait=False)


#: What an app serves (`app.state.serves`, set by `create_query_app` and
#: `sink.server.create_ops_app`): the query API, the metrics and health endpoints, or both.
SERVES_QUERY = "query"
SERVES_METRICS = "metrics"

#: The event `run_server` logs once a server listens, and its thread's name, by what it
#: serves: each server says which one it is.
_STARTED: dict[frozenset[str], tuple[str, str]] = {
    frozenset({SERVES_QUERY}): ("query_server_started", "query-http"),
    frozenset({SERVES_METRICS}): ("metrics_server_started", "metrics-http"),
    frozenset({SERVES_QUERY, SERVES_METRICS}): ("query_and_metrics_server_started", "ops-http"),
}


def serves(app: FastAPI) -> frozenset[str]:
    """What `app` serves (`SERVES_QUERY`, `SERVES_METRICS`); empty for another app."""
    return frozenset(getattr(app.state, "serves", ()))


class ListenError(FatalError):
    """A server cannot listen on its address: the port is taken by another process, the
    host is not an address of this machine, or the port needs a privilege. Raised by
    `run_server` in the caller's thread before anything is served.

    Attributes:
        host: the address it was to listen on.
        port: the port it was to listen on.
        serves: what the server was to serve (`SERVES_QUERY`, `SERVES_METRICS`), from which
            the caller names the setting (`query.port`, `observability.metrics_port`).
        reason: the operating system's reason (e.g. "Address already in use").
    """

    def __init__(self, host: str, port: int, serves: frozenset[str], reason: str) -> None:
        super().__init__(f"cannot listen on {host}:{port}: {reason}")
        self.host = host
        self.port = port
        self.serves = serves
        self.reason = reason


def _bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address `host` resolves to, made as asyncio's
    `loop.create_server(host=..., port=...)` (which uvicorn calls otherwise) makes them:
    SO_REUSEADDR, IPv6 sockets IPv6-only. Binding here makes a failure an `OSError` in the
    caller's thread; inside uvicorn it was a log line and a `sys.exit` of the server thread.

    Raises:
        OSError: the address cannot be resolved or bound.
    """
    infos = socket.getaddrinfo(
        host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def run_server(
    app: FastAPI, host: str, port: int, *, startup_timeout: float = 10.0
) -> ServerHandle:
    """Serve `app` with uvicorn in a daemon thread; returns once it listens (port 0 = any).
    Logs `query_server_started`, `metrics_server_started` or
    `query_and_metrics_server_started` (by `serves(app)`; `http_server_started` for another
    app) with the host and the bound port.

    Raises:
        ListenError: `host`:`port` cannot be listened on (in use, not this machine's, ...).
        RuntimeError: the server did not start within `startup_timeout` seconds.
    """
    what = serves(app)
    event, thread_name = _STARTED.get(what, ("http_server_started", "http"))
    try:
        sockets = _bind(host, port)
    except OSError as exc:
        raise ListenError(host, port, what, exc.strerror or str(exc)) from exc
    config = uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=False, lifespan="off"
    )
    server = _ThreadServer(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": sockets}, name=thread_name, daemon=True
    )
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            for sock in sockets:
                sock.close()
            raise RuntimeError(f"server ({thread_name}) did not start on {host}:{port}")
        time.sleep(0.01)
    handle = ServerHandle(server, thread)
    log.info(event, host=host, port=handle.port)
    return handle


__all__ = [
    "ARROW_STREAM",
    "OPEN_PATHS",
    "SERVES_METRICS",
    "SERVES_QUERY",
    "ListenError",
    "LookupRequest",
    "QueryPool",
    "QueryResponse",
    "RequestGuard",
    "SearchRequest",
    "ServerHandle",
    "create_query_app",
    "run_server",
    "serves",
]
