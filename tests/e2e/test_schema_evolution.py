"""A topic whose Avro schema gains fields mid-stream, the table's columns derived from the
registry and ``table.evolve = true``: the running sink restarts itself to add the columns,
a SIGKILL lands around the change, and every message is in the table exactly once, the new
columns null for the rows written before."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from tests.support.brokers import Broker
from tests.support.kafka import produce
from tests.support.registry import FakeRegistry
from tests.support.sink import DIM, SinkProcess, wait_caught_up, write_config

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

V1: list[dict[str, Any]] = [
    {"name": "id", "type": "string"},
    {"name": "n", "type": "long"},
    {"name": "vec", "type": {"type": "array", "items": "float"}},
]
V2 = [
    *V1,
    {"name": "extra", "type": ["null", "int"], "default": None},
    {
        "name": "meta",
        "type": [
            "null",
            {"type": "record", "name": "Meta", "fields": [{"name": "k", "type": "string"}]},
        ],
        "default": None,
    },
]


def encoded(
    registry: FakeRegistry, topic: str, fields: list[dict[str, Any]], ns: range
) -> list[tuple[bytes, bytes]]:
    schema = json.dumps({"type": "record", "name": "Doc", "fields": fields})
    ser = AvroSerializer(SchemaRegistryClient({"url": registry.url}), schema)
    ctx = SerializationContext(topic, MessageField.VALUE)
    out = []
    for i in ns:
        record: dict[str, Any] = {"id": f"m-{i}", "n": i, "vec": [float(i)] * DIM}
        if len(fields) > len(V1):
            record.update(extra=i * 10, meta={"k": f"k{i}"})
        out.append((f"m-{i}".encode(), ser(record, ctx)))
    return out


def config(
    tmp_path: Path, bootstrap: str, topic: str, group: str, registry: FakeRegistry
) -> tuple[Path, str]:
    path = write_config(
        tmp_path / "sink.toml",
        bootstrap=bootstrap,
        topics=[topic],
        group=group,
        table_uri="unused",
        extra={"source": {"format": "avro", "schema_registry": {"url": registry.url}}},
    )
    table = str(tmp_path / "table.lance")
    text = path.read_text()
    text = text[: text.index("[table]")] + (
        f'[table]\nuri = "{table}"\nevolve = true\n'
        f'vector = {{ column = "vec", dim = {DIM}, metric = "l2" }}\n'
    )
    path.write_text(text)
    return path, table


def wait_for_event(sink: SinkProcess, event: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not any(e.get("event") == event for e in sink.events()):
        assert time.monotonic() < deadline, sink.log_path.read_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.parametrize("kill", [False, True], ids=["restart", "kill"])
def test_schema_gains_fields_mid_stream(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path, kill: bool
) -> None:
    registry = FakeRegistry().start()
    try:
        produce(
            kafka_broker.bootstrap, topic, encoded(registry, topic, V1, range(200)), partition=0
        )
        path, table = config(tmp_path, kafka_broker.bootstrap, topic, group, registry)
        sink = SinkProcess(path, tmp_path / "sink-1.log")
        try:
            wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
            assert "extra" not in lance.dataset(table).schema.names
            # The writer schema gains fields while the sink runs: it drains and restarts
            # itself (same process) to evolve the table; or it is killed right then.
            produce(
                kafka_broker.bootstrap,
                topic,
                encoded(registry, topic, V2, range(200, 300)),
                partition=0,
            )
            wait_for_event(sink, "schema_evolution_restart")
            if kill:
                sink.kill()
                sink = SinkProcess(path, tmp_path / "sink-2.log")
            else:
                wait_for_event(sink, "table_evolved")  # the re-executed process logs here
            wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
            produce(
                kafka_broker.bootstrap,
                topic,
                encoded(registry, topic, V2, range(300, 350)),
                partition=0,
            )
            wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
        finally:
            assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    finally:
        registry.stop()

    ds = lance.dataset(table)
    assert {"extra", "meta__k"} <= set(ds.schema.names)
    rows = sorted(ds.to_table().to_pylist(), key=lambda r: r["n"])
    assert [r["n"] for r in rows] == list(range(350))  # exactly once across kill and restart
    assert [r["extra"] for r in rows] == [None] * 200 + [i * 10 for i in range(200, 350)]
    assert [r["meta__k"] for r in rows] == [None] * 200 + [f"k{i}" for i in range(200, 350)]
    assert np.allclose(rows[7]["vec"], [7.0] * DIM)
    logs = "".join(p.read_text() for p in tmp_path.glob("sink-*.log"))
    assert '"event": "table_evolved"' in logs
