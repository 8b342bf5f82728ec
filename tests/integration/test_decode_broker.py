"""`sink.decode` on messages really consumed from a Kafka-protocol broker.

The unit tests use a fake message; these check that confluent_kafka's own `Message`
objects (keys, null values, headers, timestamps) decode the same way.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import confluent_kafka
import orjson
import pytest

from config.settings import SourceSettings, TableSettings
from engine.schema import OP_DELETE, OP_UPSERT, TableSpec
from sink.decode import Decoder
from tests.support.brokers import Broker
from tests.support.kafka import consume_all, consumer_conf, produce

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]

DIM = 8


def spec(mode: str) -> TableSpec:
    raw: dict[str, Any] = {
        "uri": "/tmp/unused",
        "mode": mode,
        "columns": [
            {"name": "id", "type": "string", "nullable": False},
            {"name": "n", "type": "int64"},
            {"name": "city", "type": "string"},
            {"name": "k", "type": "binary"},
            {"name": "trace", "type": "string"},
            {"name": "at", "type": "timestamp"},
        ],
        "vector": {"column": "vec", "dim": DIM},
    }
    if mode == "upsert":
        raw["primary_key"] = ["id"]
    return TableSpec.from_settings(TableSettings.model_validate(raw))


SOURCE = SourceSettings(
    columns={"city": "$.addr.city", "k": "@key", "trace": "@headers.trace", "at": "@timestamp"}
)


def doc(i: int) -> bytes:
    return orjson.dumps(
        {"id": f"id-{i}", "n": i, "addr": {"city": f"c{i % 5}"}, "vec": [i / 10] * DIM}
    )


def consume_partitions(
    broker: Broker, topic: str, group: str, expected: int
) -> dict[int, list[Any]]:
    consumer = confluent_kafka.Consumer(consumer_conf(broker.bootstrap, group))
    try:
        consumer.subscribe([topic])
        messages = consume_all(consumer, expected)
    finally:
        consumer.close()
    by_partition: dict[int, list[Any]] = defaultdict(list)
    for m in messages:
        by_partition[m.partition()].append(m)
    return {p: sorted(ms, key=lambda m: m.offset()) for p, ms in by_partition.items()}


def test_append_table_from_consumed_messages(kafka_broker: Broker, topic: str, group: str) -> None:
    bad = {13: b'{"id": "x", "vec": [1]}', 27: b"not json", 41: b'{"id": 5}', 55: None}
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_broker.bootstrap})
    for i in range(80):
        value = bad[i] if i in bad else doc(i)
        producer.produce(
            topic,
            key=f"key-{i}".encode(),
            value=value,
            partition=i % 2,
            headers=[("trace", f"tr-{i}".encode())],
            timestamp=1_700_000_000_000 + i,
        )
    assert producer.flush(30) == 0

    partitions = consume_partitions(kafka_broker, topic, group, 80)
    assert set(partitions) == {0, 1}
    decoder = Decoder(spec("append"), SOURCE)
    rows: list[dict[str, Any]] = []
    dead: dict[str, str] = {}
    skipped = 0
    for partition, messages in partitions.items():
        out = decoder.decode(messages)
        assert out.batch is not None
        spec("append").validate(out.batch)
        assert (out.first_offset, out.last_offset) == (0, 39)
        assert len(out.batch) + len(out.dead_letters) + len(out.skipped_offsets) == 40
        rows += out.batch.to_pylist()
        skipped += len(out.skipped_offsets)
        for d in out.dead_letters:
            assert (d.topic, d.partition) == (topic, partition)
            assert d.key is not None
            assert d.headers == [("trace", d.key.replace(b"key", b"tr"))]
            assert d.timestamp_ms is not None
            dead[d.key.decode()] = d.reason
    assert dead == {
        "key-13": "wrong_vector_dimension",
        "key-27": "invalid_json",
        "key-41": "wrong_type",
    }
    assert skipped == 1  # key-55, a tombstone on an append table
    good = sorted(set(range(80)) - set(bad))
    by_id = {r["id"]: r for r in rows}
    assert sorted(by_id) == sorted(f"id-{i}" for i in good)
    for i in good:
        row = by_id[f"id-{i}"]
        assert row["n"] == i
        assert row["city"] == f"c{i % 5}"
        assert row["k"] == f"key-{i}".encode()
        assert row["trace"] == f"tr-{i}"
        assert int(row["at"].timestamp() * 1000) == 1_700_000_000_000 + i
        assert row["vec"] == pytest.approx([i / 10] * DIM)
        assert (row["_topic"], row["_partition"], row["_offset"]) == (topic, i % 2, i // 2)


def test_upsert_tombstones_from_consumed_messages(
    kafka_broker: Broker, topic: str, group: str
) -> None:
    messages = [
        (b"id-1", doc(1)),
        (b"id-2", doc(2)),
        (b"id-1", None),
        (None, None),
        (b"id-3", doc(3)),
        (b"id-2", None),
    ]
    produce(kafka_broker.bootstrap, topic, messages, partition=3)
    partitions = consume_partitions(kafka_broker, topic, group, len(messages))
    assert set(partitions) == {3}
    out = Decoder(spec("upsert"), SOURCE).decode(partitions[3])
    assert out.batch is not None
    spec("upsert").validate(out.batch)
    assert [(d.offset, d.reason) for d in out.dead_letters] == [(3, "missing_primary_key")]
    got = [(r["_offset"], r["id"], r["_op"], r["n"]) for r in out.batch.to_pylist()]
    assert got == [
        (0, "id-1", OP_UPSERT, 1),
        (1, "id-2", OP_UPSERT, 2),
        (2, "id-1", OP_DELETE, None),
        (4, "id-3", OP_UPSERT, 3),
        (5, "id-2", OP_DELETE, None),
    ]
