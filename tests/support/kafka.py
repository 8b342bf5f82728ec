"""Small Kafka client helpers for tests: produce, consume, committed offsets, watermarks."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import confluent_kafka
from confluent_kafka import TopicPartition


def consumer_conf(bootstrap: str, group: str, **extra: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "session.timeout.ms": 6000,
        "partition.assignment.strategy": "cooperative-sticky",
    }
    conf.update(extra)
    return conf


def produce(
    bootstrap: str,
    topic: str,
    messages: Iterable[tuple[bytes | None, bytes | None]],
    partition: int | None = None,
    timeout: float = 30.0,
) -> int:
    """Produce (key, value) pairs, wait for every delivery; returns the count."""
    errors: list[str] = []

    def on_delivery(err: confluent_kafka.KafkaError | None, _msg: Any) -> None:
        if err is not None:
            errors.append(str(err))

    producer = confluent_kafka.Producer(
        {"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5}
    )
    count = 0
    for key, value in messages:
        kwargs: dict[str, Any] = {"key": key, "value": value, "on_delivery": on_delivery}
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                producer.produce(topic, **kwargs)
                break
            except BufferError:
                producer.poll(0.1)
        count += 1
    remaining = producer.flush(timeout)
    assert remaining == 0, f"{remaining} messages undelivered after {timeout}s"
    assert not errors, errors[:5]
    return count


def consume_all(
    consumer: confluent_kafka.Consumer,
    expected: int,
    timeout: float = 60.0,
    already: list[confluent_kafka.Message] | None = None,
) -> list[confluent_kafka.Message]:
    """Consume until `expected` messages arrived in all (or raise on timeout)."""
    got: list[confluent_kafka.Message] = list(already or [])
    deadline = time.monotonic() + timeout
    while len(got) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"consumed {len(got)} of {expected} within {timeout}s")
        got.extend(m for m in consumer.consume(1000, 0.5) if m.error() is None)
    return got


def wait_for_assignment(
    consumer: confluent_kafka.Consumer, timeout: float = 60.0
) -> list[confluent_kafka.Message]:
    """Consume until the consumer has an assignment; returns the messages consumed meanwhile."""
    got: list[confluent_kafka.Message] = []
    deadline = time.monotonic() + timeout
    while not consumer.assignment():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no assignment within {timeout}s")
        got.extend(m for m in consumer.consume(100, 0.2) if m.error() is None)
    return got


def end_offsets(bootstrap: str, topic: str, timeout: float = 30.0) -> dict[int, int]:
    """High watermarks per partition, read from fetch responses (right on tansu too)."""
    consumer = confluent_kafka.Consumer(consumer_conf(bootstrap, "watermark-probe"))
    try:
        meta = consumer.list_topics(topic, timeout=timeout)
        partitions = sorted(meta.topics[topic].partitions)
        tps = [TopicPartition(topic, p, 0) for p in partitions]
        consumer.assign(tps)
        # One fetch per partition fills the cached high watermark from the fetch response.
        deadline = time.monotonic() + timeout
        result: dict[int, int] = {}
        while len(result) < len(partitions) and time.monotonic() < deadline:
            consumer.consume(10_000, 0.2)
            for tp in tps:
                _low, high = consumer.get_watermark_offsets(tp, cached=True)
                if high >= 0:
                    result[tp.partition] = high
        if len(result) < len(partitions):
            raise TimeoutError(f"no watermarks for {topic} within {timeout}s")
        return result
    finally:
        consumer.close()


def commit_offsets(bootstrap: str, group: str, topic: str, offsets: dict[int, int]) -> None:
    """Commit `offsets` (partition -> next offset to read) for `group`, as an operator's
    offset reset would: the broker takes any offset, in its log or not."""
    consumer = confluent_kafka.Consumer(consumer_conf(bootstrap, group))
    try:
        tps = [TopicPartition(topic, p, offset) for p, offset in offsets.items()]
        for tp in consumer.commit(offsets=tps, asynchronous=False) or []:
            assert tp.error is None, tp
    finally:
        consumer.close()


def committed_offsets(
    bootstrap: str, group: str, topic: str, partitions: int = 4
) -> dict[int, int]:
    """The group's committed offsets (as Kafka reports them) per partition."""
    consumer = confluent_kafka.Consumer(consumer_conf(bootstrap, group))
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=30)
        return {tp.partition: tp.offset for tp in tps}
    finally:
        consumer.close()
