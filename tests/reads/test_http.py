"""The HTTP query API: answers, every validation error, auth, body limit, time limit, Arrow
output, and one run against the real uvicorn server."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np
import pyarrow as pa
import pytest
import structlog
from fastapi.testclient import TestClient
from pydantic import SecretStr

from config.settings import QuerySettings
from engine.reader import Reader
from sink import cli
from sink.http import ARROW_STREAM, create_query_app, run_server
from sink.server import create_ops_app
from tests.reads.conftest import ReadHarness, vectors
from tests.support.sink import minimal_config

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def harness(make_harness: Callable[..., ReadHarness]) -> ReadHarness:
    h = make_harness()
    w = h.open()
    h.put(w, range(100))
    h.flush(w)
    h.put(w, range(100, 150))
    return h


def client_for(h: ReadHarness, **query: Any) -> TestClient:
    settings = QuerySettings(**{"max_k": 50, **query})
    return TestClient(create_query_app(h.reader, settings))


@pytest.fixture
def client(harness: ReadHarness) -> Iterator[TestClient]:
    with client_for(harness) as c:
        yield c


def vec(offset: int) -> list[float]:
    return [float(x) for x in vectors(np.array([offset]), 16)[0]]


def test_vector_text_filter_hybrid_and_lookup(client: TestClient) -> None:
    r = client.post("/v1/search", json={"vector": vec(120), "k": 3, "columns": ["_offset"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == 3
    assert body["rows"][0]["_offset"] == 120
    assert body["rows"][0]["_distance"] == pytest.approx(0, abs=1e-4)

    r = client.post("/v1/search", json={"text": "row7", "columns": ["_offset", "text"]})
    assert [row["_offset"] for row in r.json()["rows"]] == [7]

    r = client.post("/v1/search", json={"filter": "_offset >= 140", "k": 50})
    assert sorted(row["_offset"] for row in r.json()["rows"]) == list(range(140, 150))
    assert r.json()["rows"][0]["ts"].startswith("2026-01-01T")  # timestamps as ISO 8601

    r = client.post(
        "/v1/search",
        json={"vector": vec(120), "text": "row120", "k": 5, "columns": ["_offset"]},
    )
    rows = r.json()["rows"]
    assert rows[0]["_offset"] == 120  # first in both lists: the highest fused score
    assert rows[0]["_score"] == pytest.approx(2 / 61)
    assert all(a["_score"] >= b["_score"] for a, b in itertools.pairwise(rows))

    r = client.post(
        "/v1/search",
        json={"vector": vec(120), "filter": "_offset < 100", "k": 2, "columns": ["_offset"]},
    )
    assert all(row["_offset"] < 100 for row in r.json()["rows"])

    r = client.post(
        "/v1/lookup",
        json={"keys": [["t", 0, 5], ["t", 0, 130], ["t", 0, 999]], "columns": ["_offset"]},
    )
    assert sorted(row["_offset"] for row in r.json()["rows"]) == [5, 130]


def test_the_two_halves_of_a_hybrid_query_run_at_the_same_time(
    harness: ReadHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hybrid query takes the longer of its vector and text searches, not their sum: each
    half's memtable search waits here until the other half's has started too."""
    both = threading.Barrier(2, timeout=10)
    reader = harness.reader
    met: list[list[bool]] = []
    for half in (reader.vector, reader.text):
        real = half.memtable_part
        met.append([])

        def meet(*args: Any, _real: Any = real, _met: list[bool] = met[-1], **kwargs: Any) -> Any:
            if not _met:  # BrokenBarrierError (a 500) when the halves run one after the other
                _met.append(True)
                both.wait()
            return _real(*args, **kwargs)

        monkeypatch.setattr(half, "memtable_part", meet)
    with client_for(harness) as client:
        r = client.post(
            "/v1/search",
            json={"vector": vec(120), "text": "row120", "k": 5, "columns": ["_offset"]},
        )
    assert r.status_code == 200, r.text
    assert r.json()["rows"][0]["_offset"] == 120
    assert met == [[True], [True]]  # both halves met at the barrier


def test_arrow_stream_output(client: TestClient) -> None:
    r = client.post(
        "/v1/search",
        json={"vector": vec(3), "k": 4},
        headers={"Accept": ARROW_STREAM},
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == ARROW_STREAM
    table = pa.ipc.open_stream(r.content).read_all()
    assert table.num_rows == 4
    assert "vec" in table.column_names
    assert "_distance" in table.column_names


@pytest.mark.parametrize(
    ("path", "body", "kind", "fragment"),
    [
        ("/v1/search", {}, "invalid_request", "empty request"),
        ("/v1/search", {"k": 5}, "invalid_request", "empty request"),
        ("/v1/search", {"text": "alpha", "k": 0}, "invalid_query", "between 1 and 50"),
        ("/v1/search", {"text": "alpha", "k": 51}, "invalid_query", "between 1 and 50"),
        ("/v1/search", {"vector": [1.0, 2.0]}, "invalid_query", "dimension 2"),
        ("/v1/search", {"vector": "abc"}, "invalid_request", "vector"),
        ("/v1/search", {"text": "alpha", "columns": ["nope"]}, "unknown_column", "nope"),
        ("/v1/search", {"filter": "nope = 1"}, "unknown_column", "nope"),
        ("/v1/search", {"filter": "n >> 1"}, "filter_syntax", "position 3"),
        ("/v1/search", {"filter": "n = 'x'"}, "invalid_query", "does not compare"),
        ("/v1/search", {"text": "alpha", "text_column": "id"}, "unknown_column", "id"),
        ("/v1/search", {"text": "alpha", "bogus": 1}, "invalid_request", "bogus"),
        ("/v1/search", {"vector": [0.0] * 16, "nprobes": 0}, "invalid_request", "nprobes"),
        ("/v1/search", {"text": "alpha", "columns": []}, "invalid_request", "columns"),
        ("/v1/search", {"text": "alpha", "text_column": ""}, "invalid_request", "text_column"),
        ("/v1/search", {"text": "alpha", "k": True}, "invalid_request", "k:"),
        ("/v1/search", {"text": "alpha", "k": 2.0}, "invalid_request", "k:"),
        ("/v1/lookup", {"keys": [["t", 0, 1]], "columns": []}, "invalid_request", "columns"),
        ("/v1/lookup", {"keys": []}, "invalid_request", "at least one key"),
        ("/v1/lookup", {"keys": [["t", 0, 1]] * 51}, "invalid_query", "at most 50"),
        ("/v1/lookup", {"keys": [["t", "x", 1]]}, "invalid_query", "is not a int32"),
        ("/v1/lookup", {"keys": [["t", 0, 2**63]]}, "invalid_query", "do not fit"),
        ("/v1/lookup", {"keys": [["t", 0]]}, "invalid_query", "needs 3 values"),
        ("/v1/lookup", {"keys": [["t", 0, 1]], "columns": ["x"]}, "unknown_column", "x"),
    ],
)
def test_validation_errors(
    client: TestClient, path: str, body: dict[str, Any], kind: str, fragment: str
) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == kind
    assert fragment in error["message"]


def test_malformed_json_is_400(client: TestClient) -> None:
    r = client.post(
        "/v1/search", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request"


def test_a_body_the_json_parser_gives_up_on_is_400_in_the_same_format(
    client: TestClient,
) -> None:
    r = client.post("/v1/search", content=b"[" * 100_000 + b"]" * 100_000)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request"
    r = client.get("/v1/nope")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "http_error"


def test_body_larger_than_the_limit_is_413(harness: ReadHarness) -> None:
    with client_for(harness, max_request_bytes=1024) as c:
        big = {"text": "alpha " * 400}
        r = c.post("/v1/search", json=big)
        assert r.status_code == 413
        assert r.json()["error"]["type"] == "request_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted while reading
            yield b'{"text": "'
            for _ in range(50):
                yield b"alpha " * 10
            yield b'"}'

        r = c.post("/v1/search", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert c.post("/v1/search", json={"text": "alpha"}).status_code == 200


def test_bearer_token(harness: ReadHarness) -> None:
    with client_for(harness, auth_token=SecretStr("s3cret")) as c:
        body = {"text": "alpha"}
        assert c.post("/v1/search", json=body).status_code == 401
        r = c.post("/v1/search", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        r = c.post("/v1/search", json=body, headers={"Authorization": "Basic s3cret"})
        assert r.status_code == 401
        r = c.post("/v1/lookup", json={"keys": [["t", 0, 1]]})
        assert r.status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert c.post("/v1/search", json=body, headers=ok).status_code == 200
        assert c.post("/v1/lookup", json={"keys": [["t", 0, 1]]}, headers=ok).status_code == 200
        # The description names the table's columns: it needs the token too.
        assert c.get("/openapi.json").status_code == 401
        assert c.get("/openapi.json", headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = c.get("/openapi.json", headers=ok)
        assert r.status_code == 200
        assert "/v1/search" in r.json()["paths"]
        # No interactive docs page; without the token no path answers but 401.
        assert c.get("/docs").status_code == 401
        assert c.get("/docs", headers=ok).status_code == 404
        assert c.get("/redoc", headers=ok).status_code == 404


def test_no_token_configured_means_no_auth(client: TestClient) -> None:
    r = client.post("/v1/search", json={"text": "alpha"}, headers={"Authorization": "Bearer x"})
    assert r.status_code == 200


def test_slow_query_is_504(harness: ReadHarness) -> None:
    def slow_shards() -> list[Any]:
        time.sleep(0.6)
        return list(harness.writers)

    reader = Reader(harness.spec, harness.table, slow_shards)
    with TestClient(create_query_app(reader, QuerySettings(timeout_ms=100))) as c:
        r = c.post("/v1/search", json={"text": "alpha"})
        assert r.status_code == 504
        assert r.json()["error"]["type"] == "timeout"
    reader.close()


def test_a_slow_query_is_logged_with_the_stages_it_spent_its_time_in(
    harness: ReadHarness,
) -> None:
    """Over `query.slow_query_ms` a query is logged (`query_slow`) with its stages: here
    the snapshot (its shard views) took the time; a fast query, or with the setting null,
    nothing is logged."""

    def slow_shards() -> list[Any]:
        time.sleep(0.3)
        return list(harness.writers)

    reader = Reader(harness.spec, harness.table, slow_shards)
    for slow_ms, logged in ((200, True), (5_000, False), (None, False)):
        settings = QuerySettings(slow_query_ms=slow_ms)
        with (
            TestClient(create_query_app(reader, settings)) as c,
            structlog.testing.capture_logs() as logs,
        ):
            r = c.post("/v1/search", json={"vector": vec(120), "k": 3})
            assert r.status_code == 200, r.text
        slow = [e for e in logs if e["event"] == "query_slow"]
        assert bool(slow) is logged, (slow_ms, slow)
        if logged:
            (entry,) = slow
            assert entry["log_level"] == "warning"
            assert entry["path"] == "/v1/search"
            assert entry["ms"] >= 300
            assert next(iter(entry["stages"])) == "snapshot"  # the largest first
            assert entry["stages"]["snapshot"] >= 300
            assert "memtables" in entry["stages"]
    reader.close()


def test_timed_out_queries_free_their_slot_and_excess_requests_get_503(
    harness: ReadHarness,
) -> None:
    """A 504 frees its slot for new queries while abandoned work is under its bound (it
    held the slot until its work ended: 8 slow requests starved every other query); past
    the bound, timed-out work keeps its slot and excess requests get 503 at once."""
    release = threading.Event()
    blocking = threading.Event()
    blocking.set()
    entered = threading.Semaphore(0)

    def blocked_shards() -> list[Any]:
        if threading.current_thread().name == "reader-tokenizer":
            return []  # the reader's background tokenizer: not a query
        if blocking.is_set():
            entered.release()
            release.wait(30)
        return list(harness.writers)

    reader = Reader(harness.spec, harness.table, blocked_shards)
    settings = QuerySettings(timeout_ms=100, max_concurrent_queries=2)
    app = create_query_app(reader, settings)
    pool = app.state.query_pool
    try:
        with TestClient(app) as c:
            for _ in range(2):  # both time out; their work goes on, abandoned
                r = c.post("/v1/search", json={"text": "alpha"})
                assert r.status_code == 504
                assert r.json()["error"]["request_id"] == r.headers["x-request-id"]
            assert entered.acquire(timeout=5)
            assert entered.acquire(timeout=5)
            assert (pool.running, pool.abandoned) == (0, 2)
            blocking.clear()
            assert c.post("/v1/search", json={"text": "alpha"}).status_code == 200
            blocking.set()
            for _ in range(2):  # abandoned work is at its bound: these keep their slots
                assert c.post("/v1/search", json={"text": "alpha"}).status_code == 504
            assert entered.acquire(timeout=5)
            assert entered.acquire(timeout=5)
            assert (pool.running, pool.abandoned) == (2, 2)
            r = c.post("/v1/search", json={"text": "alpha"})
            assert r.status_code == 503
            assert r.json()["error"]["type"] == "overloaded"
            assert r.headers["retry-after"] == "1"
            assert c.post("/v1/lookup", json={"keys": [["t", 0, 1]]}).status_code == 503
            assert not entered.acquire(timeout=0.2)  # the rejected ones never started
            release.set()
            deadline = time.monotonic() + 10
            while (pool.running or pool.abandoned) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert (pool.running, pool.abandoned) == (0, 0)
            assert c.post("/v1/search", json={"text": "alpha"}).status_code == 200
    finally:
        release.set()
        pool.shutdown()
        reader.close()


def test_openapi_describes_both_endpoints(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert {"/v1/search", "/v1/lookup"} <= set(spec["paths"])
    schemas = spec["components"]["schemas"]
    assert {"SearchRequest", "LookupRequest", "QueryResponse"} <= set(schemas)


def test_real_server_on_a_free_port(harness: ReadHarness) -> None:
    app = create_query_app(harness.reader, QuerySettings())
    handle = run_server(app, "127.0.0.1", 0)
    try:
        assert handle.port > 0
        url = f"http://127.0.0.1:{handle.port}"
        r = httpx.post(
            f"{url}/v1/search", json={"text": "row7", "columns": ["_offset"]}, timeout=30
        )
        assert r.status_code == 200
        assert [row["_offset"] for row in r.json()["rows"]] == [7]
        r = httpx.post(f"{url}/v1/search", json={}, timeout=30)
        assert r.status_code == 400
    finally:
        handle.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.post(f"{url}/v1/search", json={}, timeout=5)


# --------------------------------------------------------------------------- issue 18


@pytest.mark.parametrize(
    "body",
    [
        {"text": "\ud800 kafka"},
        {"text": "kafka \udfff", "phrase": True},
        {"vector": [0.0] * 16, "text": "\ud800 kafka"},
        {"filter": "id = '\ud800'"},
        {"text": "alpha", "columns": ["\ud800"]},
    ],
)
def test_text_that_is_not_unicode_is_400(client: TestClient, body: dict[str, Any]) -> None:
    # The body as a client sends it: JSON escapes of lone surrogates.
    raw = json.dumps(body).encode()
    assert b"\\ud" in raw
    r = client.post("/v1/search", content=raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request"
    assert "lone surrogate" in r.json()["error"]["message"]


def test_lookup_keys_with_lone_surrogates_are_400(client: TestClient) -> None:
    r = client.post("/v1/lookup", content=b'{"keys": [["\\ud800", 0, 1]]}')
    assert r.status_code == 400, r.text
    assert "lone surrogate" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("nprobes", 2**64), ("nprobes", 65_537), ("refine_factor", 2**40), ("refine_factor", 101)],
)
def test_numeric_parameters_are_bounded(client: TestClient, field: str, value: int) -> None:
    r = client.post("/v1/search", json={"vector": vec(3), "k": 3, field: value})
    assert r.status_code == 400, r.text  # was an OverflowError in Lance: 500
    assert field in r.json()["error"]["message"]
    r = client.post("/v1/search", json={"vector": vec(3), "k": 3, "nprobes": 65_536})
    assert r.status_code == 200


@pytest.mark.parametrize(
    "key",
    [["t", 0, 1.5], ["t", 0, 1.0], ["t", 0, True], ["t", 0.0, 1], ["t", 0, "1"], [1, 0, 1]],
)
def test_lookup_keys_must_have_their_columns_type(client: TestClient, key: list[Any]) -> None:
    # 1.5 for the int64 offset used to be truncated to 1 and answered with row 1.
    r = client.post("/v1/lookup", json={"keys": [key]})
    assert r.status_code == 400, r.text
    assert "is not a" in r.json()["error"]["message"]
    r = client.post("/v1/lookup", json={"keys": [["t", 0, 1]], "columns": ["_offset"]})
    assert r.json()["rows"] == [{"_offset": 1}]


def test_authentication_comes_before_validation(harness: ReadHarness) -> None:
    with client_for(harness, auth_token=SecretStr("s3cret"), max_request_bytes=1024) as c:
        assert c.post("/v1/search", content=b"{not json").status_code == 401
        assert c.post("/v1/search", json={"bogus": 1}).status_code == 401
        assert c.post("/v1/search", json={"text": "a" * 5000}).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert c.post("/v1/search", content=b"{not json", headers=ok).status_code == 400


@pytest.mark.parametrize("blank", ["", "   ", "\n\t"])
def test_a_blank_filter_is_400(client: TestClient, blank: str) -> None:
    # It used to mean "no filter": k arbitrary rows.
    for body in [{"filter": blank}, {"text": "alpha", "filter": blank}]:
        r = client.post("/v1/search", json=body)
        assert r.status_code == 400, r.text
        assert "filter is blank" in r.json()["error"]["message"]
    assert client.post("/v1/search", json={"text": "alpha", "filter": None}).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [{}, {"Content-Type": "application/x-www-form-urlencoded"}, {"Content-Type": "text/plain"}],
)
def test_a_body_is_json_whatever_its_content_type(
    client: TestClient, headers: dict[str, str]
) -> None:
    body = b'{"text": "row7", "columns": ["_offset"]}'
    r = client.post("/v1/search", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert [row["_offset"] for row in r.json()["rows"]] == [7]
    r = client.post("/v1/lookup", content=b'{"keys": [["t", 0, 7]]}', headers=headers)
    assert r.status_code == 200, r.text
    r = client.post("/v1/search", content=b"text=row7", headers=headers)
    assert r.status_code == 400
    assert "whatever its Content-Type" in r.json()["error"]["message"]


def test_a_failure_is_a_json_500_with_a_request_id_logged_once(harness: ReadHarness) -> None:
    def broken_shards() -> list[Any]:
        raise RuntimeError("boom")

    reader = Reader(harness.spec, harness.table, broken_shards)
    try:
        with (
            TestClient(create_query_app(reader, QuerySettings())) as c,
            structlog.testing.capture_logs() as logs,
        ):
            r = c.post("/v1/search", json={"filter": "n > 3"})
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "internal"
        assert error["request_id"] == r.headers["x-request-id"]
        assert error["request_id"] in error["message"]
        failed = [e for e in logs if e["event"] == "query_request_failed"]
        assert len(failed) == 1
        assert failed[0]["request_id"] == error["request_id"]
        assert failed[0]["error"] == "RuntimeError: boom"
        assert failed[0]["log_level"] == "error"
    finally:
        reader.close()


class _Ops:
    def exposition(self) -> bytes:
        return b"# metrics\n"

    def liveness(self) -> tuple[bool, str]:
        return True, ""

    def readiness(self) -> tuple[bool, list[str]]:
        return True, []

    def status(self) -> dict[str, Any]:
        return {"partitions": []}


def test_each_server_logs_its_own_started_event(harness: ReadHarness) -> None:
    """The metrics and health server logged `query_server_started`, as the query API does:
    each now says which server it is (one server for both when the ports are equal)."""
    both = create_ops_app(_Ops(), create_query_app(harness.reader, QuerySettings()))
    apps = [
        ("query_server_started", create_query_app(harness.reader, QuerySettings())),
        ("metrics_server_started", create_ops_app(_Ops())),
        ("query_and_metrics_server_started", both),
    ]
    for event, app in apps:
        with structlog.testing.capture_logs() as logs:
            handle = run_server(app, "127.0.0.1", 0)
        port = handle.port
        handle.stop()
        assert [(e["event"], e["host"], e["port"]) for e in logs] == [(event, "127.0.0.1", port)]


def test_a_port_in_use_is_a_listen_error_naming_what_the_server_serves(
    harness: ReadHarness,
) -> None:
    """A port another socket holds raises `ListenError` in the caller's thread, with the
    host, the port, what the server serves (for the CLI to name the setting) and the OS's
    reason; uvicorn logged it and ended its thread, and `run_server` raised RuntimeError."""
    from sink.http import SERVES_METRICS, SERVES_QUERY, ListenError  # noqa: PLC0415

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        for app, what in [
            (create_ops_app(_Ops()), {SERVES_METRICS}),
            (create_query_app(harness.reader, QuerySettings()), {SERVES_QUERY}),
        ]:
            with pytest.raises(ListenError) as info:
                run_server(app, "127.0.0.1", port)
            error = info.value
            assert (error.host, error.port, error.serves) == ("127.0.0.1", port, what)
            assert error.reason == "Address already in use"
            assert str(error) == f"cannot listen on 127.0.0.1:{port}: Address already in use"


@pytest.mark.parametrize("same_port", [False, True])
def test_which_operations_paths_need_the_token(harness: ReadHarness, same_port: bool) -> None:
    """/metrics and the probes stay open (Prometheus, kubelet); /v1/status and
    /openapi.json follow the query token, on the metrics port and on a shared port."""
    token = SecretStr("s3cret")
    if same_port:
        query_app = create_query_app(harness.reader, QuerySettings(auth_token=token))
        app = create_ops_app(_Ops(), query_app)
    else:
        app = create_ops_app(_Ops(), auth_token=token)
    ok = {"Authorization": "Bearer s3cret"}
    with TestClient(app) as c:
        for path in ["/metrics", "/healthz", "/readyz"]:
            assert c.get(path).status_code == 200, path
        for path in ["/v1/status", "/openapi.json"]:
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers={"Authorization": "Bearer x"}).status_code == 401
            assert c.get(path, headers=ok).status_code == 200, path
    with TestClient(create_ops_app(_Ops())) as c:  # no token configured: all open
        assert c.get("/v1/status").status_code == 200
        assert c.get("/openapi.json").status_code == 200


def test_filter_chains_are_answered_fast_or_refused(client: TestClient) -> None:
    """Eight 328-byte requests (30 ORs) used to hold every query slot for minutes."""
    chain = " OR ".join(["_offset = 1"] * 30)
    started = time.monotonic()
    r = client.post("/v1/search", json={"filter": chain, "k": 1, "columns": ["_offset"]})
    assert r.status_code == 200, r.text
    assert r.json()["rows"] == [{"_offset": 1}]
    r = client.post("/v1/search", json={"vector": vec(3), "filter": chain, "k": 1})
    assert r.status_code == 200, r.text
    assert time.monotonic() - started < 2
    # 1 300 range comparisons (12 KB): was a RecursionError, 500.
    chain = " OR ".join(f"n > {i}" for i in range(1300))
    r = client.post("/v1/search", json={"filter": chain})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "filter_too_complex"
    assert "at most 256" in r.json()["error"]["message"]
    assert "MAX_PREDICATES" in r.json()["error"]["message"]


def test_the_status_command_sends_the_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = run_server(create_ops_app(_Ops(), auth_token=SecretStr("s3cret")), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{handle.port}"
    try:
        monkeypatch.delenv("LANCE_SINK__QUERY__AUTH_TOKEN", raising=False)
        assert cli.main(["status", "--url", url, "--json"]) != 0
        assert "401" in capsys.readouterr().err
        monkeypatch.setenv("LANCE_SINK__QUERY__AUTH_TOKEN", "s3cret")
        assert cli.main(["status", "--url", url, "--json"]) == 0
        assert '"partitions": []' in capsys.readouterr().out
    finally:
        handle.stop()


@pytest.mark.parametrize("listen", ["::", "::1", "0.0.0.0", "127.0.0.1"])
def test_the_status_command_reaches_the_metrics_host_of_its_config(
    tmp_path: Path, listen: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`status --config` asks the metrics server where the config says it listens; with
    ``metrics_host = "::"`` (an IPv6-only socket) it asked 127.0.0.1 and could not connect."""
    handle = run_server(create_ops_app(_Ops()), listen, 0)
    config = minimal_config(
        tmp_path / "sink.toml",
        {"observability": {"metrics_host": listen, "metrics_port": handle.port}},
    )
    try:
        assert cli.main(["status", "--config", str(config), "--json"]) == 0, capsys.readouterr()
        assert '"partitions": []' in capsys.readouterr().out
    finally:
        handle.stop()


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"text": "alpha", "phrase": "yes"}, "phrase"),
        ({"text": "alpha", "phrase": 1}, "phrase"),
        ({"vector": ["0.5"] * 16}, "vector.0"),
        ({"vector": [True] * 16}, "vector.0"),
        ({"text": " ".join(f"w{i}" for i in range(129))}, "129 distinct terms; at most 128"),
        ({"vector": [0.0] * 16, "text": " ".join(f"w{i}" for i in range(200))}, "at most 128"),
    ],
)
def test_search_fields_keep_their_types_and_bounds(
    client: TestClient, body: dict[str, Any], says: str
) -> None:
    # "phrase": "yes" was a phrase query and ["0.5", ...] a vector; 20,000 terms took GBs.
    r = client.post("/v1/search", json=body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"text": "caf\xe9"}', "not UTF-8 text (byte 13)"),
        (b'{"text": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deeply"),
    ],
)
def test_a_body_json_cannot_read_says_why(client: TestClient, raw: bytes, says: str) -> None:
    # Both were "There was an error parsing the body".
    r = client.post("/v1/search", content=raw)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request"
