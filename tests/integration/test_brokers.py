"""Each test broker is a real Kafka broker: produce, consume, group join, commit, committed read."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, TopicPartition

from tests.support.brokers import Broker
from tests.support.kafka import (
    committed_offsets,
    consume_all,
    consumer_conf,
    end_offsets,
    produce,
    wait_for_assignment,
)

pytestmark = [pytest.mark.broker, pytest.mark.timeout(180)]


@pytest.fixture(params=["mock_broker", "tansu_broker"])
def any_broker(request: pytest.FixtureRequest) -> Broker:
    broker: Broker = request.getfixturevalue(request.param)
    return broker


def test_produce_consume_commit_roundtrip(any_broker: Broker, topic: str, group: str) -> None:
    n = 400
    produce(any_broker.bootstrap, topic, ((f"k{i}".encode(), f"v{i}".encode()) for i in range(n)))
    consumer = Consumer(consumer_conf(any_broker.bootstrap, group))
    try:
        consumer.subscribe([topic])
        early = wait_for_assignment(consumer)
        assert {tp.partition for tp in consumer.assignment()} == {0, 1, 2, 3}
        messages = consume_all(consumer, n, already=early)
        assert sorted(m.value() for m in messages) == sorted(f"v{i}".encode() for i in range(n))
        last: dict[int, int] = {}
        for m in messages:
            last[m.partition()] = max(last.get(m.partition(), -1), m.offset())
        consumer.commit(
            offsets=[TopicPartition(topic, p, o + 1) for p, o in last.items()],
            asynchronous=False,
        )
    finally:
        consumer.close()
    committed = committed_offsets(any_broker.bootstrap, group, topic)
    assert committed == {p: o + 1 for p, o in last.items()}
    assert sum(committed.values()) == n
    assert end_offsets(any_broker.bootstrap, topic) == committed


def test_two_members_share_the_partitions(any_broker: Broker, topic: str, group: str) -> None:
    produce(any_broker.bootstrap, topic, ((None, b"x") for _ in range(40)))
    first = Consumer(consumer_conf(any_broker.bootstrap, group))
    second = Consumer(consumer_conf(any_broker.bootstrap, group))
    try:
        first.subscribe([topic])
        wait_for_assignment(first)
        second.subscribe([topic])
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            first.consume(100, 0.2)
            second.consume(100, 0.2)
            a = {tp.partition for tp in first.assignment()}
            b = {tp.partition for tp in second.assignment()}
            if a and b and not (a & b) and (a | b) == {0, 1, 2, 3}:
                break
        else:
            pytest.fail(f"no cooperative rebalance: {first.assignment()} / {second.assignment()}")
    finally:
        first.close()
        second.close()
