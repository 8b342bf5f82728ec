"""The dead-letter envelope, how delivery failures are classified, and how the dead-letter
producer is configured and sized."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import lance
import pytest
import structlog
from confluent_kafka import KafkaError

from config import ConfigError, load_settings, redacted
from sink.decode import DeadLetter
from sink.dlq import (
    DLQ_TABLE_COMPACT_FRAGMENTS,
    ENVELOPE_MAX_HEADER_BYTES,
    ENVELOPE_MAX_KEY_BYTES,
    DeadLetterBatch,
    DeadLetterTable,
    _Pending,
    classify,
    envelope,
    message_max_bytes,
    producer_conf,
)

MINIMAL = """
[kafka]
bootstrap_servers = "localhost:9092"
topics = ["events"]

[table]
uri = "./data/events.lance"
columns = [{ name = "id", type = "string" }]
"""


def letter(value: bytes | None = b"x" * 5000, **kw: object) -> DeadLetter:
    fields: dict[str, object] = {
        "topic": "events",
        "partition": 3,
        "offset": 41,
        "timestamp_ms": 1_700_000_000_000,
        "key": b"k-1",
        "value": value,
        "headers": [("trace", b"abc")],
        "reason": "oversized",
        "detail": "value is 5000 bytes, more than 2000",
    }
    fields.update(kw)
    return DeadLetter(**fields)  # type: ignore[arg-type]  # test builder


def test_envelope_carries_coordinates_size_and_sha256_not_the_payload() -> None:
    d = letter()
    env = envelope(d, "MSG_SIZE_TOO_LARGE: Broker: Message size too large", "s3://b/dead.lance")
    headers = dict(env.headers)
    sha = hashlib.sha256(d.value or b"").hexdigest()
    assert headers["lance_sink.reason"] == b"oversized"
    assert headers["lance_sink.detail"] == d.detail.encode()
    assert headers["lance_sink.topic"] == b"events"
    assert headers["lance_sink.partition"] == b"3"
    assert headers["lance_sink.offset"] == b"41"
    assert headers["lance_sink.timestamp"] == b"1700000000000"
    assert headers["lance_sink.payload"] == b"omitted"
    assert headers["lance_sink.payload_bytes"] == b"5000"
    assert headers["lance_sink.payload_sha256"] == sha.encode()
    assert headers["lance_sink.refused"].startswith(b"MSG_SIZE_TOO_LARGE")
    assert headers["lance_sink.payload_table"] == b"s3://b/dead.lance"
    assert headers["trace"] == b"abc"  # the original headers are kept
    assert env.key == b"k-1"
    body = json.loads(env.value)
    assert body["lance_sink"] == "dead_letter_envelope"
    assert (body["topic"], body["partition"], body["offset"]) == ("events", 3, 41)
    assert (body["payload_bytes"], body["payload_sha256"]) == (5000, sha)
    assert body["payload"] == "omitted"
    assert body["payload_table"] == "s3://b/dead.lance"
    assert not body["key_omitted"]
    assert not body["headers_omitted"]
    assert b"x" * 100 not in env.value  # the payload itself is not in it
    assert len(env.value) < 1000


def test_envelope_without_a_table_and_with_oversized_key_and_headers() -> None:
    d = letter(
        key=b"k" * (ENVELOPE_MAX_KEY_BYTES + 1),
        headers=[("big", b"h" * ENVELOPE_MAX_HEADER_BYTES)],
        timestamp_ms=None,
    )
    env = envelope(d, "INVALID_RECORD: Broker: Broker failed to validate record", None)
    headers = dict(env.headers)
    assert "lance_sink.payload_table" not in headers
    assert "lance_sink.timestamp" not in headers
    assert "big" not in headers
    assert env.key is None
    body = json.loads(env.value)
    assert body["payload_table"] is None
    assert body["key_omitted"]
    assert body["headers_omitted"]
    assert sum(len(k) + len(v or b"") for k, v in env.headers) < 2000


def test_envelope_of_a_tombstone_dead_letter() -> None:
    env = envelope(letter(value=None, reason="tombstone"), "TOPIC_AUTHORIZATION_FAILED: x", None)
    body = json.loads(env.value)
    assert body["payload_bytes"] == 0
    assert body["payload_sha256"] == hashlib.sha256(b"").hexdigest()


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (KafkaError.MSG_SIZE_TOO_LARGE, "size"),
        (KafkaError.RECORD_LIST_TOO_LARGE, "size"),
        (KafkaError.INVALID_RECORD, "refused"),
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, "refused"),
        (KafkaError.POLICY_VIOLATION, "refused"),
        (KafkaError.PRODUCER_FENCED, "producer"),
        (KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, "producer"),
        (KafkaError._FATAL, "producer"),
        (KafkaError._MSG_TIMED_OUT, "retry"),
        (KafkaError.NOT_ENOUGH_REPLICAS, "retry"),
        (KafkaError.UNKNOWN_TOPIC_OR_PART, "retry"),
        (KafkaError._TRANSPORT, "retry"),
    ],
)
def test_classify(code: int, expected: str) -> None:
    assert classify(KafkaError(code)) == expected


def test_fatal_errors_replace_the_producer() -> None:
    assert classify(KafkaError(KafkaError._MSG_TIMED_OUT, fatal=True)) == "producer"


def test_the_producer_is_sized_for_the_largest_dead_letter(tmp_path: Path) -> None:
    assert message_max_bytes(1 << 20) == (1 << 20) + (64 << 10)
    assert message_max_bytes(2000) == 1_000_000  # never below librdkafka's default
    assert message_max_bytes(10 << 30) == 1_000_000_000  # librdkafka's ceiling
    path = tmp_path / "sink.toml"
    path.write_text(MINIMAL + '\n[source]\nmax_message_bytes = "8MiB"\n')
    conf = producer_conf({"bootstrap.servers": "b:9092"}, load_settings(path))
    assert conf["message.max.bytes"] == (8 << 20) + (64 << 10)
    assert conf["bootstrap.servers"] == "b:9092"
    assert (conf["enable.idempotence"], conf["acks"], conf["message.timeout.ms"]) == (
        True,
        "all",
        30_000,
    )


def test_dlq_librdkafka_passes_through_and_may_resize(tmp_path: Path) -> None:
    path = tmp_path / "sink.toml"
    path.write_text(
        MINIMAL + '\n[dlq.librdkafka]\n"message.max.bytes" = 20000000\n"linger.ms" = 50\n'
    )
    settings = load_settings(path)
    conf = producer_conf({}, settings)
    assert (conf["message.max.bytes"], conf["linger.ms"]) == (20_000_000, 50)


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ('"message.max.bites" = 1', "message.max.bites"),
        ('"linger.ms" = "soon"', "linger.ms"),
        ('"acks" = "1"', "cannot be passed through"),
        ('"enable.idempotence" = false', "cannot be passed through"),
        ('"message.timeout.ms" = 5', "dlq.produce_timeout_ms"),
        ('"bootstrap.servers" = "x:1"', "kafka.bootstrap_servers"),
    ],
)
def test_dlq_librdkafka_is_checked(tmp_path: Path, line: str, fragment: str) -> None:
    path = tmp_path / "sink.toml"
    path.write_text(MINIMAL + f"\n[dlq.librdkafka]\n{line}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    ((key, reason),) = [(p.key, p.reason) for p in info.value.problems]
    assert key == "dlq.librdkafka"
    assert fragment in reason


def test_librdkafka_secrets_are_masked_in_the_effective_config(tmp_path: Path) -> None:
    path = tmp_path / "sink.toml"
    path.write_text(
        MINIMAL
        + '\n[dlq.librdkafka]\n"ssl.keystore.password" = "hunter2"\n"linger.ms" = 7\n'
        + '\n[kafka.librdkafka]\n"sasl.oauthbearer.client.secret" = "s3cr3t"\n'
    )
    settings = load_settings(path)
    assert settings.dlq.librdkafka["ssl.keystore.password"] == "hunter2"  # used as given
    dumped = redacted(settings)
    assert dumped["dlq"]["librdkafka"] == {"ssl.keystore.password": "**********", "linger.ms": 7}
    assert dumped["kafka"]["librdkafka"] == {"sasl.oauthbearer.client.secret": "**********"}
    text = json.dumps(dumped)
    assert "hunter2" not in text
    assert "s3cr3t" not in text


def test_a_batch_reports_what_holds_it() -> None:
    first, second = _Pending(letter()), _Pending(letter(offset=42))
    batch = DeadLetterBatch([first, second])
    assert (batch.acked, batch.pending) == (False, 2)
    assert batch.waiting_s() >= 0
    second.error = "MSG_SIZE_TOO_LARGE: too large"
    assert batch.last_error == "MSG_SIZE_TOO_LARGE: too large"
    first.delivered = second.delivered = True
    assert (batch.acked, batch.pending, batch.waiting_s(), batch.last_error) == (
        True,
        0,
        0.0,
        None,
    )


def coordinates(uri: str) -> list[tuple[str, int, int]]:
    rows = lance.dataset(uri).to_table(columns=["topic", "partition", "offset"]).to_pylist()
    return sorted((r["topic"], r["partition"], r["offset"]) for r in rows)


def test_dead_letters_sent_again_are_in_the_table_once(tmp_path: Path) -> None:
    """After a crash the dead letters of a batch whose offsets were not committed are sent
    again: the dead-letter table keeps one row per (topic, partition, offset)."""
    uri = str(tmp_path / "dead.lance")
    table = DeadLetterTable(uri, None)
    try:
        first = [letter(offset=o) for o in (10, 11, 12)]
        assert table.append(first).result(30)
        assert table.append(first).result(30)  # the same batch, replayed
        # A replay that reaches further: the known letters once, the new ones added.
        again = [letter(offset=o) for o in (11, 12, 13)] + [letter(partition=4, offset=11)]
        assert table.append(again).result(30)
    finally:
        table.close()
    assert coordinates(uri) == [("events", 3, o) for o in (10, 11, 12, 13)] + [("events", 4, 11)]
    rows = lance.dataset(uri).to_table().to_pylist()
    assert {r["value"] for r in rows} == {b"x" * 5000}  # full payloads, as before


def write_together(uri: str, writers: int, letters: int, rounds: int) -> None:
    """`writers` dead-letter tables at `uri`, writer p appending the letters of partition p
    (offsets 0 .. letters-1) at once with the others, `rounds` times (a replay)."""
    tables = [DeadLetterTable(uri, None) for _ in range(writers)]
    try:
        for _round in range(rounds):
            futures = [
                t.append([letter(partition=p, offset=o) for o in range(letters)])
                for p, t in enumerate(tables)
            ]
            assert all(f.result(30) for f in futures)
    finally:
        for t in tables:
            t.close()


def test_two_writers_of_a_new_dead_letter_table_lose_nothing(tmp_path: Path) -> None:
    """Two sink processes (here two writers) that create the table at once, and replay."""
    uri = str(tmp_path / "dead.lance")
    write_together(uri, writers=2, letters=5, rounds=2)
    assert coordinates(uri) == [("events", p, o) for p in range(2) for o in range(5)]


@pytest.mark.parametrize("attempt", range(3))
def test_writers_creating_the_dead_letter_table_together_keep_every_letter(
    tmp_path: Path, attempt: int
) -> None:
    """Once: the first letters of several pods at once, no replay. A create carrying letters
    that lost its commit to another pod's create was retried by Lance as an Overwrite,
    which dropped the other pod's letters (their offsets committed: lost for good)."""
    uri = str(tmp_path / "dead.lance")
    write_together(uri, writers=4, letters=3, rounds=1)
    assert coordinates(uri) == [("events", p, o) for p in range(4) for o in range(3)]


def test_the_dead_letter_table_is_compacted_and_its_old_versions_removed(tmp_path: Path) -> None:
    """Each write is a Lance commit of a fragment: a trickle of dead letters left the table
    one fragment and one version per batch, for ever, each merge-insert scanning them all."""
    uri = str(tmp_path / "dead.lance")
    table = DeadLetterTable(uri, None, retention_s=0)
    try:
        for o in range(3 * DLQ_TABLE_COMPACT_FRAGMENTS):
            assert table.append([letter(offset=o)]).result(30)
    finally:
        table.close()
    ds = lance.dataset(uri)
    assert len(ds.get_fragments()) < DLQ_TABLE_COMPACT_FRAGMENTS
    assert len(ds.versions()) < DLQ_TABLE_COMPACT_FRAGMENTS
    expected = [("events", 3, o) for o in range(3 * DLQ_TABLE_COMPACT_FRAGMENTS)]
    assert coordinates(uri) == expected


def test_a_dead_letter_table_that_cannot_be_created_says_why(tmp_path: Path) -> None:
    # The log line said only the error of the open that followed the failed create
    # (where the table cannot be created, often just "not found").
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    table = DeadLetterTable(str(blocker / "dead.lance"), None)
    try:
        with structlog.testing.capture_logs() as logs:
            assert table.append([letter(offset=1)]).result(30) is False
    finally:
        table.close()
    (failed,) = [e for e in logs if e["event"] == "dlq_table_append_failed"]
    assert "cannot create table" in failed["error"], failed
    assert "Not a directory" in failed["error"], failed
