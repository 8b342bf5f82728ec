"""The HTTP query API: `POST /v1/search` and `POST /v1/lookup` over an `engine.reader.Reader`.

Build the app with `create_query_app(reader, settings.query)` and serve it with `run_server`
(uvicorn in a background thread, no signal handlers of its own: the sink's CLI owns
SIGTERM/SIGINT and calls `handle.stop()` during its drain). The app is self-contained: the
metrics and health endpoints live on another app.

Requests and responses are JSON. A response is ``{"rows": [...], "count": n,
"took_ms": t}``; with ``Accept: application/vnd.apache.arrow.stream`` it is the result as an
Arrow IPC stream instead. The OpenAPI description is at ``/openapi.json`` (it needs the
bearer token like every other path when ``query.auth_token`` is set: it describes the
table's schema). No interactive ``/docs`` page is served.

`POST /v1/search` takes any of ``vector``, ``text`` and ``filter``:

- ``vector`` only: kNN (`_distance`, nearest first); ``text`` only: BM25 (`_score`, best
  first); ``filter`` only: up to k matching rows. ``filter`` with either is a pre-filter.
- ``vector`` and ``text``: hybrid. Both searches run with the same filter and k, and are
  fused by reciprocal rank fusion: ``_score = sum over the two lists of 1 / (60 + rank)``
  (rank from 1; a row missing from a list adds nothing), best first. RRF needs no score
  calibration between a distance and BM25, which is why it is used.

Errors (JSON ``{"error": {"type": ..., "message": ...}}``):

- 400: validation (empty request, k outside ``1..query.max_k``, wrong vector dimension,
  unknown column, bad filter syntax with its position, malformed JSON or wrong types);
- 401: ``query.auth_token`` is set and the ``Authorization: Bearer <token>`` header is
  missing or wrong (compared in constant time), on every path including ``/openapi.json``;
- 413: the body is larger than ``query.max_request_bytes`` (checked on Content-Length and
  while reading a chunked body);
- 503: a shard or the table cannot be read right now, or ``query.max_concurrent_queries``
  queries are already running (``Retry-After: 1``); retry;
- 504: the query took longer than ``query.timeout_ms``. The work itself cannot be
  interrupted; it finishes in its worker thread and its result is dropped.

Query threads. Queries run on the app's own pool of ``query.max_concurrent_queries``
threads, and a query holds its slot until its work has finished, *including after its
request got 504*. So timed-out queries cannot pile up: at most that many run at once, and a
request that finds every slot taken gets 503 at once instead of queueing behind them.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import orjson
import pyarrow as pa
import structlog
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from config.settings import QuerySettings
from engine.errors import LanceSinkError
from engine.filters import FilterSyntaxError, Predicate, QueryError, UnknownColumn
from engine.reader import SCORE, Reader

log = structlog.get_logger("lance_sink.http")

ARROW_STREAM = "application/vnd.apache.arrow.stream"
#: Reciprocal rank fusion constant: 60 is the value of the original RRF paper (Cormack et
#: al. 2009); it damps the weight of the very first ranks so neither list dominates.
RRF_K = 60

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class SearchRequest(BaseModel):
    """Body of `POST /v1/search`: at least one of vector, text, filter."""

    model_config = ConfigDict(extra="forbid")

    vector: list[float] | None = Field(default=None, description="Query vector (kNN).")
    text: str | None = Field(default=None, description="Full-text query (BM25).")
    text_column: str | None = Field(
        default=None, description="FTS column to search (default: the first fts_column)."
    )
    phrase: bool = Field(default=False, description="Match the text as a phrase.")
    filter: str | None = Field(default=None, description="SQL-like pre-filter.")
    k: int = Field(default=10, description="Rows to return (1..query.max_k).")
    columns: list[str] | None = Field(default=None, description="Columns (default: all).")
    nprobes: int | None = Field(default=None, ge=1, description="IVF partitions to probe.")
    refine_factor: int | None = Field(default=None, ge=1, description="Exact re-rank factor.")


class LookupRequest(BaseModel):
    """Body of `POST /v1/lookup`: primary-key values (lists for a composite key)."""

    model_config = ConfigDict(extra="forbid")

    keys: list[Any] = Field(description="Key values; one list per key for composite keys.")
    columns: list[str] | None = Field(default=None, description="Columns (default: all).")


class QueryResponse(BaseModel):
    """A JSON query result."""

    rows: list[dict[str, Any]]
    count: int
    took_ms: float


class _HttpError(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        self.status = status
        self.kind = kind
        self.message = message
        super().__init__(message)


def _error(status: int, kind: str, message: str) -> Response:
    body = orjson.dumps({"error": {"type": kind, "message": message}})
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if status == 503:
        headers = {"Retry-After": "1"}
    return Response(body, status_code=status, media_type="application/json", headers=headers)


class QueryPool:
    """At most `size` queries running at once, each on a thread of its own pool.

    `submit` takes a slot or raises `_HttpError` 503 when none is free; the slot is given back
    by the worker thread when the work ends, not when the request ends, so the work of
    timed-out requests (which cannot be interrupted) still counts against the bound.

    Lifecycle: built by `create_query_app` (kept as ``app.state.query_pool``);
    `shutdown` (from `ServerHandle.stop`) lets running work finish in the background.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._running = 0
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="query")

    @property
    def running(self) -> int:
        """Slots taken now (queries whose work has not finished)."""
        with self._lock:
            return self._running

    def _release(self) -> None:
        with self._lock:
            self._running -= 1

    def submit(self, fn: Callable[[], pa.Table]) -> asyncio.Future[pa.Table]:
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

        def work() -> pa.Table:
            try:
                return fn()
            finally:
                self._release()

        try:
            return asyncio.get_running_loop().run_in_executor(self._executor, work)
        except BaseException:
            self._release()
            raise

    def shutdown(self) -> None:
        """Accept no more work; running work finishes in the background."""
        self._executor.shutdown(wait=False, cancel_futures=True)


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
        await _error(413, "request_too_large", self._message())(scope, receive, send)


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

    async def authorize(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token):
            raise _HttpError(401, "unauthorized", "missing or wrong bearer token")

    @app.exception_handler(_HttpError)
    async def http_error(_request: Request, exc: _HttpError) -> Response:
        return _error(exc.status, exc.kind, exc.message)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> Response:
        parts = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            parts.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
        return _error(400, "invalid_request", "; ".join(parts))

    async def run(fn: Callable[[], pa.Table]) -> pa.Table:
        future = pool.submit(fn)
        try:
            # shield: a timeout abandons the future instead of cancelling it, so the work
            # keeps its pool slot until it really ends (see `QueryPool`).
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError as exc:
            raise _HttpError(
                504, "timeout", f"query took longer than {settings.timeout_ms} ms"
            ) from exc
        except FilterSyntaxError as exc:
            raise _HttpError(400, "filter_syntax", str(exc)) from exc
        except UnknownColumn as exc:
            raise _HttpError(400, "unknown_column", str(exc)) from exc
        except QueryError as exc:
            raise _HttpError(400, "invalid_query", str(exc)) from exc
        except LanceSinkError as exc:
            raise _HttpError(503, "unavailable", str(exc)) from exc

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(authorize)])
    async def openapi() -> Response:
        return Response(orjson.dumps(app.openapi()), media_type="application/json")

    def check_k(k: int) -> None:
        if not 1 <= k <= max_k:
            raise _HttpError(400, "invalid_query", f"k must be between 1 and {max_k}, got {k}")

    @app.post(
        "/v1/search",
        response_model=QueryResponse,
        responses={400: {}, 401: {}, 413: {}, 503: {}, 504: {}},
        dependencies=[Depends(authorize)],
        summary="Vector, full-text, hybrid or filter search",
    )
    async def search(body: SearchRequest, request: Request) -> Response:
        started = time.monotonic()
        if body.vector is None and body.text is None and body.filter is None:
            raise _HttpError(
                400, "invalid_request", "empty request: give vector, text and/or filter"
            )
        check_k(body.k)
        predicate: Predicate | None = None

        def vector_search(k: int, cols: list[str] | None) -> pa.Table:
            assert body.vector is not None
            return reader.search_vector(
                body.vector,
                k=k,
                filter=predicate,
                columns=cols,
                nprobes=body.nprobes,
                refine_factor=body.refine_factor,
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
            )

        def execute() -> pa.Table:
            nonlocal predicate
            predicate = reader.parse_filter(body.filter)
            columns = reader.columns(body.columns) if body.columns is not None else None
            if body.vector is not None and body.text is not None:
                return _hybrid(reader, vector_search, text_search, body.k, columns)
            if body.vector is not None:
                return vector_search(body.k, columns)
            if body.text is not None:
                return text_search(body.k, columns)
            return reader.scan(filter=predicate, columns=columns, limit=body.k)

        try:
            table = await run(execute)
        finally:
            log.debug("query_served", kind="search", seconds=round(time.monotonic() - started, 4))
        return _respond(table, request, started)

    @app.post(
        "/v1/lookup",
        response_model=QueryResponse,
        responses={400: {}, 401: {}, 413: {}, 503: {}, 504: {}},
        dependencies=[Depends(authorize)],
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
        table = await run(lambda: reader.lookup(body.keys, columns=body.columns))
        return _respond(table, request, started)

    app.add_middleware(BodyLimit, limit=int(settings.max_request_bytes))
    return app


def _hybrid(
    reader: Reader,
    vector_search: Callable[[int, list[str] | None], pa.Table],
    text_search: Callable[[int, list[str] | None], pa.Table],
    k: int,
    columns: list[str] | None,
) -> pa.Table:
    """Reciprocal rank fusion of a kNN and a BM25 result (see the module docstring)."""
    out_cols = reader.columns(columns)
    key_cols = list(reader.spec.primary_key)
    fetch = list(dict.fromkeys([*out_cols, *key_cols]))
    lists = [vector_search(k, fetch), text_search(k, fetch)]
    fused: dict[Any, float] = {}
    rows: dict[Any, dict[str, Any]] = {}
    for table in lists:
        keys = reader.keys_of(table)
        selected = table.select(out_cols).to_pylist()
        for rank, (key, row) in enumerate(zip(keys, selected, strict=True)):
            fused[key] = fused.get(key, 0.0) + 1.0 / (RRF_K + rank + 1)
            rows.setdefault(key, row)
    best = sorted(fused, key=lambda key: -fused[key])[:k]
    schema = pa.schema(
        [reader.spec.table_schema.field(c) for c in out_cols] + [pa.field(SCORE, pa.float32())]
    )
    return pa.Table.from_pylist([{**rows[key], SCORE: fused[key]} for key in best], schema=schema)


def _respond(table: pa.Table, request: Request, started: float) -> Response:
    if ARROW_STREAM in request.headers.get("accept", ""):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return Response(sink.getvalue().to_pybytes(), media_type=ARROW_STREAM)
    took = round((time.monotonic() - started) * 1000, 3)
    body = {"rows": table.to_pylist(), "count": table.num_rows, "took_ms": took}
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
        pool = getattr(getattr(self._server.config.app, "state", None), "query_pool", None)
        if isinstance(pool, QueryPool):
            pool.shutdown()


def run_server(
    app: FastAPI, host: str, port: int, *, startup_timeout: float = 10.0
) -> ServerHandle:
    """Serve `app` with uvicorn in a daemon thread; returns once it listens (port 0 = any).

    Raises:
        RuntimeError: the server did not start within `startup_timeout` seconds.
    """
    config = uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=False, lifespan="off"
    )
    server = _ThreadServer(config)
    thread = threading.Thread(target=server.run, name="query-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"query server did not start on {host}:{port}")
        time.sleep(0.01)
    handle = ServerHandle(server, thread)
    log.info("query_server_started", host=host, port=handle.port)
    return handle


__all__ = [
    "ARROW_STREAM",
    "LookupRequest",
    "QueryPool",
    "QueryResponse",
    "SearchRequest",
    "ServerHandle",
    "create_query_app",
    "run_server",
]
