"""Commits: each partition's `done` offset to the group, the commit protocol's last step.

Data path step 7 in DESIGN.md: the loop commits `done` (asynchronously as soon as it
moves, at most every `kafka.commit_interval_ms` counted from the last commit sent;
synchronously on revoke and at the drain). `done` only moves over durable offsets (the
pipeline's `advance`), and over offsets librdkafka never hands out, once the partition is
idle (`skip_records_without_data`, at most every `SKIP_INTERVAL_S` on the loop's own
commits), so a commit never covers a row that is not durable
(I1). librdkafka reports asynchronous commits in `on_commit`, inside consume() on the loop
thread; the commit latency (durable -> committed) is measured from `durable_at`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Final

import confluent_kafka
import structlog
from confluent_kafka import TopicPartition

from sink.consumer.partition import PartitionState, PartitionTable, Phase
from sink.metrics import Metrics

log = structlog.get_logger("lance_sink.sink")

#: How often an asynchronous commit first steps every idle partition's `done` past offsets
#: without data (`skip_records_without_data`): a pass over every partition at each commit
#: (every 5 ms) was the idle loop's largest cost at 1,024 partitions (measured); the log
#: ends it compares with come from the statistics (every `kafka_statistics_interval_ms`)
#: anyway. Revoke and the drain step their partitions at every commit.
SKIP_INTERVAL_S: Final = 0.2


class Commits:
    """Commits `done` offsets (see the module docstring)."""

    def __init__(
        self,
        consumer: confluent_kafka.Consumer,
        partitions: PartitionTable,
        metrics: Metrics,
        *,
        interval_s: float,
        end_offset: Callable[[tuple[str, int]], int | None],
        before_send: Callable[[], None],
    ) -> None:
        self.consumer = consumer
        self.partitions = partitions
        self.metrics = metrics
        self.interval_s = interval_s
        self.end_offset = end_offset  # the log end from the last statistics, if known
        # Publishes the status views: whoever sees an offset committed (the group, a lag
        # probe) then reads views at least as new as the `done` it committed (I14).
        self.before_send = before_send
        self.last_sent = 0.0
        self._skipped_at = 0.0  # the last `skip_records_without_data` of every partition

    def maybe_commit(self, now: float) -> None:
        """Commit asynchronously if the interval since the last commit sent has passed: an
        offset that becomes durable later than that is committed at once, not at the next
        multiple of the interval."""
        if now - self.last_sent >= self.interval_s and self.commit(asynchronous=True):
            self.last_sent = now

    def commit(self, *, asynchronous: bool, states: Sequence[PartitionState] | None = None) -> bool:
        """Commit each partition's `done` offset:

        1. Step `done` past offsets that carry no data (`skip_records_without_data`).
        2. Commit every partition whose `done` is past its committed offset and that no
           newer writer fenced; a synchronous commit records the result at once, an
           asynchronous one in `on_commit`.

        Returns:
            Whether a commit was sent, or tried and refused by the client (nothing is sent
            when no `done` moved).
        """
        if states is not None:
            self.skip_records_without_data(states)
        else:
            states = self.partitions.states()
            now = time.monotonic()
            if now - self._skipped_at >= SKIP_INTERVAL_S:
                self._skipped_at = now
                self.skip_records_without_data(states)
        targets = [
            s for s in states if s.done is not None and s.done > s.committed and not s.fenced
        ]
        if not targets:
            return False
        offsets = [TopicPartition(s.topic, s.partition, s.done or 0) for s in targets]
        self.before_send()
        try:
            if asynchronous:
                self.consumer.commit(offsets=offsets, asynchronous=True)
                return True
            result = self.consumer.commit(offsets=offsets, asynchronous=False)
        except confluent_kafka.KafkaException as exc:
            self.metrics.commit_failed()
            log.warning("commit_failed", error=str(exc), partitions=len(offsets))
            return True
        for tp in result or []:
            self.committed(tp)
        return True

    def skip_records_without_data(self, states: Sequence[PartitionState]) -> None:
        """Move `done` (and `position`) of idle partitions up to the consumer's position.

        librdkafka never hands out a transaction's commit or abort marker (a control record)
        nor, with `isolation.level=read_committed`, an aborted transaction's messages, but
        its consumer position moves past them as it reads them. Without this step a
        partition that ends in a commit marker would keep a commit lag of 1 for good.

        A partition is idle when it is ACTIVE (a healthy writer, fetched unless the drain
        paused it), assigned, and settled (`PartitionState.settled`: everything it
        consumed durable or acknowledged by the dead-letter topic, nothing parked,
        decoding, held or in flight). Every message librdkafka delivered since the
        partition was last assigned or sought then went through the pipeline and moved
        `position`: only a partition that does not feed drops messages, and it is sought
        back to `position` (`Consumer.seek` returns once librdkafka has reset its position)
        or unassigned and assigned again at its resume offset before it takes messages
        again. So the offsets between `position` and the consumer's position carry no data:
        `done` may pass them, and I1 holds. Partitions whose log end (from the statistics)
        is not past `done` are not asked about: nothing is left to skip there.
        """
        idle = []
        for s in states:
            if s.phase is not Phase.ACTIVE or not s.assigned or not s.settled:
                continue
            end = self.end_offset(s.key)
            if end is not None and s.done is not None and end <= s.done:
                continue
            idle.append(s)
        if not idle:
            return
        try:
            positions = self.consumer.position([s.tp for s in idle])
        except confluent_kafka.KafkaException as exc:
            log.warning("position_lookup_failed", error=str(exc), partitions=len(idle))
            return
        for state, tp in zip(idle, positions, strict=True):
            if tp.error is not None or tp.offset < 0:
                continue
            if state.done is None or tp.offset > state.done:
                state.position = state.done = tp.offset

    def on_commit(
        self, err: confluent_kafka.KafkaError | None, partitions: list[TopicPartition]
    ) -> None:
        """librdkafka's commit result callback (inside consume(), on the loop thread)."""
        if err is not None:
            self.metrics.commit_failed()
            log.warning("commit_failed", error=str(err))
            return
        for tp in partitions:
            if tp.error is None:
                self.committed(tp)
            else:
                self.metrics.commit_failed()
                log.warning(
                    "commit_failed", topic=tp.topic, partition=tp.partition, error=str(tp.error)
                )

    def committed(self, tp: TopicPartition) -> None:
        """The group holds `tp.offset` for the partition: record it and how long its rows
        waited since they became durable."""
        state = self.partitions.get((tp.topic, tp.partition))
        if state is None or tp.offset < 0:
            return
        state.committed = max(state.committed, tp.offset)
        now = time.monotonic()
        wall = time.time()
        while state.durable_at and state.durable_at[0][0] <= tp.offset:
            _, durable_since, timestamp_ms = state.durable_at.popleft()
            self.metrics.committed(now - durable_since)
            if timestamp_ms is not None:
                self.metrics.stage_reached("committed", wall - timestamp_ms / 1000)
