"""End to end through the real `lance-sink run`: every produced message lands exactly once,
and the committed offsets reach the log end."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support.brokers import Broker
from tests.support.kafka import committed_offsets, produce
from tests.support.procs import children, cmdline, running
from tests.support.sink import (
    SinkProcess,
    message,
    messages,
    sink_config,
    table_rows,
    wait_caught_up,
)

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]


def test_exactly_once_end_to_end(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    n, m = 3000, 500
    second = topic + "-b"  # several topics feed one table
    produce(kafka_broker.bootstrap, topic, messages(0, n))
    produce(kafka_broker.bootstrap, second, messages(n, m))
    config, table = sink_config(
        tmp_path,
        kafka_broker.bootstrap,
        [topic, second],
        group,
    )
    sink = SinkProcess(config, tmp_path / "sink.log")
    try:
        ends = wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
        ends_b = wait_caught_up(kafka_broker.bootstrap, group, second, procs=[sink])
        # The sink opts out of transparent huge pages (its allocators churn memory).
        status = Path(f"/proc/{sink.proc.pid}/status").read_text()
        assert "THP_enabled:\t0" in status, status
    finally:
        code = sink.stop()
    assert code == 0, sink.log_path.read_text()[-3000:]
    assert sum(ends.values()) == n
    assert sum(ends_b.values()) == m
    rows = table_rows(table)
    assert sorted(r["n"] for r in rows) == list(range(n + m))
    assert {r["_topic"] for r in rows if r["n"] >= n} == {second}
    by_n = {r["n"]: r for r in rows}
    assert by_n[7]["text"] == "message number 7"
    assert by_n[7]["id"] == "m-7"
    assert len(by_n[7]["vec"]) == 8
    assert {(r["_topic"], r["_partition"]) for r in rows} == {
        (t, p) for t in (topic, second) for p in range(4)
    }
    events = {e["event"] for e in sink.events()}
    assert {"partition_assigned", "sink_draining", "sink_stopped"} <= events


def test_batches_decoded_out_of_order_are_put_in_offset_order(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    # Four decode workers with random delays finish batches out of order, and a decode queue
    # of two 40-message batches is full most of the time (the loop parks what it consumes):
    # every partition's rows must still reach the table once each, in offset order.
    n = 2000
    produce(kafka_broker.bootstrap, topic, messages(0, n))
    config, table = sink_config(
        tmp_path,
        kafka_broker.bootstrap,
        [topic],
        group,
        extra={
            "kafka": {"consume_batch_size": 40},
            "source": {"decode_workers": 4},
            "backpressure": {"controller": "tests.support.slow:controller"},
        },
    )
    env = {"LANCE_SINK_TEST_DECODE_JITTER_S": "0.03"}
    sink = SinkProcess(config, tmp_path / "sink.log", env=env)
    try:
        ends = wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
    finally:
        code = sink.stop()
    assert code == 0, sink.log_path.read_text()[-3000:]
    assert sum(ends.values()) == n
    rows = table_rows(table)  # scan order: flush order, then put order within a flush
    assert sorted(r["n"] for r in rows) == list(range(n))
    for partition in range(4):
        offsets = [r["_offset"] for r in rows if r["_partition"] == partition]
        assert offsets == list(range(ends[partition])), partition


def test_decoding_in_worker_processes_exactly_once_across_a_sigkill(
    mock_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """`source.decode_processes`: the rows are the same, exactly once across a SIGKILL of
    the sink in the middle of the stream, and the killed sink's decode workers exit. The
    last quarter is produced after the kill, so the second sink decodes some of the stream
    whatever the first had committed."""
    n = 8000
    produce(mock_broker.bootstrap, topic, messages(0, n // 2))
    config, table = sink_config(
        tmp_path,
        mock_broker.bootstrap,
        [topic],
        group,
        extra={
            "source": {"decode_processes": True, "decode_workers": 2},
            "kafka": {"consume_batch_size": 200},
        },
    )
    first = SinkProcess(config, tmp_path / "first.log")
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2:
            assert first.alive(), first.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no decode workers started"
            workers = [pid for pid in children(first.proc.pid) if "spawn_main" in cmdline(pid)]
            time.sleep(0.1)
        produce(mock_broker.bootstrap, topic, messages(n // 2, n // 4))
        # Killed once part of the stream is committed.
        while sum(committed_offsets(mock_broker.bootstrap, group, topic, 4).values()) < n // 4:
            assert time.monotonic() < deadline, "nothing was committed"
            time.sleep(0.05)
    finally:
        first.kill()
    deadline = time.monotonic() + 20
    while any(running(pid) for pid in workers):
        assert time.monotonic() < deadline, f"decode workers {workers} outlived the sink"
        time.sleep(0.1)
    produce(mock_broker.bootstrap, topic, messages(3 * n // 4, n // 4))
    second = SinkProcess(config, tmp_path / "second.log")
    try:
        ends = wait_caught_up(mock_broker.bootstrap, group, topic, procs=[second])
    finally:
        code = second.stop()
    assert code == 0, second.log_path.read_text()[-3000:]
    assert sum(ends.values()) == n
    rows = table_rows(table)
    assert sorted(r["n"] for r in rows) == list(range(n))
    by_n = {r["n"]: r for r in rows}
    assert by_n[4321]["text"] == "message number 4321"
    assert by_n[4321]["vec"] == pytest.approx(json.loads(message(4321)[1])["vec"])
