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

Query threads: at most ``query.max_concurrent_queries`` queries run at once, plus as many
abandoned by a 504 (see `sink.http.pool`); a request that finds every slot taken gets 503
at once instead of queueing.

The package, one concern per module, in the order a request meets them:

- `guard`: the ASGI middleware (`RequestGuard`: request id, bearer token, JSON bodies, 500s;
  `BodyLimit`: 413) and `OPEN_PATHS`.
- `errors`: the JSON error body and the app's exception handlers.
- `models`: the request and response bodies (`SearchRequest`, `LookupRequest`,
  `QueryResponse`).
- `app`: `create_query_app`, its routes, hybrid fusion and the JSON or Arrow responses.
- `pool`: `QueryPool`, the bounded query threads.
- `serving`: `run_server`, `ServerHandle`, `ListenError` and what an app serves.
"""

from sink.http.app import ARROW_STREAM, create_query_app
from sink.http.guard import OPEN_PATHS, RequestGuard
from sink.http.models import LookupRequest, QueryResponse, SearchRequest
from sink.http.pool import QueryPool
from sink.http.serving import (
    SERVES_METRICS,
    SERVES_QUERY,
    ListenError,
    ServerHandle,
    run_server,
    serves,
)

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
