"""The pipeline of consumed messages: park -> decode -> hold -> put -> advance.

Per partition and strictly in offset order:

1. **Park.** `handle` groups a consume() batch by partition; messages of a partition that
   feeds (`PartitionState.feeds`) from `position` on are parked and `position` moves past
   them. Messages of a partition that does not feed are dropped: it is fetched again from
   `position` when it feeds again.
2. **Decode.** A partition's parked messages go to a decode worker as one batch while
   fewer than `DECODE_QUEUE_BATCHES` consume batches are decoding (`Decoder.decode`).
3. **Feed** (`collect_decoded`, the loop thread): decoded batches are taken oldest first
   as far as their decoding has ended. A registry outage moves the partition to
   REGISTRY_WAIT, a writer schema the table lacks to EVOLVING (`evolution` is set: the
   service drains and restarts); dead letters are sent and the batch held until they are
   acknowledged (HELD); without a dead-letter destination the partition stops.
4. **Put.** `ShardWriter.put`; backpressure or refused rows hold the batch (HELD, retried
   by `service_held`), a fenced or poisoned writer goes to the lifecycle.
5. **Advance.** `advance` moves `done` over puts that became durable, in order.

The pipeline calls the consumer only through `Flow`, and tells the lifecycle of a failed
writer through the `WriterFailures` protocol the service injects.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Final, Protocol

import structlog

from config.settings import Settings
from engine.errors import Backpressure, Fenced, InvalidRecord, LanceSinkError, Poisoned
from engine.threads import name_os_thread
from engine.wal import SourceRange
from sink.consumer import partition
from sink.consumer.flow import Flow
from sink.consumer.partition import (
    Decoding,
    Held,
    InFlight,
    PartitionCounts,
    PartitionState,
    PartitionTable,
    Phase,
    Stages,
    timestamp_ms,
)
from sink.decode import Decoder
from sink.decode_process import ProcessDecoder
from sink.decoded import Decoded
from sink.dlq import DeadLetterProducer
from sink.formats import RegistryUnavailable, SchemaEvolution
from sink.metrics import Metrics
from sink.refused import split_refused

log = structlog.get_logger("lance_sink.sink")

# Consumed messages waiting for (or in) decoding, in consume() batches: a bound on what the
# loop takes from librdkafka before the decode workers catch up (a fixed memory overhead).
DECODE_QUEUE_BATCHES: Final = 2
# One consume() call takes about this many payload bytes (at most kafka.consume_batch_size
# messages): creating the message objects is the loop's own work, and a 10k batch of 4 KB
# vector messages kept it from noticing durable puts and committing for tens of ms.
CONSUME_TARGET_BYTES: Final = 8 << 20
RECOVERY_BACKOFF_S: Final = 1.0  # first wait before a retry (doubles per failure)
# Longest wait between two attempts to open a shard that keeps failing (and between two
# registry retries when no registry setting says otherwise): long enough not to hammer a
# failing store, short enough that a fixed cause is noticed within half a minute.
RECOVERY_BACKOFF_MAX_S: Final = 30.0


class FatalSinkError(LanceSinkError):
    """A put failed in a way the loop has no answer for (neither fenced nor poisoned): the
    service stops with exit code 1."""


class WriterFailures(Protocol):
    """The lifecycle's part the pipeline calls: a put found the writer fenced or poisoned."""

    def writer_failed(self, state: PartitionState, exc: BaseException) -> None: ...


def backoff(failures: int, limit: float) -> float:
    """The wait before attempt `failures + 1`: doubling from `RECOVERY_BACKOFF_S`."""
    return float(min(RECOVERY_BACKOFF_S * 2**failures, limit))


class Pipeline:
    """Consumed messages on their way to durability (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        partitions: PartitionTable,
        decoder: Decoder | ProcessDecoder,
        flow: Flow,
        dlq: DeadLetterProducer | None,
        metrics: Metrics,
        validate: Any,
        failures: WriterFailures,
        counts: PartitionCounts,
    ) -> None:
        self.settings = settings
        self.partitions = partitions
        self.decoder = decoder
        self.flow = flow
        self.dlq = dlq
        self.metrics = metrics
        self.validate = validate
        self.failures = failures
        self.pool = ThreadPoolExecutor(
            max_workers=settings.source.decode_workers,
            thread_name_prefix="decode",
            initializer=name_os_thread,
        )
        self.queue_limit = DECODE_QUEUE_BATCHES * settings.kafka.consume_batch_size
        self.consume_size = settings.kafka.consume_batch_size
        registry = settings.source.schema_registry
        self.registry_backoff_max_s = (
            registry.unreachable_backoff_max_s if registry is not None else RECOVERY_BACKOFF_MAX_S
        )
        # Messages parked and decoding over the partitions: read every loop iteration, so
        # kept by the partitions' queue methods rather than summed (`PartitionState.counts`).
        self.counts = counts
        # Set when a writer schema needs the table evolved (see `_evolution_needed`).
        self.evolution: SchemaEvolution | None = None

    # ------------------------------------------------------------------ queue sizes

    def decoders_behind(self) -> bool:
        """Whether the decode queue is full (the loop then takes at most one message)."""
        return self.counts.decoding >= self.queue_limit

    def parking_full(self) -> bool:
        """Whether as many messages as the decode queue holds wait for it already."""
        return self.counts.parked >= self.queue_limit

    # ------------------------------------------------------------------ park, decode

    def handle(self, messages: list[Any], errors: Callable[[Any], None]) -> None:
        """Park a consume() batch's messages per partition and hand them to decoding;
        `errors(message)` takes the messages that carry an error."""
        self._size_next_consume(messages)
        fetched_at = time.monotonic()
        groups: dict[tuple[str, int], list[Any]] = {}
        for m in messages:
            if m.error() is not None:
                errors(m)
                continue
            groups.setdefault((m.topic(), m.partition()), []).append(m)
        for key, batch in groups.items():
            state = self.partitions.get(key)
            if state is None or not state.feeds:
                continue  # not ours, or paused: fetched again from `position` on resume
            if state.position is None:
                state.position = state.done = batch[0].offset()
            position = state.position
            fresh = (
                batch
                if batch[0].offset() >= position
                else [m for m in batch if m.offset() >= position]
            )
            if fresh:
                state.out_of_range_since = None
                state.position = fresh[-1].offset() + 1
                state.park(fresh, fetched_at)
                if not self.decoders_behind():
                    self.submit_parked(state)

    def _size_next_consume(self, messages: list[Any]) -> None:
        """Size the next consume() to about CONSUME_TARGET_BYTES, from this batch's
        message sizes (its first and last message: no per-message work)."""
        sample = (messages[0].value(), messages[-1].value())
        nbytes = max(sum(len(v) for v in sample if v is not None) // 2, 1)
        limit = self.settings.kafka.consume_batch_size
        self.consume_size = max(min(CONSUME_TARGET_BYTES // nbytes, limit), min(100, limit))

    def submit_parked(self, state: PartitionState) -> None:
        """Hand a partition's parked messages to a decode worker as one batch."""
        fetched_at = state.parked_at
        messages = state.take_parked()
        job = Decoding(messages, self.pool.submit(self.decoder.decode, messages), fetched_at)
        state.add_decoding(job)

    def skip_offsets(self, state: PartitionState, first: int, last: int) -> None:
        """Offsets `first`..`last` can never become durable (deleted before they were
        read): `done` steps over them as over offsets without rows, after the messages
        consumed before them (still parked or decoding), as one more decoded batch; the
        partition is fetched on from `last + 1`."""
        if state.parked:
            self.submit_parked(state)
        none: Future[Decoded] = Future()
        none.set_result(Decoded(None, [], [], first, last))
        state.add_decoding(Decoding([], none))
        state.position = last + 1

    def wait_decoded(self, timeout: float) -> None:
        """The decode queue is full: wait (bounded) until some partition's oldest batch is
        decoded (only that lets batches be fed, in offset order), or a put becomes
        durable (its offsets are then committed in this iteration, not after the
        decoding)."""
        states = self.partitions.states()
        heads: list[Future[Any]] = [s.decoding[0].future for s in states if s.decoding]
        if heads:
            heads += [
                s.inflight[0].future
                for s in states
                if s.inflight and s.inflight[0].future is not None
            ]
            wait(heads, timeout, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------------ feed, put

    def collect_decoded(self) -> None:
        """Feed each partition's decoded batches to its writer, oldest first, as far as
        their decoding has ended (a held batch stops the rest)."""
        now = time.monotonic()
        for state in self.partitions.states():
            # Only an ACTIVE partition has batches decoding: every other phase dropped them.
            while (
                state.phase is Phase.ACTIVE and state.decoding and state.decoding[0].future.done()
            ):
                job = state.pop_decoded()
                try:
                    decoded = job.future.result()
                except RegistryUnavailable as exc:
                    self._registry_failed(state, job.messages, exc)
                    break
                except SchemaEvolution as exc:
                    self._evolution_needed(state, job.messages, exc)
                    break
                if state.registry_failures:
                    state.registry_failures, state.registry_error = 0, None
                    self.metrics.registry_paused(state.topic, state.partition, False)
                self._feed(state, job.messages, decoded, Stages(job.fetched_at, now))
        if not self.decoders_behind():
            for state in self.partitions.states():
                if state.parked and state.held is None:
                    self.submit_parked(state)

    def _registry_failed(
        self, state: PartitionState, messages: list[Any], exc: RegistryUnavailable
    ) -> None:
        """Decoding needed the schema registry and it could not answer: not the messages'
        fault, so nothing is dead-lettered. The batch and the ones after it are dropped
        (nothing of them is durable) and decoded again after a backoff."""
        delay = backoff(state.registry_failures, self.registry_backoff_max_s)
        partition.registry_wait(state, messages[0], str(exc), time.monotonic() + delay)
        self.flow.pause(state)
        self.metrics.registry_paused(state.topic, state.partition, True)
        state.log.warning(
            "registry_unavailable",
            offset=state.position,
            error=state.registry_error,
            attempt=state.registry_failures,
            retry_in_s=delay,
        )

    def _evolution_needed(
        self, state: PartitionState, messages: list[Any], exc: SchemaEvolution
    ) -> None:
        """A batch was written with a schema whose fields the derived table lacks: nothing
        of it is put; the loop drains (what is durable is committed) and the process
        restarts to evolve the table, then reads the batch again from its first offset."""
        partition.evolving(state, messages[0])
        self.flow.pause(state)
        if self.evolution is None:
            self.evolution = exc
            state.log.warning(
                "schema_evolution_restart",
                offset=state.position,
                reason=exc.message,
                schema_ids=list(exc.schema_ids),
            )

    def _feed(
        self, state: PartitionState, messages: list[Any], decoded: Decoded, stages: Stages
    ) -> None:
        held = Held(decoded, messages, stages=stages)
        if decoded.truncates:
            self.metrics.cdc_truncates_skipped(state.topic, decoded.truncates)
        if decoded.dead_letters:
            if errors := sum(d.reason == "decode_error" for d in decoded.dead_letters):
                self.metrics.decode_failed(state.topic, errors)
            if self.dlq is None:
                # Without a dead-letter destination a bad message stops its partition:
                # nothing is dropped silently.
                first = decoded.dead_letters[0]
                state.log.error(
                    "partition_stopped_on_bad_message",
                    offset=first.offset,
                    reason=first.reason,
                    detail=first.detail,
                )
                self._hold(state, held)
                self.stop(state, f"bad message at offset {first.offset}: {first.reason}")
                return
            held.dead_letters = self.dlq.send(list(decoded.dead_letters))
            self._hold(state, held)
            return
        put = self._put(state, held)
        if put is not True:
            self._hold(state, held)
            if put is not False:
                self.stop(state, put)

    def _put(self, state: PartitionState, held: Held) -> bool | str:
        """Put a decoded batch. True: put (or its writer failed and the lifecycle took
        over); False: refused for now (backpressure, or refused rows whose dead letters
        were sent), the caller holds it; a text: the partition must stop, why."""
        decoded = held.decoded
        batch = decoded.batch
        first_ts = timestamp_ms(held.messages[0]) if held.messages else None
        if batch is None or batch.num_rows == 0:
            state.inflight.append(InFlight(decoded.last_offset, None, 0, 0, first_ts))
            return True
        assert state.writer is not None
        source = SourceRange(
            state.topic, state.partition, decoded.first_offset, decoded.last_offset
        )
        try:
            future = state.writer.put(batch, source)
        except Backpressure:
            return False
        except InvalidRecord as exc:
            # The table refused a batch the decoder accepted: dead-letter the refused
            # rows' messages with the reason, rather than stop the partition.
            state.log.error(
                "batch_rejected_by_table",
                first_offset=decoded.first_offset,
                error=str(exc),
            )
            if self.dlq is None:
                return f"batch rejected by the table: {exc}"
            # The other rows are put once the dead letters are acknowledged.
            held.decoded, letters = split_refused(decoded, held.messages, exc, self.validate)
            held.dead_letters = self.dlq.send(letters)
            return False
        except (Fenced, Poisoned) as exc:
            if held.messages:  # consumed, dropped: the lag in seconds counts from it
                state.rewind(held.messages[0])
            self.failures.writer_failed(state, exc)
            return True
        state.inflight.append(
            InFlight(
                decoded.last_offset, future, batch.num_rows, batch.nbytes, first_ts, held.stages
            )
        )
        return True

    def _hold(self, state: PartitionState, held: Held) -> None:
        partition.hold(state, held)
        self.flow.pause(state)

    def stop(self, state: PartitionState, why: str) -> None:
        """Stop consuming the partition for good (until it is assigned again): `why` shows
        in /readyz and /v1/status, and `lance_sink_partition_stopped` is 1."""
        partition.stop(state, why)
        self.flow.pause(state)
        self.metrics.partition_stopped(state.topic, state.partition)

    def service_held(self) -> None:
        """Retry what waits: a REGISTRY_WAIT partition whose backoff is over is fetched
        again; a HELD batch is put once its dead letters are acknowledged and the writer
        takes it."""
        now = time.monotonic()
        for state in self.partitions.states():
            if state.phase is Phase.REGISTRY_WAIT:
                retry_at = state.registry_retry_at
                if retry_at is not None and now >= retry_at:
                    partition.registry_retry(state)
                    self.flow.resume(state)  # decoded again from `position`
                continue
            held = state.held
            if state.phase is not Phase.HELD or held is None:
                continue
            if held.dead_letters is not None and not held.dead_letters.acked:
                continue
            put = self._put(state, held)
            if put is False:
                continue
            if put is not True:
                self.stop(state, put)
                continue
            if state.phase is Phase.HELD:  # not dropped by a failed writer meanwhile
                partition.put_held(state)
                self.flow.resume(state)

    # ------------------------------------------------------------------ advance

    def advance(self) -> bool:
        """Move each partition's `done` over puts that became durable, in order. Returns
        whether every partition is quiet: ACTIVE and settled (nothing parked, decoding,
        held or in flight; `PartitionState.settled`) with `done` committed (no commit
        owed, or waiting for its result), so the loop has nothing to wait for but new
        messages."""
        quiet = True
        for state in self.partitions.states():
            self.advance_one(state)
            if quiet and (
                state.phase is not Phase.ACTIVE
                or not state.settled
                or (state.done is not None and state.done > state.committed)
            ):
                quiet = False
        return quiet

    def advance_one(self, state: PartitionState) -> None:
        while state.inflight:
            head = state.inflight[0]
            if head.future is not None:
                if not head.future.done():
                    break
                exc = head.future.exception()
                if exc is not None:
                    if isinstance(exc, (Fenced, Poisoned)):
                        self.failures.writer_failed(state, exc)
                        break
                    raise FatalSinkError(f"unexpected put failure: {exc}") from exc
                result = head.future.result()
                durable_at = result.durable_at
                self.metrics.ingested(state.topic, state.partition, head.rows, head.nbytes)
                if head.first_timestamp_ms is not None:
                    self._stages_reached(head, durable_at)
                first_ms = head.first_timestamp_ms
            else:
                durable_at, first_ms = time.monotonic(), None  # no rows: no freshness
            state.done = head.last + 1
            state.durable_at.append((state.done, durable_at, first_ms))
            state.inflight.popleft()
        rewound = state.rewound
        if rewound is not None and state.done is not None and state.done > rewound[0]:
            state.rewound = None  # durable now (or passed as row-less)

    def _stages_reached(self, put: InFlight, durable_at: float) -> None:
        """The freshness of a durable put's oldest message at each stage it passed: seconds
        from its broker timestamp to being fetched, decoded, and durable and visible."""
        assert put.first_timestamp_ms is not None
        # Monotonic instants on the wall clock the broker's timestamps are on.
        wall = time.time() - time.monotonic() - put.first_timestamp_ms / 1000
        self.metrics.visible(wall + durable_at)
        if put.stages is not None:
            self.metrics.stage_reached("fetched", wall + put.stages.fetched_at)
            self.metrics.stage_reached("decoded", wall + put.stages.decoded_at)
        self.metrics.stage_reached("durable", wall + durable_at)

    def close(self, timeout: float) -> None:
        """Stop the decode workers (the drain): batches not decoded yet are abandoned."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        if isinstance(self.decoder, ProcessDecoder):
            self.decoder.close(timeout=timeout)
