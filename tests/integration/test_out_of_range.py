"""What the sink does with a fetch offset the broker refused, given the partition's log
range (`sink.consumer.out_of_range.out_of_range_action`), in a real `SinkService` (real
broker client, real Lance table). The stop is exercised end to end in
`tests/e2e/test_offset_out_of_range.py`; no broker here deletes records (neither the mock
cluster nor tansu serves DeleteRecords), so the skip is driven from its log range."""

from __future__ import annotations

import time
from concurrent.futures import Future

import confluent_kafka
import pytest
import structlog

from sink.consumer.out_of_range import (
    OUT_OF_RANGE_GRACE_S,
    OUT_OF_RANGE_RETRY_S,
    out_of_range_action,
)
from sink.consumer.partition import Decoding, PartitionState, Phase
from sink.decode import Decoded
from sink.service import SinkService

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]


@pytest.mark.parametrize(
    ("offset", "action"),
    [(0, "skip"), (7, "skip"), (8, "retry"), (9, "retry"), (10, "retry"), (11, "stop")],
)
def test_the_action_follows_where_the_offset_lies_against_the_log(offset: int, action: str) -> None:
    assert out_of_range_action(offset, 8, 10) == action  # the log holds offsets 8-9


def skipped(service: SinkService, topic: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "lance_sink_offsets_skipped_total", {"topic": topic, "partition": "0"}
    )
    return value or 0.0


def test_offsets_deleted_before_they_were_read_are_skipped_counted_and_committed_past(
    service: SinkService, topic: str
) -> None:
    # Offsets 0-2 durable and committed, 3-4 consumed and still decoding; the broker then
    # refused 5: retention deleted 5-7 before the sink read them, the log holds 8-9.
    state = PartitionState(topic, 0, 3, phase=Phase.ACTIVE, position=5, done=3)
    decoding: Future[Decoded] = Future()
    state.decoding.append(Decoding([], decoding))
    service.partitions.add(state)
    with structlog.testing.capture_logs() as logs:
        service.out_of_range.resolve(state, 5, 8, 10)
    assert [(e["event"], e["offset"], e["skipped"]) for e in logs] == [
        ("offsets_deleted_before_read", 5, 3)
    ]
    assert skipped(service, topic) == 3
    assert state.position == 8
    assert state.stopped is None
    # Nothing of 5-7 can become durable: `done` steps over them, after 3-4.
    service.pipeline.collect_decoded()
    service.pipeline.advance()
    assert state.done == 3
    decoding.set_result(Decoded(None, [], [], 3, 4))  # 3-4 without rows (tombstones, say)
    service.pipeline.collect_decoded()
    service.pipeline.advance()
    assert state.done == 8
    assert not state.decoding
    assert not state.inflight


def test_an_offset_back_in_the_log_is_fetched_again_and_one_past_its_end_stops(
    service: SinkService, topic: str
) -> None:
    state = PartitionState(topic, 0, 5, phase=Phase.ACTIVE, position=5, done=5)
    service.partitions.add(state)
    service.out_of_range.resolve(state, 5, 0, 10)
    assert (state.position, state.done, state.stopped) == (5, 5, None)
    assert state.out_of_range_retry is not None
    assert state.out_of_range_retry[0] == 5  # fetched again a second later
    assert skipped(service, topic) == 0
    service.out_of_range.resolve(state, 5, 0, 3)
    # Refused for less than the grace: asked again later, not stopped (a broker that just
    # restarted may report its log end late).
    assert state.stopped is None
    assert state.out_of_range_retry is not None
    assert state.out_of_range_retry[0] == 5
    assert state.out_of_range_since is not None
    state.out_of_range_since -= OUT_OF_RANGE_GRACE_S
    service.out_of_range.resolve(state, 5, 0, 3)
    assert state.stopped == (
        "offset 5 is past the log end 3: the partition's log was truncated or its topic "
        "created again"
    )
    assert state.paused
    assert state.phase is Phase.STOPPED
    assert (
        service.metrics.registry.get_sample_value(
            "lance_sink_partition_stopped", {"topic": topic, "partition": "0"}
        )
        == 1
    )
    assert (state.position, state.done) == (5, 5)


def test_a_logical_start_the_broker_could_not_resolve_is_asked_for_again_after_a_while(
    service: SinkService, topic: str
) -> None:
    # Partition 0 started at its log start (`START_AT`, a logical offset) and the broker
    # refused to resolve it: no log range to look up, the same start is asked for again a
    # second later rather than at once (a refusal that stands would loop with the broker).
    state = PartitionState(topic, 0, -1, phase=Phase.ACTIVE)
    service.partitions.add(state)
    refused = confluent_kafka.KafkaError(confluent_kafka.KafkaError._AUTO_OFFSET_RESET)
    with structlog.testing.capture_logs() as logs:
        service.out_of_range.refused(topic, 0, confluent_kafka.OFFSET_BEGINNING, refused)
        service.out_of_range.refused(topic, 0, confluent_kafka.OFFSET_BEGINNING, refused)
    assert [e["event"] for e in logs] == ["offset_out_of_range"]  # once while it stands
    assert state.out_of_range is None  # nothing to look up
    assert state.out_of_range_retry is not None
    offset, at = state.out_of_range_retry
    assert offset == confluent_kafka.OFFSET_BEGINNING
    assert at - time.monotonic() > OUT_OF_RANGE_RETRY_S / 2
    state.out_of_range_retry = (offset, time.monotonic())  # the wait is over
    service.out_of_range.service()
    assert state.out_of_range_retry is None  # fetched again (from `position` once assigned)
