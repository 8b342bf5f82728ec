"""Backpressure pauses partitions instead of buffering without bound, and a stalled writer
never makes the member leave its group (the loop keeps polling)."""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.brokers import Broker, free_port
from tests.support.kafka import produce
from tests.support.sink import SinkProcess, messages, sink_config, table_rows, wait_caught_up

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(400)]


def running_events(sink: SinkProcess) -> list[str]:
    """Event names logged before the shutdown drain began (leaving the group at shutdown
    revokes every partition, which is not what these tests look for)."""
    events = [e["event"] for e in sink.events()]
    return events[: events.index("sink_draining")]


def test_tiny_budget_and_slow_flush_pause_partitions(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    n = 20_000
    produce(kafka_broker.bootstrap, topic, messages(0, n))
    budget = 512 << 10
    port = free_port()
    config, table = sink_config(
        tmp_path,
        kafka_broker.bootstrap,
        [topic],
        group,
        extra={
            "memtable": {"max_rows": 1000, "max_bytes": 128 << 10},
            "backpressure": {
                "process_budget_bytes": budget,
                "controller": "tests.support.slow:controller",
            },
            "kafka": {"consume_batch_size": 500},
            "observability": {"metrics_port": port},
        },
    )
    sink = SinkProcess(config, tmp_path / "sink.log", env={"LANCE_SINK_TEST_FLUSH_DELAY_S": "0.3"})
    peak_used = 0.0
    stop = threading.Event()

    def watch_budget() -> None:
        nonlocal peak_used
        while not stop.is_set():
            with contextlib.suppress(OSError):
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
                for line in text.decode().splitlines():
                    if line.startswith("lance_sink_budget_used_bytes "):
                        peak_used = max(peak_used, float(line.split()[1]))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_budget, daemon=True)
    watcher.start()
    try:
        wait_caught_up(kafka_broker.bootstrap, group, topic, timeout=300, procs=[sink])
    finally:
        stop.set()
        watcher.join(5)
        assert sink.stop() == 0
    # Memory stays bounded: the budget is never exceeded by more than the puts admitted
    # while it was not yet full (at most one batch per partition: 4 x 500 small rows).
    assert 0 < peak_used <= budget + 4 * 500 * 400, peak_used
    events = running_events(sink)
    assert events.count("partition_paused") >= 2  # backpressure was applied
    assert events.count("partition_resumed") >= 2
    assert "partition_revoked" not in events
    assert "partition_lost" not in events
    rows = table_rows(table)
    assert sorted(r["n"] for r in rows) == list(range(n))


def test_stalled_writer_keeps_the_member_in_the_group(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    n = 4_000
    config, table = sink_config(
        tmp_path,
        kafka_broker.bootstrap,
        [topic],
        group,
        extra={
            "kafka": {"max_poll_interval_ms": 7000, "consume_batch_size": 200},
            "backpressure": {"controller": "tests.support.slow:controller"},
        },
    )
    stall = 15.0  # longer than max.poll.interval.ms (7 s) by far
    sink = SinkProcess(
        config, tmp_path / "sink.log", env={"LANCE_SINK_TEST_WAL_STALL_S": str(stall)}
    )
    try:
        started = time.monotonic()
        for start in range(0, n, 500):
            produce(kafka_broker.bootstrap, topic, messages(start, 500))
            time.sleep(0.3)
        wait_caught_up(kafka_broker.bootstrap, group, topic, timeout=300, procs=[sink])
        assert time.monotonic() - started > stall  # the stall really happened
    finally:
        assert sink.stop() == 0
    text = sink.log_path.read_text()
    assert "TEST_WAL_STALL" in text
    events = running_events(sink)
    assert events.count("partition_assigned") == 4  # assigned once, never again
    assert "partition_revoked" not in events
    assert "partition_lost" not in events
    rows = table_rows(table)
    assert sorted(r["n"] for r in rows) == list(range(n))
