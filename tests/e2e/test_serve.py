"""`lance-sink serve`: a query-only process next to a writer. It consumes nothing and holds
no shard, yet answers with every committed row: the base's, and the fresh rows of the
writer's memtables by fan-out (the writer's URL derived from a plain config); once the
writer drained and stopped, from the base alone, complete."""

from __future__ import annotations

import time
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.e2e.test_fanout import PARTITIONS, owners, post, vector_of, wait_serving
from tests.support.brokers import Broker, free_ports
from tests.support.kafka import produce
from tests.support.maintenance import MAINTENANCE_OFF
from tests.support.sink import SinkProcess, message, wait_caught_up, write_config

pytestmark = [pytest.mark.broker, pytest.mark.timeout(240)]

TOKEN = "fan-out-token"  # tests.e2e.test_fanout.post sends it
FIRST = 20  # rows per partition flushed into the base (memtable.max_rows); the rest stay


def not_ready(url: str) -> bytes | None:
    """/readyz's refusal, or None once it says ready."""
    r = httpx.get(url, timeout=5)
    return None if r.status_code == 200 else r.content


def test_a_query_only_process_answers_with_every_committed_row(
    mock_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    bootstrap = mock_broker.bootstrap
    for p in range(PARTITIONS):  # every partition exists before the group forms
        produce(bootstrap, topic, [message(p)], partition=p)
    writer_port, writer_metrics, serve_port, serve_metrics = free_ports(4)

    def config(name: str, port: int, metrics_port: int) -> Path:
        return write_config(
            tmp_path / f"{name}.toml",
            bootstrap=bootstrap,
            topics=[topic],
            group=group,
            table_uri=str(tmp_path / "table.lance"),
            mode="upsert",
            extra={
                "memtable": {"max_rows": FIRST, "max_age_s": 3600},
                "maintenance": MAINTENANCE_OFF,
                "query": {"enabled": True, "port": port, "owners_refresh_ms": 200},
                "observability": {"metrics_port": metrics_port},
            },
        )

    env = {"LANCE_SINK__QUERY__AUTH_TOKEN": TOKEN}
    writer = SinkProcess(config("writer", writer_port, writer_metrics), tmp_path / "w.log", env)
    serve = SinkProcess(
        config("serve", serve_port, serve_metrics), tmp_path / "s.log", env, command="serve"
    )
    procs = [writer, serve]
    urls = [f"http://127.0.0.1:{writer_port}", f"http://127.0.0.1:{serve_port}"]
    try:
        wait_serving(procs, urls)
        deadline = time.monotonic() + 60
        while len(owners([writer])) < PARTITIONS:
            assert time.monotonic() < deadline, "the writer never held every partition"
            time.sleep(0.3)
        rows = [message(i) for i in range(PARTITIONS, 200)]
        for p in range(PARTITIONS):
            produce(bootstrap, topic, rows[p::PARTITIONS], partition=p)
        wait_caught_up(bootstrap, group, topic, procs=[writer])

        # Ready once the brokers listed the topic's partitions.
        while (why := not_ready(f"http://127.0.0.1:{serve_metrics}/readyz")) is not None:
            assert time.monotonic() < deadline, why
            time.sleep(0.3)
        everything = sorted(f"m-{i}" for i in range(200))
        got = post(urls[1], "/v1/search", {"filter": "n >= 0", "k": 1000, "columns": ["id"]})
        assert "partial" not in got, got.get("missing")
        assert sorted(r["id"] for r in got["rows"]) == everything
        fresh = 199  # in the writer's memtables: only its first FIRST rows per partition flushed
        got = post(urls[1], "/v1/search", {"vector": vector_of(fresh), "k": 1, "columns": ["id"]})
        assert got["rows"][0]["id"] == f"m-{fresh}"
        got = post(urls[1], "/v1/lookup", {"keys": [f"m-{fresh}", "m-1"], "columns": ["id"]})
        assert sorted(r["id"] for r in got["rows"]) == sorted([f"m-{fresh}", "m-1"])
        # It consumed nothing and claimed no shard: the writer holds every partition.
        assert not [e for e in serve.events() if e.get("event") == "partition_assigned"]
        assert set(owners([writer]).values()) == {0}

        # The writer drains and stops: every row is in the base, and its shards say so
        # (released), so answers stay complete without it (they named its shards missing).
        writer_code = writer.stop()
        deadline = time.monotonic() + 30
        while "partial" in (got := post(urls[1], "/v1/search", {"filter": "n >= 0", "k": 1000})):
            assert time.monotonic() < deadline, got["missing"]
            time.sleep(0.3)
        assert sorted(r["id"] for r in got["rows"]) == everything
    finally:
        codes = [serve.stop(), writer.stop()]
    assert writer_code == 0, writer.log_path.read_text()[-3000:]
    assert codes == [0, 0], serve.log_path.read_text()[-3000:]
    assert [e["event"] for e in serve.events() if e["event"].startswith("serve_")] == [
        "serve_started",
        "serve_stopping",
        "serve_stopped",
    ]
