"""A partition whose shard takes long to open (claim + WAL replay, slowed here to 20 s)
holds up only itself: the consumer loop keeps polling, the pod's other partitions are
consumed and committed meanwhile, /healthz stays alive and /readyz names the one partition.
The opens ran inside the rebalance callback, so every partition of the pod (and its
scrapes, and its broker statistics) waited for the slowest replay.

Small memtables: the other partitions flush several times during the slow open, so
maintenance (on, as in production) indexes and compacts the table meanwhile."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.test_observability import get, sink_config, wait_http
from tests.support.brokers import Broker, free_port
from tests.support.kafka import committed_offsets, end_offsets, produce
from tests.support.maintenance import assert_maintained_without_flush_failures, wait_maintained
from tests.support.sink import SinkProcess, messages, table_rows, wait_caught_up

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

REPLAY_S = 20.0
BATCH = 25  # messages per consume, rows per memtable: ~4 flushes per partition of ~100


def test_a_slow_shard_open_holds_up_only_its_partition(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    produce(kafka_broker.bootstrap, topic, messages(0, 400))
    ends = end_offsets(kafka_broker.bootstrap, topic)
    assert len(ends) > 1
    assert all(ends.values())
    port = free_port()
    config = sink_config(
        tmp_path,
        kafka_broker,
        topic,
        group,
        port,
        backpressure__controller="tests.support.slow:controller",
        kafka__consume_batch_size=BATCH,
        memtable__max_rows=BATCH,
    )
    sink = SinkProcess(
        config,
        tmp_path / "sink.log",
        env={
            "LANCE_SINK_TEST_REPLAY_DELAY_S": str(REPLAY_S),
            "LANCE_SINK_TEST_REPLAY_DELAY_PARTITIONS": "0",
        },
    )
    try:
        wait_http(port)
        started = time.monotonic()
        others = {p: end for p, end in ends.items() if p != 0}
        while True:
            committed = committed_offsets(kafka_broker.bootstrap, group, topic, len(ends))
            if all(committed.get(p) == end for p, end in others.items()):
                break
            assert sink.alive(), sink.log_path.read_text()[-3000:]
            assert time.monotonic() - started < REPLAY_S / 2, committed
            time.sleep(0.3)
        assert committed.get(0, -1) < 0  # partition 0 is still being opened
        assert get(port, "/healthz")[0] == 200
        code, body = get(port, "/readyz")
        assert code == 503
        assert body["reasons"] == [f"{topic}[0]: opening and replaying its shard"], body
        wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
        assert get(port, "/readyz")[0] == 200
        wait_maintained([sink])
    finally:
        assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    assert sorted(r["n"] for r in table_rows(str(tmp_path / "table.lance"))) == list(range(400))
    assert_maintained_without_flush_failures([sink])
