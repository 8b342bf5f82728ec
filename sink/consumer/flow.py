"""Flow: the only code that tells the consumer to fetch a partition or not.

Pause, resume, seek, assign and unassign all go through `Flow`, which keeps each
partition's record of what the consumer was last told (`PartitionState.assigned` and
`.paused`) true: nothing else writes them. The loop thread calls it (rebalance callbacks
run on it too); a consumer call that raises is logged and reported, never fatal.

librdkafka rules it follows:
- An assignment starts unpaused, and a partition paused before it was taken out of the
  assignment may keep its pause: `assign_all` resumes what it assigns.
- A partition whose fetch offset the broker refused is in an "erroneous state" that
  refuses seeks: `refetch` takes it out of the assignment and puts it back at the offset.
- A rebalance callback that assigns nothing would have the client assign every
  partition: `assign_none` assigns an empty list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import confluent_kafka
import structlog
from confluent_kafka import TopicPartition

from sink.consumer.partition import PartitionState

log = structlog.get_logger("lance_sink.sink")


class PauseEvents(Protocol):
    """The metrics facade's part: whether a partition is paused."""

    def partition_paused(self, topic: str, partition: int, paused: bool) -> None: ...


class Flow:
    """The consumer's fetching of each partition (see the module docstring)."""

    def __init__(self, consumer: confluent_kafka.Consumer, events: PauseEvents) -> None:
        self.consumer = consumer
        self.events = events

    def pause(self, state: PartitionState) -> None:
        """Stop fetching the partition (if it is not paused already); `resume` undoes it."""
        if state.paused:
            return
        self.consumer.pause([state.tp])
        state.paused = True
        self.events.partition_paused(state.topic, state.partition, True)
        state.log.info("partition_paused")

    def resume(self, state: PartitionState) -> None:
        """Fetch the partition again from its `position` (messages fetched while it was
        paused were dropped)."""
        if state.position is not None:
            self.consumer.seek(TopicPartition(state.topic, state.partition, state.position))
        self.consumer.resume([state.tp])
        state.paused = False
        self.events.partition_paused(state.topic, state.partition, False)
        state.log.info(
            "partition_resumed",
            position=state.position,
        )

    def pause_all(self, states: Sequence[PartitionState]) -> None:
        """Stop fetching every partition in one call (the drain)."""
        if not states:
            return
        try:
            self.consumer.pause([s.tp for s in states])
        except confluent_kafka.KafkaException as exc:
            log.warning("pause_failed", error=str(exc))
            return
        for state in states:
            state.paused = True

    def assign_all(self, starts: Sequence[tuple[PartitionState, int]]) -> None:
        """Hand the partitions to the consumer in one call, each fetching from its offset
        (a logical offset such as OFFSET_BEGINNING too), unpaused (a tick hands over every
        partition whose open ended: one request to librdkafka's main thread for all of
        them, not one each)."""
        if not starts:
            return
        self.consumer.incremental_assign(
            [TopicPartition(s.topic, s.partition, offset) for s, offset in starts]
        )
        self.consumer.resume([s.tp for s, _ in starts])
        for state, _ in starts:
            state.assigned = True
            state.paused = False

    def unassign(self, state: PartitionState) -> None:
        """Take the partition out of the consumer's assignment (nothing is fetched until
        `assign_all`); a refusal is logged."""
        if not state.assigned:
            return
        try:
            self.consumer.incremental_unassign([state.tp])
        except confluent_kafka.KafkaException as exc:
            state.log.warning("unassign_failed", error=str(exc))
        state.assigned = False

    def refetch(self, state: PartitionState, offset: int) -> bool:
        """Fetch the partition from `offset` again after the broker refused an offset
        (unassigned and assigned again at it, paused again if it was). False: the
        consumer refused, to be tried again later. A partition not assigned or without a
        writer is left alone: it is fetched from `position` when assigned again."""
        if not state.assigned or state.writer is None:
            return True
        tp = TopicPartition(state.topic, state.partition)
        try:
            self.consumer.incremental_unassign([tp])
            tp.offset = offset
            self.consumer.incremental_assign([tp])
            if state.paused:
                self.consumer.pause([tp])  # an assignment starts unpaused
        except confluent_kafka.KafkaException as exc:
            state.log.warning(
                "fetch_restart_failed",
                offset=offset,
                error=str(exc),
            )
            return False
        return True

    def assign_none(self) -> None:
        """Answer a rebalance callback without handing anything to the consumer yet."""
        self.consumer.incremental_assign([])

    def accept_unopened(self, partitions: list[TopicPartition]) -> None:
        """Take an assignment without opening its shards (draining): the group takes the
        partitions back when the consumer closes."""
        self.consumer.incremental_assign(partitions)

    def give_back(self, partitions: list[TopicPartition], states: Sequence[PartitionState]) -> None:
        """Take revoked or lost `partitions` out of the consumer's assignment: those it
        holds (a partition whose shard has not opened, yet or again, was never handed to
        it, or was taken back)."""
        unassigned = {s.key for s in states if not s.assigned}
        self.consumer.incremental_unassign(
            [tp for tp in partitions if (tp.topic, tp.partition) not in unassigned]
        )
        for state in states:
            state.assigned = state.paused = False
