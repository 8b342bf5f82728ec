"""`lance-sink run` on an Avro topic: a real broker, the real registry client over HTTP
(`tests.support.registry`), values produced with confluent-kafka's `AvroSerializer`.

Bad values go to the dead-letter topic with their reasons; a registry outage pauses the
partition (visible in /v1/status and /metrics) and dead-letters nothing; when the registry
is back every message lands, the writer schema having gained a field meanwhile. Memtables
of 20 rows, and 80 more messages produced 20 at a time before the outage: the sink flushes
several times, and maintenance (on, as in production) indexes and compacts the table
meanwhile."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Consumer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from tests.support.brokers import Broker, free_port
from tests.support.kafka import consume_all, consumer_conf, produce
from tests.support.maintenance import assert_maintained_without_flush_failures, wait_maintained
from tests.support.registry import FakeRegistry
from tests.support.sink import (
    DIM,
    SinkProcess,
    produce_in_steps,
    sink_config,
    table_rows,
    wait_caught_up,
)

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

STEP = 20  # rows per memtable
MORE = range(1000, 1000 + 4 * STEP)  # produced a memtable at a time before the outage

FIELDS: list[dict[str, Any]] = [
    {"name": "id", "type": "string"},
    {"name": "n", "type": "long"},
    {"name": "text", "type": ["null", "string"], "default": None},
    {"name": "vec", "type": "bytes"},  # little-endian float32
]


def schema(*extra: dict[str, Any]) -> str:
    return json.dumps({"type": "record", "name": "Doc", "fields": FIELDS + list(extra)})


def values(registry: FakeRegistry, topic: str, schema_str: str, ns: range) -> list[bytes]:
    ser = AvroSerializer(SchemaRegistryClient({"url": registry.url}), schema_str)
    ctx = SerializationContext(topic, MessageField.VALUE)
    out = []
    for i in ns:
        vec = (np.arange(DIM, dtype="<f4") * i).tobytes()
        record = {"id": f"m-{i}", "n": i, "text": f"message {i}", "vec": vec, "extra": i}
        out.append(ser(record, ctx))
    return out


def lag_seconds(metrics: str, topic: str) -> float:
    """The `lance_sink_lag_seconds` sample of partition 0 of `topic` in an exposition."""
    labels = f'{{partition="0",topic="{topic}"}}'
    found = re.search(rf"^lance_sink_lag_seconds{re.escape(labels)} (\S+)$", metrics, re.MULTILINE)
    assert found is not None, metrics
    return float(found.group(1))


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - http://127.0.0.1
        body: bytes = response.read()
        return body


def test_avro_topic_with_dead_letters_and_a_registry_outage(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    registry = FakeRegistry().start()
    try:
        first = values(registry, topic, schema(), range(200))
        unknown_id = b"\x00\x00\x00\x00\x63" + first[0][5:]
        stream = [(f"m-{i}".encode(), v) for i, v in enumerate(first)]
        stream[50:50] = [(b"bad-json", b'{"id": "x"}')]
        stream[120:120] = [(b"bad-id", unknown_id)]
        produce(kafka_broker.bootstrap, topic, stream, partition=0)
        port = free_port()
        config, table = sink_config(
            tmp_path,
            kafka_broker.bootstrap,
            [topic],
            group,
            extra={
                "source": {
                    "format": "avro",
                    "schema_registry": {
                        "url": registry.url,
                        "max_retries": 0,
                        "unreachable_backoff_max_s": 8,
                    },
                },
                "observability": {"metrics_port": port},
                "memtable": {"max_rows": STEP},
            },
        )
        sink = SinkProcess(config, tmp_path / "sink.log")
        try:
            wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
            assert registry.requests["GET /schemas/ids/1"] == 1  # cached after the first
            # More of the same schema, a flush at a time: maintenance gets work.
            more = values(registry, topic, schema(), MORE)
            more_stream = [(f"m-{i}".encode(), v) for i, v in zip(MORE, more, strict=True)]
            produce_in_steps(kafka_broker.bootstrap, topic, group, more_stream, STEP, [sink])

            # A newer writer schema, produced while the registry is down: the sink cannot
            # fetch it, so the partition waits instead of dead-lettering.
            second = values(
                registry, topic, schema({"name": "extra", "type": "int"}), range(200, 320)
            )
            end = len(stream) + len(MORE) + len(second)  # the log end once all is produced
            registry.stop()
            produce(
                kafka_broker.bootstrap,
                topic,
                [(f"m-{200 + i}".encode(), v) for i, v in enumerate(second[:100])],
                partition=0,
            )
            deadline = time.monotonic() + 60
            while True:
                status = json.loads(get(f"http://127.0.0.1:{port}/v1/status"))
                waiting = status["partitions"][0].get("schema_registry")
                if waiting and waiting["failures"] == 4:  # the next retry in 8 s
                    break
                assert time.monotonic() < deadline, status
                time.sleep(0.3)
            assert "unreachable" in waiting["error"]
            metrics = get(f"http://127.0.0.1:{port}/metrics").decode()
            assert f'lance_sink_registry_paused{{partition="0",topic="{topic}"}} 1.0' in metrics
            assert status["partitions"][0]["paused"] is True
            # The 100 messages it could not decode are consumed and not durable: the lag in
            # seconds is their age (it read 0 while the registry was away), not "caught up".
            assert status["partitions"][0]["lag"]["seconds"] > 0.5, status["partitions"][0]
            assert lag_seconds(metrics, topic) > 0.5, metrics
            # Messages produced while the partition is paused move its end offset and lag
            # (the sink's consumer does not fetch it: a probe of its own does). The next
            # retry is 8 s away: the end moves before it, the partition still paused (4 s
            # were too few for a busy CI machine).
            produce(
                kafka_broker.bootstrap,
                topic,
                [(f"m-{300 + i}".encode(), v) for i, v in enumerate(second[100:])],
                partition=0,
            )
            while (part := json.loads(get(f"http://127.0.0.1:{port}/v1/status"))["partitions"][0])[
                "end"
            ] != end:
                assert time.monotonic() < deadline + 30, part
                time.sleep(0.1)
            assert part["paused"] is True
            assert part["schema_registry"]["failures"] == waiting["failures"], part
            assert part["lag"]["consumer"] == end - part["consumed"] > 20
            registry.start()
            wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
            metrics = get(f"http://127.0.0.1:{port}/metrics").decode()
            assert f'lance_sink_registry_paused{{partition="0",topic="{topic}"}} 0.0' in metrics
            assert lag_seconds(metrics, topic) == 0.0, metrics  # every message durable
            status = json.loads(get(f"http://127.0.0.1:{port}/v1/status"))
            assert status["partitions"][0]["lag"]["seconds"] == 0.0, status
            wait_maintained([sink])
        finally:
            assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    finally:
        registry.stop()

    rows = table_rows(table)
    assert sorted(r["n"] for r in rows) == [*range(320), *MORE]
    by_n = {r["n"]: r for r in rows}
    assert by_n[7]["vec"] == (np.arange(DIM, dtype=np.float32) * 7).tolist()
    assert by_n[250]["text"] == "message 250"

    dead = Consumer(consumer_conf(kafka_broker.bootstrap, group + "-dlq-reader"))
    try:
        dead.subscribe([f"{topic}.dlq"])
        letters = consume_all(dead, 2, timeout=60)
        more = [m for m in dead.consume(100, 3) if m.error() is None]
    finally:
        dead.close()
    assert not more  # nothing dead-lettered for the outage
    reasons = {m.key(): dict(m.headers() or [])["lance_sink.reason"] for m in letters}
    assert reasons == {b"bad-json": b"missing_magic_byte", b"bad-id": b"unknown_schema_id"}
    events = [e["event"] for e in SinkProcess.events(sink)]
    assert "registry_unavailable" in events
    assert_maintained_without_flush_failures([sink])
