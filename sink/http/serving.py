"""Serving an app: uvicorn in a background thread (`run_server`, `ServerHandle`).

`run_server` binds the sockets in the caller's thread (a port it cannot listen on is a
`ListenError` there, before anything is served), starts uvicorn in a daemon thread with no
signal handlers of its own (the sink's CLI owns SIGTERM/SIGINT), and returns once it
listens. `ServerHandle.stop`, called during the CLI's drain, stops accepting, finishes the
in-flight requests within a bound, and shuts the app's query pools down. What an app serves
(`SERVES_QUERY`, `SERVES_METRICS`: `serves`) names its thread and its start event.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import structlog
import uvicorn
from fastapi import FastAPI

from engine.errors import FatalError
from sink.http.pool import QueryPool

log = structlog.get_logger("lance_sink.http")


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
