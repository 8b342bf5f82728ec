"""Metrics and the idle loop of a real `SinkService` (real broker client, real Lance
table, real shard writers): `observability.partition_metrics = "topic"`, and what an idle
loop and a scrape cost (issue #39)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from sink.consumer.partition import PartitionState, Phase
from sink.service import SinkService
from tests.integration.conftest import unstarted_service
from tests.support.brokers import Broker
from tests.support.kafka import produce
from tests.support.sink import messages

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]

PARTITIONS = 8
IDLE_PARTITIONS = 32


def test_partition_metrics_by_topic_reach_the_exposition(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """`observability.partition_metrics = "topic"`: a running service's scrape has one
    series per topic for every per-partition and per-shard metric, whatever the partitions
    (real shard writers, so the shards' series come from engine events too)."""
    service = unstarted_service(
        kafka_broker, topic, group, tmp_path, {"observability": {"partition_metrics": "topic"}}
    )
    try:
        counts = []
        for p in range(PARTITIONS):
            writer = service.engine.open_shard(topic, p)
            state = PartitionState(topic, p, 0, phase=Phase.ACTIVE, position=0, done=0)
            state.shard, state.writer = writer.shard, writer
            service.partitions.add(state)
            service.board.refresh_metrics(time.monotonic())  # the loop's, once a second
            text = service.board.exposition().decode()
            counts.append(sum(1 for line in text.splitlines() if not line.startswith("#")))
            assert 'partition="' not in text
            assert 'shard="' not in text
        assert len(set(counts)) == 1, counts
        get = service.metrics.registry.get_sample_value
        assert get("lance_sink_wal_unflushed_bytes", {"topic": topic}) == 0
        assert get("lance_sink_partition_paused", {"topic": topic}) == 0
        assert get("lance_sink_replay_seconds", {"topic": topic}) is not None
    finally:
        service.drain()


class CountedConsume:
    """The consumer as the loop's consume() calls reach it: when each returned."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer
        self.returned: list[float] = []

    def consume(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._consumer.consume(*args, **kwargs)
        finally:
            self.returned.append(time.monotonic())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


@contextmanager
def running_idle(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> Iterator[tuple[SinkService, CountedConsume, list[float]]]:
    """A running service on a topic of IDLE_PARTITIONS partitions (tansu: the mock
    cluster answers no CreateTopics), caught up with 10 messages and quiet: the service,
    its loop's consume() calls, and its ticks."""
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})
    for future in admin.create_topics([NewTopic(topic, IDLE_PARTITIONS)]).values():
        future.result(30)
    produce(kafka_broker.bootstrap, topic, messages(0, 10))
    service = unstarted_service(kafka_broker, topic, group, tmp_path)
    counted = CountedConsume(service.consumer)
    service.consumer = counted  # type: ignore[assignment]
    if hasattr(service, "lease"):
        service.lease.consumer = counted
    ticks: list[float] = []
    tick = service._tick

    def ticked() -> None:
        ticks.append(time.monotonic())
        tick()

    service._tick = ticked  # type: ignore[method-assign]
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while service.metrics.rows_total < 10 or not service._quiet:
            assert time.monotonic() < deadline, service.metrics.rows_total
            time.sleep(0.05)
        time.sleep(0.5)
        yield service, counted, ticks
    finally:
        service.stop()
        thread.join(timeout=60)
    assert not thread.is_alive()


def test_a_scrape_waits_for_one_consume_call_whatever_the_partitions(
    tansu_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """A scrape reads the consumer's cached end offset of every partition: in one pass
    between two of the loop's consume() calls (`sink.consumer.lease`), not one call per
    gap between them (which made it wait through a consume() call per partition, and a
    quiet loop's fewer gaps starved it)."""
    with running_idle(tansu_broker, topic, group, tmp_path) as (service, counted, _):
        for _ in range(5):
            started = time.monotonic()
            text = service.board.exposition().decode()
            ended = time.monotonic()
            waited = sum(1 for t in counted.returned if started <= t <= ended)
            assert waited <= 2, (waited, IDLE_PARTITIONS)
            assert text.count("lance_sink_commit_lag_messages{") == IDLE_PARTITIONS
        # /v1/status reads them the same way.
        started = time.monotonic()
        status = service.board.status()
        ended = time.monotonic()
        assert len(status["partitions"]) == IDLE_PARTITIONS
        assert sum(1 for t in counted.returned if started <= t <= ended) <= 2


def test_a_quiet_loop_ticks_a_few_times_a_second_and_a_message_ends_the_wait(
    tansu_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """Caught up with nothing to consume, the loop passes over every partition (a tick)
    about once a second (QUIET_TICK_INTERVAL_S), not at every consume() wait (40 a
    second before issue #39, then 4: a third of the idle loop's CPU at 1,024
    partitions); a message produced then is durable at once, not after the wait."""
    with running_idle(tansu_broker, topic, group, tmp_path) as (service, _, ticks):
        start = time.monotonic()
        time.sleep(3.0)
        seconds = time.monotonic() - start
        count = sum(1 for t in ticks if t >= start)
        assert count <= 1.5 * seconds, count
        produced = time.monotonic()
        produce(tansu_broker.bootstrap, topic, messages(10, 1))
        while service.metrics.rows_total < 11:
            assert time.monotonic() - produced < 30, service.metrics.rows_total
            time.sleep(0.005)
        assert time.monotonic() - produced < 2.0
