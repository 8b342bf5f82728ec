"""The partition state machine in a real `SinkService` (real broker client, real Lance
table, real shard writers): transitions whose consumer calls went wrong before the phases
were named."""

from __future__ import annotations

import time

import pytest

from engine.engine import Engine
from engine.errors import Fenced
from engine.shard_stats import ShardStats
from sink.consumer import partition
from sink.consumer.partition import Held, PartitionState, Phase
from sink.consumer.status import PUBLISH_IDLE_INTERVAL_S, PUBLISH_INTERVAL_S, PUBLISH_SHARE
from sink.decoded import Decoded
from sink.service import SinkService
from tests.support.brokers import Broker
from tests.support.engine import make_batch
from tests.support.kafka import produce

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]


def active(service: SinkService, topic: str) -> PartitionState:
    """Partition 0 of `topic` opened (its shard claimed) and assigned at offset 0."""
    state = PartitionState(topic, 0, -1, counts=service.pipeline.counts)
    service.partitions.add(state)
    partition.opened(state, service.engine.open_shard(topic, 0), 0)
    service.flow.assign_all([(state, 0)])
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


def test_a_phase_change_is_published_by_the_tick_that_made_it(
    service: SinkService, kafka_broker: Broker, topic: str
) -> None:
    # The loop logs a stop (or a fence) inside its tick; whoever reads that line and asks
    # /readyz at once must find it there. The views used to be published at the start of
    # the next tick, at most every 20 ms: a stop logged just after a publish was missing.
    produce(kafka_broker.bootstrap, topic, [(None, b"{}")], partition=0)
    state = active(service, topic)
    service.board.publish()
    stopped = f"{topic}[0]: stopped, offset 50 is past the log end 10"
    assert stopped not in service.board.readiness()[1]
    partition.stop(state, "offset 50 is past the log end 10")
    service.board.ticked(time.monotonic())  # the same tick, well within 20 ms
    ready, reasons = service.board.readiness()
    assert not ready
    assert stopped in reasons


def test_a_commit_publishes_the_views_before_it_is_sent(
    service: SinkService, kafka_broker: Broker, topic: str
) -> None:
    # Whoever sees an offset committed (the group's offsets, `lance-sink lag`) and then
    # scrapes must not read a lag in seconds from before that commit: 17 s once on CI,
    # right after the group's committed offset reached the log end.
    produce(kafka_broker.bootstrap, topic, [(None, b"{}")] * 3, partition=0)
    state = active(service, topic)
    state.rewind_to(0, int(time.time() * 1000) - 17_000)  # consumed, not durable, 17 s old
    service.board.publish()
    view = service.board.views[0]
    assert service.board.partition_offsets(view).lag_seconds() > 16
    state.done = 3  # durable, as the pipeline's advance moves it
    assert service.commits.commit(asynchronous=False)
    assert state.committed == 3
    view = service.board.views[0]
    assert view.pending_timestamp_ms is None
    assert service.board.partition_offsets(view).lag_seconds() == 0.0


def test_a_quiet_loop_publishes_the_views_less_often(
    service: SinkService, kafka_broker: Broker, topic: str
) -> None:
    # A view per partition every 20 ms was a quarter of an idle loop's CPU at 1,024
    # partitions (issue #39): with no row made durable for PUBLISH_BUSY_S, the views are
    # published every PUBLISH_IDLE_INTERVAL_S; while rows flow, every 20 ms as before.
    active(service, topic)
    board = service.board
    board.publish()
    start = board.published_at
    board.ticked(start)  # the first tick sees the row count: counted as rows moving
    views = board.views
    board.ticked(start + PUBLISH_IDLE_INTERVAL_S / 2)  # quiet, not yet for the interval
    assert board.views is views
    board.ticked(start + PUBLISH_IDLE_INTERVAL_S + 0.05)
    assert board.views is not views
    views, start = board.views, board.published_at
    service.metrics.rows_total += 1  # a row became durable
    board.ticked(start + 0.03)
    assert board.views is not views


def test_rows_flowing_through_many_partitions_publish_as_their_cost_allows(
    service: SinkService, kafka_broker: Broker, topic: str
) -> None:
    # A view per held partition every 20 ms while rows flow: at 1,024 partitions each
    # publish took 2.4-5.6 ms, 12-28% of a core. The interval grows with the publish's
    # cost, so publishing takes at most PUBLISH_SHARE of the loop's time.
    active(service, topic)
    board = service.board
    board.publish()
    start = board.published_at
    service.metrics.rows_total += 1  # rows flow
    board.publish_cost_s = 0.0  # a cheap publish: every PUBLISH_INTERVAL_S
    views = board.views
    board.ticked(start + PUBLISH_INTERVAL_S + 0.001)
    assert board.views is not views
    start, views = board.published_at, board.views
    board.publish_cost_s = 0.005  # as a thousand partitions' views cost
    service.metrics.rows_total += 1
    board.ticked(start + 2 * PUBLISH_INTERVAL_S)
    assert board.views is views  # not yet: 5 ms / PUBLISH_SHARE = 100 ms
    service.metrics.rows_total += 1
    board.ticked(start + 0.005 / PUBLISH_SHARE + 0.001)
    assert board.views is not views


def test_an_assigned_service_is_ready_before_librdkafkas_first_statistics(
    service: SinkService, kafka_broker: Broker, topic: str
) -> None:
    # The statistics come every observability.kafka_statistics_interval_ms (5 s by
    # default), the first one interval after the consumer starts; until then the group's
    # assignment stands for a reachable broker. Readiness used to wait for them.
    assert service.settings.observability.kafka_statistics_interval_ms == 5_000  # the default
    produce(kafka_broker.bootstrap, topic, [(None, b"{}")], partition=0)
    active(service, topic)
    service.lifecycle.ready.set()  # the group's first assignment was taken
    service.board.publish()
    assert service.broker.received_at == 0.0  # no statistics yet
    assert service.board.readiness() == (True, [])


def test_a_status_document_reads_each_writers_statistics_once(
    service: SinkService, kafka_broker: Broker, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A partition's offsets and its memtable and flush figures come from one read of its
    # writer's statistics, so they agree; two reads per partition were a third of a
    # status call's time at 1,024 partitions (~100 ms a call).
    produce(kafka_broker.bootstrap, topic, [(None, b"{}")], partition=0)
    state = active(service, topic)
    writer = state.writer
    assert writer is not None
    reads = []
    stats = writer.stats

    def counted() -> ShardStats:
        reads.append(1)
        return stats()

    monkeypatch.setattr(writer, "stats", counted)
    service.board.publish()
    entry = service.board.status()["partitions"][0]
    assert len(reads) == 1
    assert (entry["shard"], entry["flush"]["position"]) == (writer.shard, stats().flushed_position)
