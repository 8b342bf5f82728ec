"""Metrics of a real `SinkService` (real broker client, real Lance table, real shard
writers) with `observability.partition_metrics = "topic"`."""

from __future__ import annotations

from pathlib import Path

import pytest

from sink.consumer.partition import PartitionState, Phase
from tests.integration.conftest import unstarted_service
from tests.support.brokers import Broker

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]

PARTITIONS = 8


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
            service.board.refresh_metrics()  # the loop's, once a second
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
