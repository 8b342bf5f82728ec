"""Lifecycle: a partition from its assignment to its release.

- **assign** (`on_assign`, inside consume() on the loop thread): a `PartitionState` in
  OPENING per partition, its shard claimed and replayed on the open pool (a replay from
  object storage can take minutes: the loop keeps serving its other partitions). Nothing
  is handed to the consumer yet.
- **open** (`service`, every loop iteration): an open that ended installs its writer
  (OPENING/RECOVERING -> ACTIVE) and hands the partition to the consumer at its resume
  offset: max(committed offset, durable offset + 1), I3; one that failed is retried with
  a doubling backoff (RECOVERING), never fatal: a cause that goes away (a store outage, a
  bug in reading a table version) must not become a crash loop.
- **writer failed** (`writer_failed`): a poisoned writer is closed, the partition taken
  out of the consumer's assignment and its shard reopened (RECOVERING); a fenced one waits
  to lose the partition to its new owner (FENCED).
- **revoke** (`on_revoke`): let in-flight puts finish (bounded), commit synchronously,
  close the writer leaving its WAL to the next owner (who replays it). **lost**
  (`on_lost`): close without committing. Both release the state (RELEASED), with every
  metric series of the partition and its shard.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final, Protocol

import confluent_kafka
import structlog
from confluent_kafka import TopicPartition

from config.settings import Settings
from engine.engine import Engine
from engine.errors import Fenced
from engine.shard import ShardWriter
from engine.threads import name_os_thread
from sink.consumer import partition
from sink.consumer.flow import Flow
from sink.consumer.partition import (
    Opened,
    PartitionCounts,
    PartitionState,
    PartitionTable,
    Phase,
)
from sink.consumer.pipeline import RECOVERY_BACKOFF_MAX_S, backoff
from sink.metrics import Metrics

log = structlog.get_logger("lance_sink.sink")

# Where a partition with neither a committed offset nor WAL state starts
# (`kafka.auto_offset_reset`): the sink assigns it there itself, as librdkafka's own
# auto.offset.reset is "error" (see `sink.consumer.out_of_range`).
START_AT: Final = {
    "earliest": confluent_kafka.OFFSET_BEGINNING,
    "latest": confluent_kafka.OFFSET_END,
}
# Committed-offset look-ups on assign (a broker round trip; bounded by the drain deadline
# while stopping).
COMMITTED_TIMEOUT_S: Final = 30.0
#: Longest error text a partition's /readyz reason and status entry carry (`brief`).
BRIEF_ERROR_CHARS: Final = 300
#: Threads of the open pool: shard opens (claim, replay, fence) running at once. An open
#: mostly waits on table and WAL storage (the claim's conditional write, manifest and WAL
#: reads; tens of milliseconds each on object storage), so opens overlap well beyond the
#: CPU count. With 4, a member given 128 partitions by a rebalance queued its last open
#: for 3.4 s behind opens of 0.08 s each (bench/rebalance.py, 256 partitions). 32 open a
#: few hundred shards in about the time of a few opens each; threads are started only as
#: opens need them and stay idle afterwards.
OPEN_THREADS: Final = 32


class Settle(Protocol):
    """What a revoke asks of the rest of the loop before it closes the writers: let the
    in-flight puts of `states` finish (bounded by `timeout`) and commit them."""

    def settle(self, states: Sequence[PartitionState], timeout: float) -> None: ...


class Draining(Protocol):
    """Whether the service drains, and the seconds left until its deadline."""

    def drain_left(self) -> float | None: ...


class Lifecycle:
    """Opens, recovers and releases the partitions (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        consumer: confluent_kafka.Consumer,
        partitions: PartitionTable,
        flow: Flow,
        metrics: Metrics,
        *,
        draining: Draining,
        forget: Callable[[tuple[str, int]], None],
        counts: PartitionCounts,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.consumer = consumer
        self.partitions = partitions
        self.flow = flow
        self.metrics = metrics
        self.draining = draining
        self.ready = threading.Event()  # the first assignment was taken
        self.pool = ThreadPoolExecutor(
            max_workers=OPEN_THREADS, thread_name_prefix="open", initializer=name_os_thread
        )
        self.forget = forget  # what else keeps per-partition figures (end offsets)
        self.counts = counts  # the pipeline's, shared by every partition's queues

    # ------------------------------------------------------------------ assign

    def assign(self, partitions: list[TopicPartition]) -> None:
        """The group assigned `partitions`: open their shards on the open pool."""
        if not partitions:
            self.flow.assign_none()
            self.ready.set()
            return
        left = self.draining.drain_left()
        if left is not None:
            # Draining: a shard opened now would be claimed and replayed only to be closed
            # again, holding the drain up. The group takes the partitions back on close.
            self.flow.accept_unopened(partitions)
            log.info("assignment_ignored_while_draining", count=len(partitions))
            return
        committed, known = self._committed_offsets(partitions, left)
        # A failed look-up of the committed offsets is made again by each open. One time
        # for all: the opens of an assignment then share one WAL root listing started
        # after it (`Engine.shard_id`'s `listed_after`).
        submitted = time.monotonic()
        for tp in partitions:
            key = (tp.topic, tp.partition)
            state = PartitionState(
                tp.topic, tp.partition, committed.get(key, -1), counts=self.counts
            )
            state.committed_known = known
            state.opening = self.pool.submit(
                self._open, tp.topic, tp.partition, not known, submitted
            )
            self.partitions.add(state)
        # Nothing is handed to the consumer yet (see `flow.Flow.assign_none`).
        self.flow.assign_none()
        self.metrics.rebalance("assigned", len(partitions))
        self.ready.set()
        log.info("partitions_opening", count=len(partitions))

    def _committed_offsets(
        self, partitions: list[TopicPartition], left: float | None
    ) -> tuple[dict[tuple[str, int], int], bool]:
        """The group's committed offsets of `partitions`, and whether the look-up
        succeeded."""
        timeout = COMMITTED_TIMEOUT_S if left is None else min(COMMITTED_TIMEOUT_S, left)
        try:
            found = self.consumer.committed(partitions, timeout=max(timeout, 0.1))
        except confluent_kafka.KafkaException as exc:
            log.error("committed_offsets_failed", partitions=len(partitions), error=str(exc))
            return {}, False
        return {(tp.topic, tp.partition): tp.offset for tp in found if tp.offset >= 0}, True

    def _open(
        self, topic: str, partition: int, look_up_committed: bool, submitted: float
    ) -> Opened:
        """Open pool: claim and replay the shard; with `look_up_committed`, also fetch the
        group's committed offset (-1: none), which a failed look-up on assign left unknown.
        `submitted`: when the open was handed to the pool (monotonic), while the partition
        is assigned here: a WAL root listing from then on shows every shard id with state."""
        started = time.monotonic()
        writer = self.engine.open_shard(topic, partition, assigned_at=submitted)
        if not look_up_committed:
            return Opened(writer, None, started - submitted, time.monotonic() - started)
        try:
            found = self.consumer.committed(
                [TopicPartition(topic, partition)], timeout=COMMITTED_TIMEOUT_S
            )
        except BaseException:
            self.engine.close_shard(writer, flush=False, timeout=5)
            raise
        committed = max(found[0].offset, -1)
        return Opened(writer, committed, started - submitted, time.monotonic() - started)

    # ------------------------------------------------------------------ open, recover

    def service(self) -> None:
        """Install the writers whose opens ended, and start the reopens whose backoff has
        passed (OPENING and RECOVERING partitions)."""
        starts: list[tuple[PartitionState, int]] = []
        for state in self.partitions.states():
            if state.phase is Phase.OPENING or state.phase is Phase.RECOVERING:
                self._maybe_open(state, starts)
        self.flow.assign_all(starts)

    def _maybe_open(self, state: PartitionState, starts: list[tuple[PartitionState, int]]) -> None:
        if state.opening is not None:
            if state.opening.done():
                self._take_opened(state, starts)
            return
        if time.monotonic() < state.recover_at or self.draining.drain_left() is not None:
            return
        state.opening = self.pool.submit(
            self._open, state.topic, state.partition, not state.committed_known, time.monotonic()
        )

    def _take_opened(self, state: PartitionState, starts: list[tuple[PartitionState, int]]) -> None:
        """Install the writer `state.opening` opened and add the partition and its resume
        offset to `starts` (handed to the consumer together), or record why the open
        failed (retried)."""
        future, state.opening = state.opening, None
        assert future is not None
        try:
            opened = future.result()
        except Exception as exc:  # noqa: BLE001 - any failure is retried, none is fatal
            self.open_failed(state, exc, event="partition_open_failed")
            return
        writer = opened.writer
        if opened.committed is not None:
            state.committed, state.committed_known = opened.committed, True
        durable = writer.durable_offsets.get(state.key)
        # Resume after the last durable offset, or at the committed one if later (I3).
        start = state.done
        if start is None and state.committed >= 0:
            start = state.committed
        if durable is not None:
            start = max(start or 0, durable + 1)
        recovered = state.phase is Phase.RECOVERING
        partition.opened(state, writer, start)
        if recovered:
            state.log.info(
                "partition_recovered",
                attempts=state.open_failures,
            )
        self.metrics.partition_poisoned(state.topic, state.partition, False)
        state.log.info(
            "partition_assigned",
            shard=writer.shard,
            epoch=writer.epoch,
            committed=state.committed if state.committed >= 0 else None,
            durable=durable,
            start=start,
            queued_s=round(opened.queued_s, 3),
            open_s=round(opened.open_s, 3),
        )
        if not state.assigned:
            kafka = self.settings.kafka
            starts.append((state, START_AT[kafka.auto_offset_reset] if start is None else start))

    def open_failed(self, state: PartitionState, exc: BaseException, event: str | None) -> None:
        """Opening (or keeping) the partition's shard writer failed: retried with backoff,
        visible meanwhile in /readyz, /v1/status, the writer-poisoned gauge, a counter and
        a log event (`event`; None: the caller logged it)."""
        delay = backoff(state.open_failures, RECOVERY_BACKOFF_MAX_S)
        partition.open_failed(state, brief(exc), time.monotonic() + delay)
        self.metrics.partition_poisoned(state.topic, state.partition, True)
        if event is not None:
            self.metrics.shard_open_failed(state.topic, state.partition)
            state.log.error(
                event,
                error=f"{type(exc).__name__}: {exc}",
                attempt=state.open_failures,
                retry_in_s=delay,
            )

    # ------------------------------------------------------------------ writer failures

    def writer_failed(self, state: PartitionState, exc: BaseException) -> None:
        """A fenced or poisoned writer: drop what it did not acknowledge, and either
        recover (close, reopen, replay, seek back) or, when fenced, wait to lose the
        partition to its new owner. A STOPPED partition's writer is closed, not reopened."""
        writer = state.writer
        if writer is None:
            return
        self.metrics.partition_poisoned(state.topic, state.partition, True)
        keep_writer_offsets(state, writer)
        writer.close(flush=False, timeout=5)
        fenced = isinstance(exc, Fenced)
        partition.writer_dropped(state, fenced=fenced, now=time.monotonic())
        if state.phase is Phase.FENCED:
            self.flow.pause(state)
            state.log.error("partition_fenced", error=str(exc))
            return
        state.log.error("partition_poisoned", error=str(exc))
        if state.phase is Phase.RECOVERING:
            # Nothing is fetched while the shard reopens (replay); assigned again at the
            # resume offset once it has.
            self.flow.unassign(state)
            self.open_failed(state, exc, event=None)

    def check_writers(self) -> None:
        """Notice writers poisoned or fenced between puts (a fence found by the writer's
        own manifest probe, a flush that kept failing)."""
        for state in self.partitions.states():
            writer = state.writer
            if writer is not None and writer.poisoned is not None:
                self.writer_failed(state, writer.poisoned)

    def fenced_everywhere(self, now: float) -> bool:
        """Every assigned partition fenced by newer writers for longer than the group
        needs to take them away: this process is a zombie (its session expired while it
        was alive)."""
        states = self.partitions.states()
        grace = 2 * self.settings.kafka.session_timeout_ms / 1000
        return bool(states) and all(
            s.fenced_at is not None and now - s.fenced_at > grace for s in states
        )

    # ------------------------------------------------------------------ revoke, lost

    def revoke(self, partitions: list[TopicPartition], settle: Settle) -> None:
        """The group takes `partitions` back: settle what is in flight, commit, close the
        writers (their WAL stays for the next owner)."""
        states = [s for tp in partitions if (s := self.partitions.get((tp.topic, tp.partition)))]
        if states:
            left = self.draining.drain_left()
            deadline = self.settings.shutdown.drain_deadline_s if left is None else left
            settle.settle(states, deadline)
            self.release_all(states, flush=False)
        self.flow.give_back(partitions, states)
        self.metrics.rebalance("revoked", len(partitions))
        for tp in partitions:
            log.info("partition_revoked", topic=tp.topic, partition=tp.partition)

    def lose(self, partitions: list[TopicPartition]) -> None:
        """The group reassigned `partitions` already: close without committing."""
        states = [s for tp in partitions if (s := self.partitions.get((tp.topic, tp.partition)))]
        self.release_all(states, flush=False)
        for tp in partitions:
            log.warning("partition_lost", topic=tp.topic, partition=tp.partition)
        self.flow.give_back(partitions, states)
        self.metrics.rebalance("lost", len(partitions))

    def release(self, state: PartitionState, *, flush: bool, timeout: float = 30.0) -> None:
        """Forget the partition (RELEASED): close its writer (flushing with `flush`), close
        an open still running once it ends, and remove every series of the partition and
        of its shard."""
        self.release_all([state], flush=flush, timeout=timeout)

    def release_all(
        self,
        states: Sequence[PartitionState],
        *,
        flush: bool,
        timeout: float = 30.0,
        wait_trims: bool = True,
    ) -> None:
        """`release` each of `states`, their writers closed at once (a revoke of many
        partitions held the group for one close after another); returns once every writer
        is closed, so the next owner's claim finds none of them writing. `wait_trims`: see
        `ShardWriter.close`."""
        writers = []
        for state in states:
            self.partitions.remove(state)
            writer, opening = state.writer, state.opening
            partition.release(state)
            if opening is not None:  # an open (or reopen) still running: close it after
                if not opening.done():
                    state.log.warning("partition_open_abandoned")
                opening.add_done_callback(self._close_abandoned)
            if writer is not None:
                writers.append(writer)
        if len(writers) == 1:
            self.engine.close_shard(writers[0], flush=flush, timeout=timeout, wait_trims=wait_trims)
        elif writers:
            with ThreadPoolExecutor(
                max_workers=min(len(writers), OPEN_THREADS),
                thread_name_prefix="close",
                initializer=name_os_thread,
            ) as closing:
                done = [
                    closing.submit(
                        self.engine.close_shard,
                        w,
                        flush=flush,
                        timeout=timeout,
                        wait_trims=wait_trims,
                    )
                    for w in writers
                ]
            for future in done:
                future.result()  # the first failure raises, as a close one after another did
        for state in states:
            # Every series of the partition, and of its shard even when its writer was
            # dropped (poisoned, fenced) before: none is left behind at its last value.
            self.metrics.forget_partition(state.topic, state.partition, state.shard)
            self.forget(state.key)

    def _close_abandoned(self, future: Future[Opened]) -> None:
        """A shard open abandoned (its partition revoked or lost, or the sink draining):
        close its writer when it ends (its rows stay in the WAL for the next owner)."""
        if future.cancelled() or future.exception() is not None:
            return
        self.engine.close_shard(future.result().writer, flush=False, timeout=5)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def keep_writer_offsets(state: PartitionState, writer: ShardWriter) -> None:
    """Remember what `writer` reports as durable and flushed for the partition (1 +
    offset), before it is dropped: the offsets shown until a new writer opens."""
    stats = writer.stats()
    state.writer_durable = max(state.writer_durable, stats.durable_offsets.get(state.key, -1) + 1)
    state.writer_flushed = max(state.writer_flushed, stats.flushed_offsets.get(state.key, -1) + 1)


def brief(exc: BaseException) -> str:
    """An error for /readyz and /v1/status: its type and first line, at most
    `BRIEF_ERROR_CHARS` characters. Lance's errors carry a multi-line Rust Debug dump (~1.5 KB
    per partition, repeated in every reason); the log event keeps the whole text."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip()
    if len(text) > BRIEF_ERROR_CHARS:
        text = text[: BRIEF_ERROR_CHARS - 3] + "..."
    if len(lines) > 1 or text.endswith("..."):
        text += " (the whole error is in the log)"
    return text
