"""What the consumer loop's once-a-second metrics refresh costs with nothing flowing, in a
real `SinkService` (real broker client, real Lance table, real shard writers): issue #39
measured a pass over every shard writer's statistics there, 5% of a core at 1,024
partitions, for gauges only a scrape reads."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.shard_stats import ShardStats
from sink.consumer.partition import PartitionState, Phase
from sink.service import QUIET_CONSUME_TIMEOUT_S, SinkService
from tests.integration.conftest import unstarted_service
from tests.support.brokers import Broker
from tests.support.kafka import produce
from tests.support.sink import messages

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]

PARTITIONS = 8


def test_the_loop_refresh_reads_no_writer_and_a_scrape_sets_every_shard_gauge(
    service: SinkService, topic: str
) -> None:
    reads: list[str] = []
    for p in range(PARTITIONS):
        writer = service.engine.open_shard(topic, p)
        stats = writer.stats

        def counted(
            stats: Callable[[], ShardStats] = stats, shard: str = writer.shard
        ) -> ShardStats:
            reads.append(shard)
            return stats()

        writer.stats = counted  # type: ignore[method-assign]
        state = PartitionState(topic, p, 0, phase=Phase.ACTIVE, position=0, done=0)
        state.shard, state.writer = writer.shard, writer
        service.partitions.add(state)
    service.board.publish()
    for _ in range(3):
        service.board.refresh_metrics()
    assert reads == []  # the loop's refresh: no pass over the writers

    text = service.board.exposition().decode()
    assert len(set(reads)) == PARTITIONS  # the scrape read each writer once
    for name in ("wal_unflushed_bytes", "memtable_bytes", "wal_sealed_memtables"):
        shards = re.findall(rf'^lance_sink_{name}{{shard="([^"]+)"}}', text, re.MULTILINE)
        assert len(shards) == PARTITIONS, name
    held = re.findall(r"^lance_sink_dlq_held_seconds\{", text, re.MULTILINE)
    assert len(held) == PARTITIONS


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
            service.board.publish()
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


def test_a_quiet_loop_ticks_ten_times_a_second_and_a_message_ends_the_wait(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """The running loop, caught up with nothing to consume: it ticks (a pass over every
    partition) about 1 / QUIET_CONSUME_TIMEOUT_S times a second, 40 before issue #39's
    second round; a message produced then is durable at once, not after the wait."""
    produce(kafka_broker.bootstrap, topic, messages(0, 10))
    service = unstarted_service(kafka_broker, topic, group, tmp_path)
    ticks: list[float] = []
    tick = service._tick

    def counted() -> None:
        ticks.append(time.monotonic())
        tick()

    service._tick = counted  # type: ignore[method-assign]
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while service.metrics.rows_total < 10 or not service._quiet:
            assert time.monotonic() < deadline, service.metrics.rows_total
            time.sleep(0.05)
        time.sleep(0.5)
        start = time.monotonic()
        time.sleep(2.0)
        rate = sum(1 for t in ticks if t >= start) / (time.monotonic() - start)
        assert rate <= 15, rate  # 1 / QUIET_CONSUME_TIMEOUT_S = 10, and slack
        assert 1 / QUIET_CONSUME_TIMEOUT_S <= 10
        produced = time.monotonic()
        produce(kafka_broker.bootstrap, topic, messages(10, 1))
        while service.metrics.rows_total < 11:
            assert time.monotonic() < deadline, service.metrics.rows_total
            time.sleep(0.005)
        assert time.monotonic() - produced < 2.0
    finally:
        service.stop()
        thread.join(timeout=60)
    assert not thread.is_alive()
