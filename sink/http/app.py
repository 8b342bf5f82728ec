"""The query app: `create_query_app` with its routes, hybrid fusion and the responses.

Routes: ``POST /v1/search`` (vector, text, hybrid or filter search), ``POST /v1/lookup``
(rows of primary keys), ``POST /internal/v1/fresh`` (another pod's fan-out request for this
pod's memtable part of its query) and ``GET /openapi.json``; the contract of each (bodies,
answers, statuses) is the `sink.http` package docstring. A route validates what needs no
table, then runs its query on a `sink.http.pool.QueryPool` thread within
``query.timeout_ms`` and maps the reader's errors to statuses. A hybrid query's two result
lists are fused here by reciprocal rank fusion (`RRF_K`). A result is answered as JSON, or
as an Arrow IPC stream when the request accepts `ARROW_STREAM`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pyarrow as pa
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import Response

from config.settings import QuerySettings
from engine.errors import FreshRowsUnavailable, LanceSinkError
from engine.filters import (
    FilterSyntaxError,
    FilterTooComplex,
    Predicate,
    QueryError,
    UnknownColumn,
)
from engine.reader import SCORE, FanoutReport, Reader
from engine.reads import trace
from engine.reads.remote import FRESH_PATH
from engine.threads import name_os_thread
from sink.http.errors import HttpError, add_error_handlers
from sink.http.guard import BodyLimit, RequestGuard
from sink.http.models import LookupRequest, QueryResponse, SearchRequest
from sink.http.pool import QueryPool
from sink.http.serving import SERVES_QUERY
from sink.query_share import QueryShare

log = structlog.get_logger("lance_sink.http")

ARROW_STREAM = "application/vnd.apache.arrow.stream"
#: Reciprocal rank fusion constant: 60 is the value of the original RRF paper (Cormack et
#: al. 2009); it damps the weight of the very first ranks so neither list dominates.
RRF_K = 60


def create_query_app(
    reader: Reader, settings: QuerySettings, share: QueryShare | None = None
) -> FastAPI:
    """The query API over `reader`, configured by `settings` (see the `sink.http` package
    docstring). On a writer pod, `share` is its consumer loop's `QueryShare`: every query
    and fan-out request running here counts in it."""
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
    pool = QueryPool(settings.max_concurrent_queries, share)
    app.state.query_pool = pool
    # Other pods' fan-out requests get their own slots: a burst of queries here that wait
    # on another pod cannot take the slots that pod's queries need here.
    fresh_pool = QueryPool(settings.max_concurrent_queries, share)
    app.state.fresh_pool = fresh_pool
    # The text half of a hybrid query runs here while its query's own thread runs the
    # vector half: the query takes the longer of the two, not their sum (with fan-out,
    # both halves wait for the same one request per owner pod, `Reader.search_hybrid`).
    hybrid_pool = ThreadPoolExecutor(
        settings.max_concurrent_queries, "query-hybrid", initializer=name_os_thread
    )
    app.state.hybrid_pool = hybrid_pool
    app.state.serves = {SERVES_QUERY}

    add_error_handlers(app)

    slow_s = None if settings.slow_query_ms is None else settings.slow_query_ms / 1000

    def traced(fn: Callable[[], Any], path: str) -> Callable[[], Any]:
        """`fn`, its stages traced on the pool thread, logged when it is slow."""

        def work() -> Any:
            with trace.traced() as spent:
                try:
                    return fn()
                finally:
                    if slow_s is not None and spent.seconds >= slow_s:
                        log.warning(
                            "query_slow",
                            path=path,
                            ms=round(spent.seconds * 1000, 1),
                            stages=spent.summary(),
                        )

        return work

    async def run(fn: Callable[[], Any], on: QueryPool = pool, path: str = "/v1/search") -> Any:
        future, task = on.submit(traced(fn, path))
        try:
            # shield: a timeout abandons the future instead of cancelling it (the work
            # cannot be interrupted); the pool frees its slot if it can (see `QueryPool`).
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError as exc:
            on.abandon(task)
            raise HttpError(
                504, "timeout", f"query took longer than {settings.timeout_ms} ms"
            ) from exc
        except FilterSyntaxError as exc:
            raise HttpError(400, "filter_syntax", str(exc)) from exc
        except FilterTooComplex as exc:
            raise HttpError(400, "filter_too_complex", str(exc)) from exc
        except UnknownColumn as exc:
            raise HttpError(400, "unknown_column", str(exc)) from exc
        except QueryError as exc:
            raise HttpError(400, "invalid_query", str(exc)) from exc
        except FreshRowsUnavailable as exc:
            raise HttpError(503, "fresh_rows_unavailable", str(exc)) from exc
        except LanceSinkError as exc:
            raise HttpError(503, "unavailable", str(exc)) from exc

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> Response:
        return Response(orjson.dumps(app.openapi()), media_type="application/json")

    def check_k(k: int) -> None:
        if not 1 <= k <= max_k:
            raise HttpError(400, "invalid_query", f"k must be between 1 and {max_k}, got {k}")

    @app.post(
        "/v1/search",
        response_model=QueryResponse,
        responses={400: {}, 401: {}, 413: {}, 503: {}, 504: {}},
        summary="Vector, full-text, hybrid or filter search",
    )
    async def search(body: SearchRequest, request: Request) -> Response:
        started = time.monotonic()
        if body.vector is None and body.text is None and body.filter is None:
            raise HttpError(
                400, "invalid_request", "empty request: give vector, text and/or filter"
            )
        check_k(body.k)
        if body.filter is not None and not body.filter.strip():
            raise HttpError(
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
            raise HttpError(400, "invalid_request", "empty request: give at least one key")
        if len(body.keys) > max_k:
            raise HttpError(
                400, "invalid_query", f"at most {max_k} keys per lookup, got {len(body.keys)}"
            )
        report = FanoutReport(allow_partial=body.allow_partial)
        table = await run(
            lambda: reader.lookup(body.keys, columns=body.columns, report=report),
            path="/v1/lookup",
        )
        return _respond(table, request, started, report)

    @app.post(FRESH_PATH, include_in_schema=False)
    async def fresh(request: Request) -> Response:
        """Another pod's fan-out request (the same token, checked by `RequestGuard`): this
        pod's memtable part of its query."""
        body = await request.body()
        answer: bytes = await run(lambda: reader.serve_fresh(body), fresh_pool, FRESH_PATH)
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
    """Reciprocal rank fusion of a kNN and a BM25 result (see `sink.http`), both
    searched on one snapshot (`Reader.search_hybrid`: one request per owner pod); the BM25
    search runs on `beside` meanwhile."""
    assert body.vector is not None
    assert body.text is not None
    out_cols = reader.columns(columns)
    identity = list(reader.spec.row_identity)  # an append table's rows may share a key
    fetch = list(dict.fromkeys([*out_cols, *identity]))
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
        keys = [
            tuple(tuple(v) if isinstance(v, list) else v for v in row.values())
            for row in table.select(identity).to_pylist()
        ]
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
