"""End to end through the real `lance-sink run`: every produced message lands exactly once,
and the committed offsets reach the log end."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.brokers import Broker
from tests.support.kafka import produce
from tests.support.sink import SinkProcess, messages, sink_config, table_rows, wait_caught_up

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
