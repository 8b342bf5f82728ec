"""The operations endpoints of a running sink: Prometheus metrics, health, readiness, status.

    GET /metrics     Prometheus text exposition (the metrics facade)
    GET /healthz     200 while the process and its consumer loop are alive
    GET /readyz      200 when every assigned partition is opened and replayed, a broker is
                     reachable and no shard writer is poisoned; else 503 with the reasons
    GET /v1/status   one JSON document: partitions, offsets and lags (one snapshot each),
                     memtables, flush state, backpressure, ingest rate, memory, and the
                     base table's unindexed rows now, or the last read when table
                     storage does not answer within 1 s (`sink.base_status`); what
                     `lance-sink status` prints

Served on `observability.metrics_port`. When the query API listens on the same port, its
routes are served by the same app.

With `query.auth_token` set, `/v1/status` and `/openapi.json` need the bearer token like
the query API (they name topics, partitions and the table's columns); `/metrics`,
`/healthz` and `/readyz` stay open for Prometheus and the kubelet, which carry no token
(`sink.http.OPEN_PATHS`). Errors and failures are answered as in `sink.http.RequestGuard`.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import SecretStr

from sink.http import SERVES_METRICS, RequestGuard, serves


class Observable(Protocol):
    """What the endpoints read from the service (see `SinkService`)."""

    def exposition(self) -> bytes: ...
    def liveness(self) -> tuple[bool, str]: ...
    def readiness(self) -> tuple[bool, list[str]]: ...
    def status(self) -> dict[str, Any]: ...


def create_ops_app(
    service: Observable, app: FastAPI | None = None, *, auth_token: SecretStr | None = None
) -> FastAPI:
    """Add the operations routes to `app` (or a new app, guarded by `auth_token`: see the
    module docstring) and return it. A given `app` (the query API's) has its own guard."""
    if app is None:
        app = FastAPI(title="lance-sink operations", docs_url=None, redoc_url=None)
        token = auth_token.get_secret_value().encode() if auth_token is not None else None
        app.add_middleware(RequestGuard, token=token)
    app.state.serves = serves(app) | {SERVES_METRICS}

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(service.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> JSONResponse:
        alive, reason = service.liveness()
        return JSONResponse(
            {"status": "alive" if alive else "dead", "reason": reason},
            status_code=200 if alive else 503,
        )

    @app.get("/readyz", include_in_schema=False)
    def readyz() -> JSONResponse:
        ready, reasons = service.readiness()
        return JSONResponse(
            {"status": "ready" if ready else "not_ready", "reasons": reasons},
            status_code=200 if ready else 503,
        )

    @app.get("/v1/status")
    def status() -> Response:
        # orjson: at 1,024 partitions the document is ~0.5 MB, which the standard
        # library's encoder (JSONResponse) took 13 ms to write, orjson 1.7 ms.
        body = orjson.dumps(service.status(), option=orjson.OPT_NON_STR_KEYS)
        return Response(body, media_type="application/json")

    return app
