"""A dead letter the dead-letter topic will not take in full never stalls its partition: an
envelope (coordinates, reason, size, SHA-256) goes in its place, the payload lands in the
dead-letter Lance table, every good row behind it arrives and every offset is committed.

On tansu (a real Kafka-protocol broker). tansu 0.6.0 stores a topic's `max.message.bytes`
but does not enforce it (nor does librdkafka's mock cluster), so the broker's refusal is
tansu's schema validation (INVALID_RECORD) here; the size refusal is librdkafka's own
MSG_SIZE_TOO_LARGE, the error code a Kafka broker returns for a topic's limit.

Small consume batches and memtables: the sink flushes several times in each test, and
maintenance (on, as in production) indexes and compacts the table while dead letters are
handled.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka
import lance
import pytest
from confluent_kafka import Consumer
from prometheus_client.parser import text_string_to_metric_families

from tests.support.brokers import Broker, free_port, start_tansu
from tests.support.kafka import committed_offsets, consume_all, consumer_conf
from tests.support.maintenance import assert_maintained_without_flush_failures, wait_maintained
from tests.support.sink import (
    SinkProcess,
    message,
    produce_in_steps,
    sink_config,
    table_rows,
    wait_caught_up,
)

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

BIG = 12 << 20


def produce_big(bootstrap: str, topic: str, stream: list[tuple[bytes, bytes]]) -> None:
    """Produce to partition 0 with room for a 12 MiB message."""
    errors: list[str] = []
    producer = confluent_kafka.Producer(
        {"bootstrap.servers": bootstrap, "message.max.bytes": BIG + (1 << 20), "linger.ms": 5}
    )
    for key, value in stream:
        producer.produce(
            topic,
            value,
            key=key,
            partition=0,
            on_delivery=lambda err, _m: errors.append(str(err)) if err else None,
        )
        producer.poll(0)
    assert producer.flush(60) == 0
    assert not errors, errors[:3]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The sink's /metrics samples by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(
    metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float | None:
    return metrics.get((name, tuple(sorted(labels.items()))))


def dead_letters(bootstrap: str, topic: str, expected: int) -> list[confluent_kafka.Message]:
    reader = Consumer(consumer_conf(bootstrap, f"{topic}-reader"))
    try:
        reader.subscribe([f"{topic}.dlq"])
        return consume_all(reader, expected, timeout=90)
    finally:
        reader.close()


def test_a_12_mib_message_becomes_an_envelope_and_its_partition_moves_on(
    tansu_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    big = b'{"id": "big", "n": -1, "text": "' + b"x" * BIG + b'"}'
    stream = [*(message(i) for i in range(100)), (b"big", big)]
    stream += [message(i) for i in range(100, 600)]
    produce_big(tansu_broker.bootstrap, topic, stream)
    port = free_port()
    dlq_table = str(tmp_path / "dead.lance")
    config, table = sink_config(
        tmp_path,
        tansu_broker.bootstrap,
        [topic],
        group,
        extra={
            "dlq": {"lance_table_uri": dlq_table},
            "observability": {"metrics_port": port},
            "kafka": {"consume_batch_size": 100},
            "memtable": {"max_rows": 100},
        },
    )
    sink = SinkProcess(config, tmp_path / "sink.log")
    try:
        ends = wait_caught_up(tansu_broker.bootstrap, group, topic, timeout=120, procs=[sink])
        metrics = scrape(port)
        # The stream above can arrive in one or two batches (a memtable each): 300 more
        # rows, a flush of 100 at a time, give maintenance fragments to compact.
        more = [message(i) for i in range(600, 900)]
        produce_in_steps(tansu_broker.bootstrap, topic, group, more, 100, [sink])
        wait_maintained([sink])
    finally:
        assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    assert ends[0] == len(stream)  # every offset committed, the oversized one included
    assert sorted(r["n"] for r in table_rows(table)) == list(range(900))

    (letter,) = dead_letters(tansu_broker.bootstrap, topic, 1)
    headers = dict(letter.headers() or [])
    assert headers["lance_sink.reason"] == b"oversized"
    assert headers["lance_sink.offset"] == b"100"
    assert headers["lance_sink.partition"] == b"0"
    assert headers["lance_sink.payload"] == b"omitted"
    assert headers["lance_sink.payload_bytes"] == str(len(big)).encode()
    assert headers["lance_sink.payload_sha256"] == hashlib.sha256(big).hexdigest().encode()
    assert headers["lance_sink.refused"].startswith(b"MSG_SIZE_TOO_LARGE")
    assert headers["lance_sink.payload_table"] == dlq_table.encode()
    assert letter.key() == b"big"
    body = json.loads(letter.value())
    assert body["offset"] == 100
    assert body["payload_sha256"] == hashlib.sha256(big).hexdigest()

    # The full payload is in the dead-letter Lance table.
    (row,) = lance.dataset(dlq_table).to_table().to_pylist()
    assert (row["offset"], row["reason"], row["value"]) == (100, "oversized", big)

    # The refused attempt was counted and logged, the envelope counted.
    failures = "lance_sink_dlq_delivery_failures_total"
    assert sample(metrics, failures, error="MSG_SIZE_TOO_LARGE", topic=topic) == 1
    omitted = "lance_sink_dlq_payload_omitted_total"
    assert sample(metrics, omitted, reason="oversized", topic=topic) == 1
    failed = [e for e in sink.events() if e["event"] == "dlq_delivery_failed"]
    assert failed
    assert failed[0]["offset"] == 100
    assert failed[0]["outcome"] == "size"
    assert_maintained_without_flush_failures([sink])


# The dead-letter topic accepts only envelopes: every full dead letter is refused.
ENVELOPES_ONLY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "value": {
            "type": "object",
            "required": ["payload"],
            "properties": {"payload": {"const": "omitted"}},
        }
    },
}
# The dead-letter topic accepts nothing the sink sends, envelopes included.
NOTHING: dict[str, Any] = {
    "type": "object",
    "properties": {"value": {"type": "object", "required": ["never_present"]}},
}


@pytest.fixture
def validating_tansu(
    request: pytest.FixtureRequest, tmp_path: Path, topic: str
) -> Iterator[Broker]:
    """A tansu that refuses records of `<topic>.dlq` not valid against the schema given as
    the fixture's parameter (ENVELOPES_ONLY by default), with INVALID_RECORD."""
    registry = tmp_path / "schemas"
    registry.mkdir()
    schema = getattr(request, "param", ENVELOPES_ONLY)
    (registry / f"{topic}.dlq.json").write_text(json.dumps(schema))
    broker = start_tansu(tmp_path, schema_registry=registry)
    yield broker
    broker.stop()


def test_a_dead_letter_the_broker_refuses_becomes_an_envelope(
    validating_tansu: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    bootstrap = validating_tansu.bootstrap
    bad = [(b"bad-1", b'{"id": "x", "n": '), (b"bad-2", b"not json at all")]
    stream = [*(message(i) for i in range(50)), bad[0]]
    stream += [*(message(i) for i in range(50, 250)), bad[1]]
    stream += [message(i) for i in range(250, 600)]  # six batches of 100: six flushes
    produce_big(bootstrap, topic, stream)
    config, table = sink_config(
        tmp_path,
        bootstrap,
        [topic],
        group,
        extra={"kafka": {"consume_batch_size": 100}, "memtable": {"max_rows": 100}},
    )
    sink = SinkProcess(config, tmp_path / "sink.log")
    try:
        ends = wait_caught_up(bootstrap, group, topic, timeout=120, procs=[sink])
        wait_maintained([sink])
    finally:
        assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    assert ends[0] == len(stream)
    assert sorted(r["n"] for r in table_rows(table)) == list(range(600))

    letters = dead_letters(bootstrap, topic, 2)
    by_key = {m.key(): m for m in letters}
    assert set(by_key) == {b"bad-1", b"bad-2"}
    for key, value in bad:
        headers = dict(by_key[key].headers() or [])
        assert headers["lance_sink.reason"] == b"invalid_json"
        assert headers["lance_sink.payload"] == b"omitted"
        assert headers["lance_sink.refused"].startswith(b"INVALID_RECORD")
        assert headers["lance_sink.payload_sha256"] == hashlib.sha256(value).hexdigest().encode()
        assert "lance_sink.payload_table" not in headers  # no dead-letter table configured
    assert int(dict(by_key[b"bad-1"].headers() or [])["lance_sink.offset"]) == 50
    assert int(dict(by_key[b"bad-2"].headers() or [])["lance_sink.offset"]) == 251
    events = [e["event"] for e in sink.events()]
    assert "dlq_delivery_failed" in events
    assert_maintained_without_flush_failures([sink])


@pytest.mark.parametrize("validating_tansu", [NOTHING], indirect=True)
def test_a_partition_held_by_dead_letters_is_reported_and_loses_nothing(
    validating_tansu: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """Envelopes refused too and no dead-letter table: the partition waits (nothing would
    record the message), and says so in /readyz, /v1/status and the held-seconds gauge."""
    bootstrap = validating_tansu.bootstrap
    # 100 good messages (a flush of 20 at a time, below) before the bad one.
    bad_at, step = 100, 20
    stream = [*(message(i) for i in range(bad_at)), (b"bad", b"{not json")]
    stream += [message(i) for i in range(bad_at, bad_at + 40)]
    produce_big(bootstrap, topic, stream[:step])
    port = free_port()
    config, table = sink_config(
        tmp_path,
        bootstrap,
        [topic],
        group,
        extra={
            "dlq": {"stalled_after_s": 2},
            "observability": {"metrics_port": port},
            "kafka": {"consume_batch_size": step},
            "memtable": {"max_rows": step},
        },
    )
    sink = SinkProcess(config, tmp_path / "sink.log")
    try:
        wait_caught_up(bootstrap, group, topic, timeout=120, procs=[sink])
        good = stream[step:bad_at]
        produce_in_steps(bootstrap, topic, group, good, step, [sink])
        produce_big(bootstrap, topic, stream[bad_at:])
        deadline = time.monotonic() + 90
        reasons: list[str] = []
        while not any("undelivered dead letter" in r for r in reasons):
            assert time.monotonic() < deadline, (reasons, sink.log_path.read_text()[-3000:])
            assert sink.alive(), sink.log_path.read_text()[-3000:]
            time.sleep(0.5)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5)
                reasons = []
            except urllib.error.HTTPError as exc:
                reasons = json.loads(exc.read())["reasons"]
            except OSError:
                reasons = []
        (reason,) = [r for r in reasons if "undelivered dead letter" in r]
        assert reason.startswith(f"{topic}[0]: held ")
        # tansu fences an idempotent producer after it refuses a record: the sink replaces
        # the producer, so the last error alternates between the two.
        assert "last error: INVALID_RECORD" in reason or "last error: PRODUCER_FENCED" in reason
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=5) as r:
            status = json.loads(r.read())
        (part,) = [p for p in status["partitions"] if p["partition"] == 0]
        assert part["held"]
        assert part["paused"]
        assert part["dead_letters"]["pending"] == 1
        assert part["dead_letters"]["stalled"]
        assert part["dead_letters"]["last_error"].startswith(("INVALID_RECORD", "PRODUCER_FENCED"))
        held = sample(scrape(port), "lance_sink_dlq_held_seconds", partition="0", topic=topic)
        assert held is not None
        assert held > 1  # refreshed once a second
        wait_maintained([sink])  # the rows before the dead letter, flushed
    finally:
        assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    # Nothing at or after the unrecorded dead letter was committed or written.
    committed = committed_offsets(bootstrap, group, topic, 1)[0]
    assert 0 < committed <= bad_at
    assert sorted(r["n"] for r in table_rows(table)) == list(range(committed))
    failed = [e for e in sink.events() if e["event"] == "dlq_delivery_failed"]
    assert failed
    assert {e["outcome"] for e in failed} == {"refused", "producer"} or {
        e["outcome"] for e in failed
    } == {"refused"}
    assert_maintained_without_flush_failures([sink])


@pytest.mark.parametrize("validating_tansu", [NOTHING], indirect=True)
def test_a_dead_letter_refused_even_as_an_envelope_is_recorded_in_the_table(
    validating_tansu: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """With a dead-letter Lance table, a letter the topic refuses even as an envelope is
    recorded there, and the partition moves on."""
    bootstrap = validating_tansu.bootstrap
    stream = [*(message(i) for i in range(40)), (b"bad", b"{not json")]
    stream += [message(i) for i in range(40, 80)]
    produce_big(bootstrap, topic, stream)
    dlq_table = str(tmp_path / "dead.lance")
    config, table = sink_config(
        tmp_path,
        bootstrap,
        [topic],
        group,
        extra={
            "dlq": {"lance_table_uri": dlq_table},
            "kafka": {"consume_batch_size": 10},
            "memtable": {"max_rows": 10},
        },
    )
    sink = SinkProcess(config, tmp_path / "sink.log")
    try:
        ends = wait_caught_up(bootstrap, group, topic, timeout=120, procs=[sink])
        wait_maintained([sink])
    finally:
        assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    assert ends[0] == len(stream)
    assert sorted(r["n"] for r in table_rows(table)) == list(range(80))
    (row,) = lance.dataset(dlq_table).to_table().to_pylist()
    assert (row["offset"], row["reason"], row["value"]) == (40, "invalid_json", b"{not json")
    (event,) = [e for e in sink.events() if e["event"] == "dead_letter_recorded_in_table_only"]
    assert (event["offset"], event["table"]) == (40, dlq_table)
    assert_maintained_without_flush_failures([sink])
