"""Bad messages go to the dead-letter topic with their reason; every good message lands; all
offsets get committed. Small memtables: the sink flushes several times, and maintenance (on,
as in production) indexes and compacts the table while the bad messages are handled."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from confluent_kafka import Consumer

from tests.support.brokers import Broker, free_port
from tests.support.kafka import committed_offsets, consume_all, consumer_conf, produce
from tests.support.maintenance import (
    MAINTAINED,
    assert_maintained_without_flush_failures,
    wait_maintained,
)
from tests.support.sink import (
    SinkProcess,
    message,
    produce_in_steps,
    sink_config,
    table_rows,
    wait_caught_up,
)

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]


def bad_messages() -> dict[str, tuple[bytes, bytes]]:
    good_vec = [0.0] * 8
    return {
        "invalid_json": (b"bad-json", b'{"id": "x", "n": '),
        "wrong_type": (
            b"bad-type",
            json.dumps({"id": "t", "n": "seven", "vec": good_vec}).encode(),
        ),
        "wrong_vector_dimension": (
            b"bad-dim",
            json.dumps({"id": "d", "n": 1, "vec": [1.0, 2.0]}).encode(),
        ),
        "nan_in_vector": (b"bad-nan", b'{"id": "nan", "n": 1, "vec": [NaN, 0, 0, 0, 0, 0, 0, 0]}'),
        "missing_primary_key": (b"bad-key", json.dumps({"n": 1, "vec": good_vec}).encode()),
        "oversized": (
            b"bad-big",
            json.dumps({"id": "big", "n": 1, "vec": good_vec, "text": "x" * 5000}).encode(),
        ),
        "invalid_utf8": (b"bad-utf8", b'{"id": "\xff\xfe", "n": 1}'),
    }


def test_bad_messages_are_dead_lettered_with_reasons(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    bad = bad_messages()
    stream: list[tuple[bytes, bytes]] = []
    for i in range(300):
        stream.append(message(i))
        if i % 40 == 5:
            stream.append(list(bad.values())[(i // 40) % len(bad)])
    stream.extend(bad.values())
    produce(kafka_broker.bootstrap, topic, stream, partition=0)
    config, table = sink_config(
        tmp_path,
        kafka_broker.bootstrap,
        [topic],
        group,
        mode="upsert",
        extra={
            "source": {"max_message_bytes": 2000},
            # Batches of 50 messages, each good row's memtable flushed at 50 rows.
            "kafka": {"consume_batch_size": 50},
            "memtable": {"max_rows": 50},
        },
    )
    sink = SinkProcess(config, tmp_path / "sink.log")
    try:
        ends = wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
        wait_maintained([sink], MAINTAINED | {"key_index"})
    finally:
        assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    assert ends[0] == len(stream)  # every offset committed, bad ones included

    rows = table_rows(table)
    assert sorted(r["n"] for r in rows) == list(range(300))
    assert_maintained_without_flush_failures([sink])

    dead = Consumer(consumer_conf(kafka_broker.bootstrap, group + "-dlq-reader"))
    try:
        dead.subscribe([f"{topic}.dlq"])
        expected = len(stream) - 300
        letters = consume_all(dead, expected, timeout=90)
    finally:
        dead.close()
    by_key: dict[bytes, dict[str, bytes]] = {}
    for m in letters:
        by_key.setdefault(m.key(), dict(m.headers() or []))
    for reason, (key, _value) in bad.items():
        headers = by_key[key]
        assert headers["lance_sink.reason"] == reason.encode(), (key, headers)
        assert headers["lance_sink.topic"] == topic.encode()
        assert headers["lance_sink.partition"] == b"0"
        assert int(headers["lance_sink.offset"]) >= 0
        assert headers["lance_sink.detail"]
    originals = {m.key(): m.value() for m in letters}
    for key, value in bad.values():
        assert originals[key] == value  # the original bytes, untouched


def test_without_a_dead_letter_topic_a_bad_message_stops_its_partition(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    # 100 good messages (a flush of 20 at a time, below) before the bad one.
    bad_at, step = 100, 20
    stream = [message(i) for i in range(bad_at)] + [bad_messages()["invalid_json"]]
    stream += [message(i) for i in range(bad_at, bad_at + 30)]
    produce(kafka_broker.bootstrap, topic, stream[:step], partition=0)
    port = free_port()
    config, table = sink_config(
        tmp_path,
        kafka_broker.bootstrap,
        [topic],
        group,
        extra={
            "dlq": {"enabled": False},
            "observability": {"metrics_port": port},
            "kafka": {"consume_batch_size": step},
            "memtable": {"max_rows": step},
        },
    )
    sink = SinkProcess(config, tmp_path / "sink.log")
    try:
        wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
        good = stream[step:bad_at]
        produce_in_steps(kafka_broker.bootstrap, topic, group, good, step, [sink])
        produce(kafka_broker.bootstrap, topic, stream[bad_at:], partition=0)
        deadline = time.monotonic() + 90
        while "partition_stopped_on_bad_message" not in sink.log_path.read_text():
            assert time.monotonic() < deadline, sink.log_path.read_text()[-2000:]
            time.sleep(0.3)
        time.sleep(2)  # commits of what came before the bad batch
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5)
        reason = f"stopped, bad message at offset {bad_at}: invalid_json"
        assert reason.encode() in info.value.read()
        wait_maintained([sink])  # the rows before the bad message, flushed
    finally:
        assert sink.stop() == 0
    # Nothing at or after the bad message was committed or written; nothing before it lost.
    committed = committed_offsets(kafka_broker.bootstrap, group, topic)[0]
    assert 0 < committed <= bad_at
    assert sorted(r["n"] for r in table_rows(table)) == list(range(committed))
    events = [e["event"] for e in sink.events()]
    assert "partition_stopped_on_bad_message" in events
    assert_maintained_without_flush_failures([sink])
