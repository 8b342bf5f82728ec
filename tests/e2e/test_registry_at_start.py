"""`lance-sink run` started while the Schema Registry is away, the table's columns derived
from it (``table.evolve = true``): the sink waits for the registry instead of exiting.

- No table yet: its columns come from the registry, so the sink retries with backoff until
  it answers (a signal meanwhile exits 0); it used to exit 1 at once.
- The table exists: its own columns suffice, so the sink starts, serves, and pauses the
  partition until the registry is back; it used to exit 1 ("cannot derive table.columns"),
  also when it restarted itself to evolve.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.test_schema_evolution import V1, config, encoded
from tests.support.brokers import Broker, free_port
from tests.support.kafka import produce
from tests.support.registry import FakeRegistry
from tests.support.sink import SinkProcess, table_rows, wait_caught_up

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]


def with_port(path: Path) -> int:
    """Serve the sink's operations endpoints on a free port; returns it."""
    port = free_port()
    path.write_text(path.read_text().replace("metrics_port = 0", f"metrics_port = {port}"))
    return port


def wait_for_waits(sink: SinkProcess, count: int, timeout: float = 30) -> list[dict[str, object]]:
    """The sink's first `count` `registry_unavailable_at_start` events, once logged."""
    deadline = time.monotonic() + timeout
    while True:
        waits = [e for e in sink.events() if e.get("event") == "registry_unavailable_at_start"]
        if len(waits) >= count:
            return waits
        assert sink.alive(), sink.log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, sink.log_path.read_text()[-3000:]
        time.sleep(0.1)


def test_the_sink_waits_for_the_registry_at_start(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    registry = FakeRegistry().start()
    first = encoded(registry, topic, V1, range(50))
    later = encoded(registry, topic, V1, range(50, 80))  # the same schema id
    produce(kafka_broker.bootstrap, topic, first, partition=0)
    path, table = config(tmp_path, kafka_broker.bootstrap, topic, group, registry)
    port = with_port(path)
    try:
        # No table: nothing to start from but the registry. The sink waits, backing off.
        registry.stop()
        sink = SinkProcess(path, tmp_path / "sink-1.log")
        try:
            waits = wait_for_waits(sink, 3)
            assert [w["retry_in_s"] for w in waits[:3]] == [1.0, 2.0, 4.0]
            registry.start()
            wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
        finally:
            assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
        assert sorted(r["n"] for r in table_rows(table)) == list(range(50))

        # The table exists: the sink starts from its columns, serves, and pauses the
        # partition on the registry (the new process has no schema cached) until it is back.
        registry.stop()
        sink = SinkProcess(path, tmp_path / "sink-2.log")
        try:
            (wait,) = wait_for_waits(sink, 1)
            assert wait["columns"] == "table"
            produce(kafka_broker.bootstrap, topic, later, partition=0)
            deadline = time.monotonic() + 60
            while not any(e.get("event") == "registry_unavailable" for e in sink.events()):
                assert sink.alive(), sink.log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, sink.log_path.read_text()[-3000:]
                time.sleep(0.2)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as ready:
                assert ready.status == 200  # paused on the registry, not unready
            registry.start()
            wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
        finally:
            assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    finally:
        registry.stop()
    assert sorted(r["n"] for r in table_rows(table)) == list(range(80))


def test_a_signal_ends_the_wait_for_the_registry(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    registry = FakeRegistry().start()
    produce(kafka_broker.bootstrap, topic, encoded(registry, topic, V1, range(5)), partition=0)
    path, table = config(tmp_path, kafka_broker.bootstrap, topic, group, registry)
    registry.stop()
    sink = SinkProcess(path, tmp_path / "sink.log")
    wait_for_waits(sink, 1)
    started = time.monotonic()
    assert sink.stop(timeout=10) == 0, sink.log_path.read_text()[-3000:]
    assert time.monotonic() - started < 5
    assert not Path(table).exists()  # nothing was written
