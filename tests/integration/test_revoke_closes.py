"""A revoke in a real `SinkService` (real broker client, real Lance table, real shard
writers): the group waits on the revoke callback before it hands the partitions on, so
its writers are closed at once, not one after another."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import TopicPartition

from engine.shard import ShardWriter
from sink.consumer import partition
from sink.consumer.partition import PartitionState, Phase
from sink.service import SinkService
from tests.support.brokers import Broker

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]

#: Each writer's close is slowed to this.
CLOSE_DELAY_S = 0.5
#: Partitions revoked at once (their shards need no partition in the broker).
REVOKED = 8


def test_a_revoke_closes_its_writers_at_once(
    service: SinkService, kafka_broker: Broker, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = []
    for p in range(REVOKED):
        state = PartitionState(topic, p, -1, counts=service.pipeline.counts)
        service.partitions.add(state)
        partition.opened(state, service.engine.open_shard(topic, p), None)
        states.append(state)
    close = service.engine.close_shard

    def slow_close(writer: ShardWriter, *, flush: bool, timeout: float, **kwargs: bool) -> None:
        time.sleep(CLOSE_DELAY_S)
        close(writer, flush=flush, timeout=timeout, **kwargs)

    monkeypatch.setattr(service.engine, "close_shard", slow_close)
    started = time.monotonic()
    service.lifecycle.revoke([TopicPartition(topic, p) for p in range(REVOKED)], settle=service)
    took = time.monotonic() - started
    assert all(s.phase is Phase.RELEASED for s in states)
    assert not service.engine.writers()  # every writer closed before the callback returned
    assert took < 2 * CLOSE_DELAY_S, f"{REVOKED} closes of {CLOSE_DELAY_S} s took {took:.1f} s"
