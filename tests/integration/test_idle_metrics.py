"""What the consumer loop's once-a-second metrics refresh costs with nothing flowing, in a
real `SinkService` (real broker client, real Lance table, real shard writers): issue #39
measured a pass over every shard writer's statistics there, 5% of a core at 1,024
partitions, for gauges only a scrape reads."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.shard_stats import ShardStats
from sink.consumer.partition import PartitionState, Phase
from sink.service import SinkService
from tests.integration.conftest import unstarted_service
from tests.support.brokers import Broker

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]

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

