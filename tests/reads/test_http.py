"""The HTTP query API: answers, every validation error, auth, body limit, time limit, Arrow
output, and one run against the real uvicorn server."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2 as httpx
import numpy as np
import pyarrow as pa
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from config.settings import QuerySettings
from engine.reader import Reader
from sink.http import ARROW_STREAM, create_query_app, run_server
from tests.reads.conftest import ReadHarness, vectors

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
        ("/v1/lookup", {"keys": []}, "invalid_request", "at least one key"),
        ("/v1/lookup", {"keys": [["t", 0, 1]] * 51}, "invalid_query", "at most 50"),
        ("/v1/lookup", {"keys": [["t", "x", 1]]}, "invalid_query", "do not fit"),
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
        # No interactive docs page, with or without the token.
        assert c.get("/docs").status_code == 404
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


def test_timed_out_queries_keep_their_slot_and_excess_requests_get_503(
    harness: ReadHarness,
) -> None:
    release = threading.Event()
    entered = threading.Semaphore(0)

    def blocked_shards() -> list[Any]:
        if threading.current_thread().name == "reader-tokenizer":
            return []  # the reader's background tokenizer: not a query
        entered.release()
        release.wait(30)
        return list(harness.writers)

    reader = Reader(harness.spec, harness.table, blocked_shards)
    settings = QuerySettings(timeout_ms=100, max_concurrent_queries=2)
    app = create_query_app(reader, settings)
    pool = app.state.query_pool
    try:
        with TestClient(app) as c:
            for _ in range(2):  # both time out, but their work goes on holding the slots
                r = c.post("/v1/search", json={"text": "alpha"})
                assert r.status_code == 504
            assert entered.acquire(timeout=5)
            assert entered.acquire(timeout=5)
            assert pool.running == 2
            r = c.post("/v1/search", json={"text": "alpha"})
            assert r.status_code == 503
            assert r.json()["error"]["type"] == "overloaded"
            assert r.headers["retry-after"] == "1"
            assert c.post("/v1/lookup", json={"keys": [["t", 0, 1]]}).status_code == 503
            assert not entered.acquire(timeout=0.2)  # the rejected ones never started
            release.set()
            deadline = time.monotonic() + 10
            while pool.running and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pool.running == 0
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
