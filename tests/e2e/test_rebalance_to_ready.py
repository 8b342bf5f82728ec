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

from tests.e2e.test_observability import get, sink_config, wait_http
from tests.support.brokers import Broker, free_ports
from tests.support.sink import SinkProcess

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

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
