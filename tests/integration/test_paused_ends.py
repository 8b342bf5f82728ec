"""`PausedEnds` on real brokers: the end offset of a partition the sink has paused keeps
moving (its own probe fetches it), on the mock cluster and on tansu (whose ListOffsets
answers are not the end: the probe starts there and takes the end from fetches)."""

from __future__ import annotations

import time

import pytest

from sink.lag import PausedEnds
from tests.support.brokers import Broker
from tests.support.kafka import produce

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]


@pytest.fixture(params=["mock_broker", "tansu_broker"])
def any_broker(request: pytest.FixtureRequest) -> Broker:
    broker: Broker = request.getfixturevalue(request.param)
    return broker


def wait_end(ends: PausedEnds, key: tuple[str, int], want: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (got := ends.end(key)) != want:
        assert time.monotonic() < deadline, f"end offset {got}, expected {want}"
        time.sleep(0.05)


def test_paused_partitions_end_offsets_keep_moving(any_broker: Broker, topic: str) -> None:
    batch = [(f"k{i}".encode(), b"v" * 100) for i in range(10)]
    produce(any_broker.bootstrap, topic, batch, partition=0)
    produce(any_broker.bootstrap, topic, batch[:3], partition=1)
    ends = PausedEnds({"bootstrap.servers": any_broker.bootstrap}, after_s=0.5)
    try:
        p0, p1 = (topic, 0), (topic, 1)
        ends.track([p0])
        assert ends.end(p0) == -1  # not paused for `after_s` yet
        wait_end(ends, p0, 10)
        # Produced while paused: the end moves, several batches at a time.
        for _ in range(3):
            produce(any_broker.bootstrap, topic, batch, partition=0)
        wait_end(ends, p0, 40)
        ends.track([p0, p1])  # another partition paused
        wait_end(ends, p1, 3)
        ends.track([p1])  # p0 resumed: its figure is the sink consumer's again
        assert ends.end(p0) == -1
        produce(any_broker.bootstrap, topic, batch, partition=1)
        wait_end(ends, p1, 13)
    finally:
        ends.close()
