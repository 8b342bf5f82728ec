"""Rebalance to ready quickly (issue 39, item 3), through the real `lance-sink run`.

A member joining a group costs the group protocol's rounds (cooperative-sticky: two, one
to revoke what moves and one to assign it), each paced on the brokers the tests use by
the session timeout (librdkafka's mock cluster holds each round for about it, tansu for
half of it), then the shard opens of the partitions that moved. With librdkafka's 45 s
session timeout a second member took ~90 s on the mock cluster to hold its partitions;
and with four open threads, a member given many partitions queued their opens four at a
time. `bench/rebalance.py` measures the whole timeline; these tests pin both causes."""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from config.settings import KafkaSettings
from tests.e2e.test_observability import get, sink_config, wait_http
from tests.support.brokers import Broker, free_ports
from tests.support.kafka import end_offsets, produce
from tests.support.sink import SinkProcess, messages, wait_caught_up

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

#: The default session timeout, as a user who sets none runs it.
DEFAULT_SESSION_MS = KafkaSettings.model_fields["session_timeout_ms"].default
#: Seconds from the joiner's start to both members ready on the mock cluster. The mock
#: holds each of cooperative-sticky's two rounds for about the session timeout (6 s by
#: default: ~12 s; 45 s before: ~90 s), the joiner starts in ~2 s and opens its shards in
#: well under one; room for a busy machine.
JOIN_BOUND_S = 25.0
#: Each shard open is slowed to this (tests.support.slow) in the parallel-open test.
OPEN_DELAY_S = 3.0
#: Partitions whose opens must overlap: with four open threads they took four rounds.
WIDE = 16


def active(port: int) -> tuple[bool, set[int]]:
    """Whether /readyz says ready, and the partitions /v1/status shows ACTIVE."""
    code, _ = get(port, "/readyz")
    _, status = get(port, "/v1/status")
    partitions: list[dict[str, Any]] = status["partitions"]  # type: ignore[assignment]
    return code == 200, {p["partition"] for p in partitions if p["phase"] == "active"}


def event_times(sink: SinkProcess, name: str) -> list[float]:
    return [
        datetime.datetime.fromisoformat(e["timestamp"]).timestamp()
        for e in sink.events()
        if e.get("event") == name
    ]


def test_a_joining_member_holds_its_partitions_within_seconds(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """Default group timings: a second member joins a running one; both are ready and
    every partition is ACTIVE in exactly one of them within `JOIN_BOUND_S`."""
    produce(kafka_broker.bootstrap, topic, messages(0, 400))
    partitions = set(end_offsets(kafka_broker.bootstrap, topic))
    assert len(partitions) > 1
    port_a, port_b = free_ports(2)
    settings = {"kafka__session_timeout_ms": DEFAULT_SESSION_MS, "maintenance__enabled": False}
    config_a = sink_config(tmp_path, kafka_broker, topic, group, port_a, **settings)
    config_b = sink_config(tmp_path, kafka_broker, topic, group, port_b, **settings)
    a = SinkProcess(config_a, tmp_path / "a.log")
    b: SinkProcess | None = None
    try:
        wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[a])
        wait_http(port_a)
        b = SinkProcess(config_b, tmp_path / "b.log")
        started = time.monotonic()
        took = None
        while time.monotonic() - started < 2 * JOIN_BOUND_S:
            assert a.alive(), a.log_path.read_text()[-3000:]
            assert b.alive(), b.log_path.read_text()[-3000:]
            try:
                ready_a, held_a = active(port_a)
                ready_b, held_b = active(port_b)
            except (OSError, KeyError):
                time.sleep(0.1)
                continue
            if ready_a and ready_b and held_b and held_a | held_b == partitions:
                assert not held_a & held_b
                took = time.monotonic() - started
                break
            time.sleep(0.1)
        assert took is not None, "the second member never held its partitions"
        assert took < JOIN_BOUND_S, f"both ready {took:.1f} s after the second member started"
    finally:
        if b is not None:
            assert b.stop() == 0
        assert a.stop() == 0


def test_a_member_given_many_partitions_opens_their_shards_at_once(
    tansu_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """`WIDE` partitions whose shard opens each take `OPEN_DELAY_S`: all of them are ACTIVE
    within two opens' time of the assignment, not one open per four partitions."""
    admin = AdminClient({"bootstrap.servers": tansu_broker.bootstrap})
    for future in admin.create_topics([NewTopic(topic, WIDE)]).values():
        future.result(30)
    (port,) = free_ports(1)
    config = sink_config(
        tmp_path,
        tansu_broker,
        topic,
        group,
        port,
        backpressure__controller="tests.support.slow:controller",
        maintenance__enabled=False,
    )
    sink = SinkProcess(
        config, tmp_path / "sink.log", env={"LANCE_SINK_TEST_REPLAY_DELAY_S": str(OPEN_DELAY_S)}
    )
    try:
        wait_http(port)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert sink.alive(), sink.log_path.read_text()[-3000:]
            ready, held = active(port)
            if ready and len(held) == WIDE:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the partitions never became active")
    finally:
        assert sink.stop() == 0
    (opening,) = event_times(sink, "partitions_opening")
    assigned = event_times(sink, "partition_assigned")
    assert len(assigned) == WIDE
    took = max(assigned) - opening
    assert took < 2 * OPEN_DELAY_S, f"{WIDE} opens of {OPEN_DELAY_S} s took {took:.1f} s"
