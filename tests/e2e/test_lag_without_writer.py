"""A partition without a shard writer keeps current offset and lag series.

In an operations trial the lag gauges went stale or never appeared exactly during storage
incidents: a partition whose writer was poisoned (disk full), or whose shard was still
being opened, got no snapshot, so `lance_sink_commit_lag_messages` kept its last value (or
had none) while the broker moved on, and the `LanceSinkCommitLagGrowing` alert could not
fire. Both states are made real here, in a real `lance-sink run`:

- partition 0's shard cannot be opened (a corrupt object in its manifest folder): newly
  assigned, it never gets a writer and is retried;
- partition 1's writer is fenced mid-stream by a newer writer of its shard (opened by the
  test), so its writer is dropped while messages keep arriving.

Both must show the broker's end offset, the committed offset and the lags derived from
them, moving as messages are produced, and the lag in seconds of the batch the fenced
writer dropped. Small consume batches and memtables: the other partitions flush several
times, and maintenance (on, as in production) indexes and compacts the table meanwhile.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from config import load_settings
from engine.engine import Engine
from engine.manifest import ManifestStore
from tests.e2e.test_observability import scrape, sink_config, wait_http
from tests.support.brokers import Broker, free_port
from tests.support.kafka import committed_offsets, end_offsets, produce
from tests.support.maintenance import MAINTAINED, maintenance_done, wait_maintained
from tests.support.sink import SinkProcess, messages

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

PARTITIONS = 4
FIRST = 200
BATCH = 50  # messages per consume, rows per memtable: 4 flushes per partition of FIRST


def wait_series(
    port: int,
    sink: SinkProcess,
    partition: int,
    want: dict[str, float],
    timeout: float = 30,
) -> dict[str, dict[int, float]]:
    """Scrape until each `lance_sink_<name>` of `partition` equals `want[name]`."""
    deadline = time.monotonic() + timeout
    while True:
        assert sink.alive(), sink.log_path.read_text()[-3000:]
        metrics = scrape(port)
        got = {name: metrics.get(f"lance_sink_{name}", {}).get(partition) for name in want}
        if got == want:
            return metrics
        assert time.monotonic() < deadline, f"partition {partition}: {got}, expected {want}"
        time.sleep(0.3)


def test_partitions_without_a_writer_keep_current_lag_series(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    bootstrap = kafka_broker.bootstrap
    for p in range(PARTITIONS):
        produce(bootstrap, topic, messages(p * 10_000, FIRST), partition=p)
    port = free_port()
    # The sink's writer learns of the fence at its next WAL append, with a batch in hand
    # (an idle writer's background probe would find it before anything was consumed).
    config = sink_config(
        tmp_path,
        kafka_broker,
        topic,
        group,
        port,
        wal__fence_check_interval_ms=600_000,
        kafka__consume_batch_size=BATCH,
        memtable__max_rows=BATCH,
    )
    engine = Engine.from_settings(load_settings(config))  # creates the table
    corrupt = ManifestStore(engine.storage, engine.shard_id(topic, 0)).key(1)
    engine.storage.put_if_absent(corrupt, b"{not a manifest")

    sink = SinkProcess(config, tmp_path / "sink.log")
    newer = None
    try:
        wait_http(port)
        deadline = time.monotonic() + 60
        while any(
            committed_offsets(bootstrap, group, topic, PARTITIONS).get(p) != FIRST
            for p in (1, 2, 3)
        ):
            assert sink.alive(), sink.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "partitions 1-3 never caught up"
            time.sleep(0.3)

        # Partition 0 was assigned and never opened: its series exist and are current.
        wait_series(
            port,
            sink,
            0,
            {
                "log_end_offset": FIRST,
                "committed_offset": 0,
                "commit_lag_messages": FIRST,
                "consumer_lag_messages": FIRST,
                "writer_poisoned": 1,
            },
        )

        # Partition 1 is caught up, its writer running.
        wait_series(port, sink, 1, {"log_end_offset": FIRST, "commit_lag_messages": 0})
        # A newer writer claims partition 1's shard; the next batch finds the fence.
        newer = engine.open_shard(topic, 1)
        produce(bootstrap, topic, messages(20_000, 30), partition=1)
        wait_series(port, sink, 1, {"writer_poisoned": 1})
        produce(bootstrap, topic, messages(30_000, 70), partition=1)
        produce(bootstrap, topic, messages(40_000, 50), partition=0)
        ends = end_offsets(bootstrap, topic)
        assert (ends[0], ends[1]) == (FIRST + 50, FIRST + 100)
        committed = committed_offsets(bootstrap, group, topic, PARTITIONS)
        assert committed[1] == FIRST  # nothing past the fence is committed
        # Without a writer, the end offset still follows the broker and so do the lags.
        metrics = wait_series(
            port,
            sink,
            1,
            {
                "log_end_offset": FIRST + 100,
                "committed_offset": FIRST,
                "commit_lag_messages": 100,
                "consumer_lag_messages": 100,
                "durable_lag_messages": 100,
            },
        )
        # The batch the fenced writer dropped was consumed and is not durable: its age.
        assert metrics["lance_sink_lag_seconds"][1] > 0
        wait_series(
            port, sink, 0, {"log_end_offset": FIRST + 50, "commit_lag_messages": FIRST + 50}
        )
        wait_maintained([sink])
    finally:
        if newer is not None:
            engine.close_shard(newer, flush=False, timeout=5)
        engine.close()
        sink.stop()
    events = sink.events()
    assert not [e for e in events if e.get("event") == "flush_failed"]
    # Partition 0's open fails, as intended; no other partition's open ever did.
    opens = [e for e in events if e.get("event") == "partition_open_failed"]
    assert opens
    assert {e["partition"] for e in opens} == {0}, opens[:3]
    assert maintenance_done([sink]) >= MAINTAINED
