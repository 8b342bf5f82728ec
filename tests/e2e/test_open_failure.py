"""A shard that cannot be opened is a visible, bounded retry, never a crash loop.

The failure is real: a corrupt object in the shard's manifest folder (what a torn write by
another tool, or a bug in reading some table version, looks like to the sink). Before, any
error but the engine's own escaped the rebalance callback and the process exited 1, and
every restart died the same way at open. Small consume batches and memtables: the other
partitions flush several times, and maintenance (on, as in production) indexes and compacts
the table while partition 0's open is retried.
"""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest

from config import load_settings
from engine.engine import Engine
from engine.manifest import ManifestStore
from tests.e2e.test_observability import get, sink_config, wait_http
from tests.support.brokers import Broker, free_port
from tests.support.kafka import committed_offsets, produce
from tests.support.maintenance import MAINTAINED, maintenance_done, wait_maintained
from tests.support.sink import SinkProcess, messages, table_rows, wait_caught_up

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]


def open_failures(port: int) -> dict[int, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    pattern = re.compile(r'^lance_sink_shard_open_failures_total\{.*partition="(\d+)".*\} (\S+)$')
    return {int(m[1]): float(m[2]) for line in text.splitlines() if (m := pattern.match(line))}


def test_a_shard_that_fails_to_open_is_retried_visibly(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    n = 800
    produce(kafka_broker.bootstrap, topic, messages(0, n))
    port = free_port()
    # ~4 flushes of 50 rows per partition.
    config = sink_config(
        tmp_path,
        kafka_broker,
        topic,
        group,
        port,
        kafka__consume_batch_size=50,
        memtable__max_rows=50,
    )
    engine = Engine.from_settings(load_settings(config))  # creates the table
    store = ManifestStore(engine.storage, engine.shard_id(topic, 0))
    corrupt = store.key(1)
    engine.storage.put_if_absent(corrupt, b"{not a manifest")
    engine.close()

    sink = SinkProcess(config, tmp_path / "sink.log")
    try:
        wait_http(port)
        deadline = time.monotonic() + 90
        reasons: list[str] = []
        while time.monotonic() < deadline:
            assert sink.alive(), sink.log_path.read_text()[-3000:]
            committed = committed_offsets(kafka_broker.bootstrap, group, topic, 4)
            status, body = get(port, "/readyz")
            reasons = [str(r) for r in body.get("reasons", [])]
            if (
                all(committed.get(p, -1) > 0 for p in (1, 2, 3))
                and open_failures(port).get(0, 0) >= 2
            ):
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"partition 0 never retried: {reasons}")
        # The other partitions flow; partition 0 waits, and says why everywhere.
        assert committed_offsets(kafka_broker.bootstrap, group, topic, 4).get(0, -1) < 0
        assert status == 503
        assert any(f"{topic}[0]" in r and "JSONDecodeError" in r for r in reasons), reasons
        _, report = get(port, "/v1/status")
        p0 = next(p for p in report["partitions"] if p["partition"] == 0)  # type: ignore[union-attr]
        assert p0["open"]["failures"] >= 2
        assert "JSONDecodeError" in p0["open"]["error"]
        events = [e for e in sink.events() if e.get("event") == "partition_open_failed"]
        assert events
        assert [e["attempt"] for e in events] == list(range(1, len(events) + 1))
        assert all(e["partition"] == 0 for e in events)

        # The cause goes away: the next attempt opens the shard and the partition catches up.
        engine.storage.delete(corrupt)
        wait_caught_up(kafka_broker.bootstrap, group, topic, timeout=90, procs=[sink])
        status, body = get(port, "/readyz")
        assert status == 200, body
        wait_maintained([sink])
    finally:
        assert sink.stop() == 0
    assert sorted(r["n"] for r in table_rows(str(tmp_path / "table.lance"))) == list(range(n))
    assert any(e.get("event") == "partition_recovered" for e in sink.events())
    events = sink.events()
    assert not [e for e in events if e.get("event") == "flush_failed"]
    opens = [e for e in events if e.get("event") == "partition_open_failed"]
    assert {e["partition"] for e in opens} == {0}, opens[:3]  # only the corrupt one
    assert maintenance_done([sink]) >= MAINTAINED
