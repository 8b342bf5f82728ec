"""No message can stop the sink: the messages the decoder's fuzz and metamorphic tests
found interesting (tests/unit/test_decode_metamorphic.py), between good rows on one
partition, through the real `lance-sink run` with its default decoder and maintenance on.
Every good row lands exactly once, each poison message is in the dead-letter topic with
its reason, the sink never exits, and every offset is committed. (Before, the 400-digit
vector component made the sink exit 1 on every start: a crash loop.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka import Consumer

from tests.support.brokers import Broker
from tests.support.kafka import consume_all, consumer_conf, produce
from tests.support.sink import (
    DIM,
    SinkProcess,
    message,
    sink_config,
    table_rows,
    wait_caught_up,
)

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

BIG = "1" + "0" * 400
HUGE = "9" * 5000
REST = ", ".join(["0.5"] * (DIM - 1))


def poison() -> dict[bytes, tuple[bytes, str]]:
    """Key -> (value, the reason of its dead letter)."""
    vec = "[" + ", ".join(["0.25"] * DIM) + "]"
    cases: dict[str, tuple[str | bytes, str]] = {
        "big-component": (f'{{"id": "p1", "n": 1, "vec": [{BIG}, {REST}]}}', "nan_in_vector"),
        "big-negative": (f'{{"id": "p2", "n": 1, "vec": [-{BIG}, {REST}]}}', "nan_in_vector"),
        "huge-component": (f'{{"id": "p3", "n": 1, "vec": [{HUGE}, {REST}]}}', "nan_in_vector"),
        "double-overflow": (f'{{"id": "p4", "n": 1, "vec": [1e400, {REST}]}}', "nan_in_vector"),
        "neg-nan": (f'{{"id": "p5", "n": 1, "vec": [-NaN, {REST}]}}', "nan_in_vector"),
        "big-int": (f'{{"id": "p6", "n": {BIG}, "vec": {vec}}}', "wrong_type"),
        "huge-int": (f'{{"id": "p7", "n": -{HUGE}, "vec": {vec}}}', "wrong_type"),
        "lone-surrogate": (f'{{"id": "\\ud800", "n": 1, "vec": {vec}}}', "wrong_type"),
        "encoded-surrogate": (
            b'{"id": "\xed\xa0\x80", "n": 1, "vec": ' + vec.encode() + b"}",
            "invalid_utf8",
        ),
        "last-key-wins": (f'{{"id": "p8", "n": 1, "vec": {vec}, "n": "one"}}', "wrong_type"),
        "truncated": ('{"id": "p9", "n": 1, "vec": [0.25, 0.', "invalid_json"),
        "not-an-object": (f"[{BIG}, 1]", "not_an_object"),
    }
    return {
        k.encode(): (v if isinstance(v, bytes) else v.encode(), reason)
        for k, (v, reason) in cases.items()
    }


def test_poison_messages_between_good_rows_never_stop_the_sink(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    bad = poison()
    # Good rows the per-message paths read alike (a non-standard literal in a field the
    # table does not map, a byte order mark, duplicate keys): rows, not dead letters.
    odd_good = {
        1000: f'{{"id": "g-1000", "n": 1000, "other": -NaN, "vec": [{REST}, 1]}}',
        1001: f'{{"id": "g-1001", "n": 1001, "other": [Inf, -Inf, {HUGE}], "vec": [{REST}, 1]}}',
        1002: f'{{"id": "x", "id": "g-1002", "n": 1002, "vec": [{REST}, 1]}}',
    }
    stream: list[tuple[bytes, bytes]] = []
    letters = list(bad.items())
    for i in range(400):
        stream.append(message(i))
        if i % 30 == 7 and letters:
            key, (value, _) = letters.pop()
            stream.append((key, value))
    stream += [(f"g-{n}".encode(), v.encode()) for n, v in odd_good.items()]
    stream += [(key, value) for key, (value, _) in letters]  # the rest, and a second time
    stream += [(key, value) for key, (value, _) in bad.items()]
    stream += [message(i) for i in range(400, 450)]
    produce(kafka_broker.bootstrap, topic, stream, partition=0)
    config, table = sink_config(
        tmp_path,
        kafka_broker.bootstrap,
        [topic],
        group,
        extra={"kafka": {"consume_batch_size": 64}, "memtable": {"max_rows": 100}},
    )
    sink = SinkProcess(config, tmp_path / "sink.log")
    try:
        ends = wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
        assert sink.proc.poll() is None, sink.log_path.read_text()[-3000:]
    finally:
        assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    assert ends[0] == len(stream)  # committed == end, past every poison message

    ns = sorted(r["n"] for r in table_rows(table))
    assert ns == [*range(450), *odd_good]  # every good row exactly once

    reader = Consumer(consumer_conf(kafka_broker.bootstrap, group + "-dlq"))
    try:
        reader.subscribe([f"{topic}.dlq"])
        got = consume_all(reader, 2 * len(bad), timeout=90)
    finally:
        reader.close()
    reasons: dict[bytes, set[bytes]] = {}
    for m in got:
        headers = dict(m.headers() or [])
        reasons.setdefault(m.key(), set()).add(headers["lance_sink.reason"])
        assert m.value() == bad[m.key()][0]  # the bytes as sent
        assert headers["lance_sink.detail"]
    assert reasons == {key: {reason.encode()} for key, (_, reason) in bad.items()}
    log = sink.log_path.read_text()
    assert "decode_error" not in log, "a decode path raised"


def test_rows_the_table_refuses_are_dead_letters_and_their_batches_rows_land(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """The table refuses some rows the decoder passed (a test plugin makes
    `TableSpec.validate` refuse one id): each such message is a `rejected_by_table` dead
    letter, every other row of its batch lands (it used to dead-letter the whole batch)."""
    stream = [message(i) for i in range(300)]
    refused = {17, 18, 150, 299}
    for i in refused:
        key, value = message(i)
        stream[i] = (key, value.replace(f'"m-{i}"'.encode(), b'"refuse-me"'))
    produce(kafka_broker.bootstrap, topic, stream, partition=0)
    config, table = sink_config(
        tmp_path,
        kafka_broker.bootstrap,
        [topic],
        group,
        extra={
            "kafka": {"consume_batch_size": 64},
            "backpressure": {"controller": "tests.support.slow:controller"},
        },
    )
    sink = SinkProcess(
        config, tmp_path / "sink.log", env={"LANCE_SINK_TEST_REFUSE_ID": "refuse-me"}
    )
    try:
        ends = wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
        assert sink.proc.poll() is None, sink.log_path.read_text()[-3000:]
    finally:
        assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    assert ends[0] == len(stream)
    assert sorted(r["n"] for r in table_rows(table)) == sorted(set(range(300)) - refused)
    reader = Consumer(consumer_conf(kafka_broker.bootstrap, group + "-dlq"))
    try:
        reader.subscribe([f"{topic}.dlq"])
        got = consume_all(reader, len(refused), timeout=90)
    finally:
        reader.close()
    offsets = set()
    for m in got:
        headers = dict(m.headers() or [])
        assert headers["lance_sink.reason"] == b"rejected_by_table"
        assert b"the test refuses this id" in headers["lance_sink.detail"]
        offsets.add(int(headers["lance_sink.offset"]))
    assert offsets == refused
