"""The partition state machine in a real `SinkService` (real broker client, real Lance
table, real shard writers): transitions whose consumer calls went wrong before the phases
were named."""

from __future__ import annotations

import time

import pytest

from engine.engine import Engine
from engine.errors import Fenced
from sink.consumer import partition
from sink.consumer.partition import Held, PartitionState, Phase
from sink.decoded import Decoded
from sink.service import SinkService
from tests.support.brokers import Broker
from tests.support.engine import make_batch
from tests.support.kafka import produce

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]


def active(service: SinkService, topic: str) -> PartitionState:
    """Partition 0 of `topic` opened (its shard claimed) and assigned at offset 0."""
    state = PartitionState(topic, 0, -1)
    service.partitions.add(state)
    partition.opened(state, service.engine.open_shard(topic, 0), 0)
    service.flow.assign_at(state, 0)
    return state


def test_a_held_batch_whose_writer_is_fenced_leaves_the_partition_fenced_and_paused(
    service: SinkService, kafka_broker: Broker, topic: str
) -> None:
    # A held batch is put once its partition may take it: when the writer turns out to
    # be fenced by then, the partition waits, paused, to be revoked. It used to be resumed
    # (fetched again by a process that no longer owns its shard).
    produce(kafka_broker.bootstrap, topic, [(None, b"{}")] * 3, partition=0)
    state = active(service, topic)
    writer = state.writer
    assert writer is not None
    batch = make_batch(service.engine.spec, 0, 3, topic=topic)
    partition.hold(state, Held(Decoded(batch, [], [], 0, 2), []))
    service.flow.pause(state)
    other = Engine.from_settings(service.settings)  # another pod's writer claims the shard
    newer = other.open_shard(topic, 0)
    try:
        deadline = time.monotonic() + 30
        while not isinstance(writer.poisoned, Fenced):  # the writer's own fence probe
            assert time.monotonic() < deadline, "the writer never learned of the fence"
            time.sleep(0.05)
        service.pipeline.service_held()
        assert state.phase is Phase.FENCED
        assert state.paused
        assert state.held is None
        assert state.writer is None
        assert (state.position, state.done) == (0, 0)
        service.board.publish()
        _, reasons = service.board.readiness()
        assert f"{topic}[0]: fenced by a newer writer" in reasons
    finally:
        other.close_shard(newer, flush=False, timeout=5)
        other.close(flush=False, timeout=5)


def test_a_released_partition_leaves_no_end_offset_behind(
    service: SinkService, kafka_broker: Broker, topic: str
) -> None:
    produce(kafka_broker.bootstrap, topic, [(None, b"{}")] * 3, partition=0)
    state = active(service, topic)
    service.broker.end_offsets[(topic, 0)] = 3  # from the statistics while it was held
    service.lifecycle.release(state, flush=False)
    assert state.phase is Phase.RELEASED
    assert service.broker.end((topic, 0)) is None
    assert (topic, 0) not in service.partitions
