"""Skipped truncates of a Debezium change stream are counted by the consumer loop as it
feeds their batch (``lance_sink_cdc_truncates_total``), in a real `SinkService` (real
broker client, real Lance table); `tests/e2e/test_cdc.py` reads the counter of a running
sink."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from sink.consumer.partition import Decoding, PartitionState, Phase
from sink.decode import Decoded
from sink.service import SinkService

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]


def truncates(service: SinkService, topic: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "lance_sink_cdc_truncates_total", {"topic": topic}
    )
    return value or 0.0


def test_skipped_truncates_are_counted_when_their_batch_is_fed(
    service: SinkService, topic: str
) -> None:
    state = PartitionState(topic, 0, 0, phase=Phase.ACTIVE, position=4, done=0)
    service.partitions.add(state)
    for first, last, skipped, count in [(0, 1, [0, 1], 1), (2, 3, [2, 3], 0)]:
        decoded: Future[Decoded] = Future()
        # Offsets without rows: a truncate and a tombstone, then two tombstones.
        decoded.set_result(Decoded(None, [], skipped, first, last, truncates=count))
        state.decoding.append(Decoding([], decoded))
    service.pipeline.collect_decoded()
    service.pipeline.advance()
    assert truncates(service, topic) == 1
    assert state.done == 4
