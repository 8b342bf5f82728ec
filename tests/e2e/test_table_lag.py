"""Table lag: `lance-sink lag` reads each partition's flushed watermark from table storage,
so committed rows that live only in a WAL (their last owner killed before it flushed) show
without any sink running, and `--level flushed` gates on them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pytest

from config import load_settings
from sink.cli import render_status
from sink.service import SinkService
from tests.support.brokers import Broker, free_port
from tests.support.kafka import produce
from tests.support.maintenance import assert_maintained_without_flush_failures, wait_maintained
from tests.support.sink import (
    DIM,
    ROOT,
    SinkProcess,
    messages,
    table_rows,
    wait_caught_up,
    write_config,
)

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]


LAG = (sys.executable, "-m", "sink.cli", "lag")


def lag(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LAG, "--config", str(config), *extra],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def wait_ready(port: int, timeout: float = 60) -> None:
    """Until the sink's /readyz answers 200 (every assigned shard opened and replayed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the sink did not become ready")


def test_committed_rows_only_in_a_wal_show_as_unflushed(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    produce(kafka_broker.bootstrap, topic, messages(0, 400))
    table = str(tmp_path / "table.lance")
    port = free_port()
    config = write_config(
        tmp_path / "sink.toml",
        bootstrap=kafka_broker.bootstrap,
        topics=[topic],
        group=group,
        table_uri=table,
        # Nothing seals on its own: rows stay in memtables (and the WAL) until a flush.
        # Batches of 25 messages: WAL entries that a smaller memtable seals between.
        extra={
            "kafka": {"consume_batch_size": 25},
            "memtable": {"max_rows": 100_000, "max_age_s": 0},
            "observability": {"metrics_port": port},
        },
    )
    sink = SinkProcess(config, tmp_path / "a.log")
    ends = wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
    sink.kill()  # committed, never flushed: the rows are only in the WAL

    out = lag(config, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["total_lag"] == report["total_commit_lag"] == 0
    assert report["total_unflushed"] == sum(ends.values()) == 400
    for row in report["partitions"]:
        assert row["committed"] == ends[row["partition"]]
        assert row["flushed"] is None
        assert row["unflushed"] == row["flush_lag"] == ends[row["partition"]]
    assert lag(config, "--max-lag", "0").returncode == 0  # committed: caught up
    flushed_gate = lag(config, "--max-lag", "0", "--level", "flushed")
    assert flushed_gate.returncode == 4, flushed_gate.stderr
    table_view = lag(config)
    assert "UNFLUSHED" in table_view.stdout
    assert table_view.stdout.splitlines()[-1].split()[-1] == "400"
    where = ("--group", group, "--topic", topic)
    no_config = subprocess.run(
        [*LAG, "--bootstrap", kafka_broker.bootstrap, "--level", "flushed", *where],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert no_config.returncode == 2
    assert "--config" in no_config.stderr

    # A sink opens the shards again (replay) and, stopping, flushes: every committed row is
    # in the table and the flushed watermarks equal the committed offsets. Its memtables
    # hold 25 rows: the replay seals and flushes each shard's WAL in several pieces, and
    # maintenance indexes and compacts them before the stop.
    smaller = write_config(
        tmp_path / "smaller.toml",
        bootstrap=kafka_broker.bootstrap,
        topics=[topic],
        group=group,
        table_uri=table,
        extra={"memtable": {"max_rows": 25}, "observability": {"metrics_port": port}},
    )
    sink = SinkProcess(smaller, tmp_path / "b.log")
    wait_ready(port)
    wait_maintained([sink])
    assert sink.stop() == 0
    assert_maintained_without_flush_failures([sink])
    out = lag(config, "--json", "--level", "flushed")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["level"] == "flushed"
    assert report["total_lag"] == report["total_unflushed"] == 0
    assert {row["partition"]: row["flushed"] for row in report["partitions"]} == ends
    assert len(table_rows(table)) == 400
    assert lag(config, "--max-lag", "0", "--level", "flushed").returncode == 0


def test_status_counts_unindexed_rows_now(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """`status` counts the rows no index covers from the table as it is, not as the last
    maintenance run found it (none ran here: that figure stays 0)."""
    table = str(tmp_path / "table.lance")
    config = write_config(
        tmp_path / "sink.toml",
        bootstrap=kafka_broker.bootstrap,
        topics=[topic],
        group=group,
        table_uri=table,
    )
    service = SinkService(load_settings(config))
    try:
        schema = service.engine.spec.table_schema

        def rows(start: int, count: int) -> pa.Table:
            return pa.Table.from_pylist(
                [
                    {"id": f"m-{i}", "n": i, "text": f"t {i}", "vec": [0.0] * DIM}
                    | {"_topic": topic, "_partition": 0, "_offset": i}
                    for i in range(start, start + count)
                ],
                schema=schema,
            )

        lance.write_dataset(rows(0, 300), table, mode="append")
        status = service.board.status()
        assert status["base"]["unindexed_rows"] == 0  # no index: nothing to lag behind
        assert "no index yet" in render_status(status)
        lance.dataset(table).create_scalar_index("id", "BTREE")
        lance.write_dataset(rows(300, 120), table, mode="append")
        lance.write_dataset(rows(420, 80), table, mode="append")
        status = service.board.status()
        assert status["base"]["unindexed_rows"] == 200
        assert status["base"]["rows"] == 500
        assert status["base"]["unindexed_rows_at_last_maintenance"] == 0
        assert "200 unindexed rows of 500" in render_status(status)
        memory = status["memory"]
        assert memory["resident_bytes"] > 50 << 20  # Python, Arrow and Lance at least
        assert memory["budget_bytes"] == 256 << 20
        assert "memory:" in render_status(status)
    finally:
        service.consumer.close()
        if service.dlq is not None:
            service.dlq.close(5)
        service.reader.close(timeout=1)
        service.engine.close(flush=False, timeout=5)


def test_lag_connects_with_the_kafka_pass_through_properties(
    mock_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """`kafka.librdkafka` reaches lag's clients: a property that makes the brokers
    unreachable (IPv6 only, brokers on 127.0.0.1) makes `lag` fail, where it succeeds
    without it. (It was ignored: a cluster the sink reaches only with pass-through
    properties could not be asked for its lag.)"""
    produce(mock_broker.bootstrap, topic, messages(0, 10))

    def config(name: str, librdkafka: dict[str, Any]) -> Path:
        return write_config(
            tmp_path / name,
            bootstrap=mock_broker.bootstrap,
            topics=[topic],
            group=group,
            table_uri=str(tmp_path / "table.lance"),
            extra={"kafka": {"librdkafka": librdkafka}},
        )

    # A consumer-only key is taken by the probe and left out of the admin client.
    plain = lag(config("plain.toml", {"fetch.min.bytes": 1}), "--json", "--timeout", "5")
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["total_lag"] == 10
    assert "consumer property" not in plain.stderr
    v6 = lag(config("v6.toml", {"broker.address.family": "v6"}), "--json", "--timeout", "5")
    assert v6.returncode == 1, (v6.stdout, v6.stderr)
