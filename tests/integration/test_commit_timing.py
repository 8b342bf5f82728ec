"""When the loop commits what became durable (`Commits.maybe_commit` after
`Pipeline.advance`, `Pipeline.wait_decoded`), in a real `SinkService` (real broker client,
real Lance table) whose partitions the tests set by hand: the commit delay (durable ->
committed) is the loop's own, not an interval's."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from engine.shard import PutResult
from sink.consumer.partition import Decoding, InFlight, PartitionState
from sink.decode import Decoded
from sink.service import SinkService
from tests.integration.conftest import unstarted_service
from tests.support.brokers import Broker
from tests.support.kafka import committed_offsets, produce

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]

# Long enough that a commit within the test can only be the one its offset asked for.
LONG_INTERVAL_MS = 60_000


@pytest.fixture
def rare_commits(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> Iterator[SinkService]:
    """A service that may commit once a minute."""
    service = unstarted_service(
        kafka_broker, topic, group, tmp_path, {"kafka": {"commit_interval_ms": LONG_INTERVAL_MS}}
    )
    try:
        yield service
    finally:
        service.drain()


def committed_at(bootstrap: str, group: str, topic: str, offset: int, within_s: float) -> bool:
    """Whether the group's committed offset of partition 0 reaches `offset` in time."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if committed_offsets(bootstrap, group, topic, partitions=1)[0] >= offset:
            return True
        time.sleep(0.2)
    return False


def partition_0(
    service: SinkService, bootstrap: str, topic: str, messages: int, done: int, committed: int
) -> PartitionState:
    """Partition 0 of `topic`, holding `messages` messages, set in `service` as read and
    durable up to `done` and committed up to `committed`."""
    produce(bootstrap, topic, [(None, b"{}")] * messages, partition=0)
    state = PartitionState(topic, 0, committed, position=done, done=done)
    service.partitions.add(state)
    return state


def loop_commits(service: SinkService) -> None:
    """What a loop iteration does about commits: advance `done`, then commit if due."""
    service.pipeline.advance()
    service.commits.maybe_commit(time.monotonic())


def test_an_offset_durable_after_a_quiet_interval_is_committed_at_once(
    rare_commits: SinkService, kafka_broker: Broker, topic: str, group: str
) -> None:
    service = rare_commits
    state = partition_0(service, kafka_broker.bootstrap, topic, 5, done=3, committed=3)
    loop_commits(service)  # nothing to commit: no commit was sent, so none holds the next back
    state.inflight.append(InFlight(4, None, 0, 0, None))  # offsets 3-4, durable
    loop_commits(service)
    assert state.done == 5
    assert committed_at(kafka_broker.bootstrap, group, topic, 5, within_s=15)


def test_a_commit_waits_the_interval_after_the_last_one_sent(
    rare_commits: SinkService, kafka_broker: Broker, topic: str, group: str
) -> None:
    service = rare_commits
    state = partition_0(service, kafka_broker.bootstrap, topic, 8, done=3, committed=0)
    loop_commits(service)  # commits 3
    assert committed_at(kafka_broker.bootstrap, group, topic, 3, within_s=15)
    state.inflight.append(InFlight(7, None, 0, 0, None))
    loop_commits(service)
    assert state.done == 8
    assert not committed_at(kafka_broker.bootstrap, group, topic, 8, within_s=2)


def test_waiting_for_decoding_ends_when_a_put_becomes_durable(
    service: SinkService, topic: str
) -> None:
    # The decode queue is full and the oldest batch still decoding; a put made earlier
    # becomes durable 0.1 s later: the loop goes on to commit it rather than wait for the
    # decoding (up to kafka.consume_timeout_ms).
    state = PartitionState(topic, 0, 3, position=10, done=3)
    state.decoding.append(Decoding([], Future[Decoded]()))
    put: Future[PutResult] = Future()
    state.inflight.append(InFlight(9, put, 7, 700, None))
    service.partitions.add(state)
    timer = threading.Timer(0.1, put.set_result, (PutResult(7, 7, time.monotonic()),))
    timer.start()
    started = time.monotonic()
    service.pipeline.wait_decoded(5.0)
    elapsed = time.monotonic() - started
    timer.join()
    assert elapsed < 2.0, f"waited {elapsed:.1f} s for the decoding"
    assert put.done()
