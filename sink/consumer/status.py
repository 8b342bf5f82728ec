"""Status: what the HTTP threads say about the loop, from snapshots the loop publishes.

The loop publishes one `PartitionView` per held partition (`StatusBoard.publish`: after a
tick's work at most every `PUBLISH_INTERVAL_S` while rows flow, `PUBLISH_IDLE_INTERVAL_S`
when idle, at once when a partition changes phase, before every commit it sends, and after
a rebalance), built on the loop thread from
its `PartitionState`s; /metrics, /readyz and /v1/status (`exposition`, `readiness`,
`status`, any thread) read the latest views, and of the loop's own state only the three
offsets it assigns whole (`StatusBoard.partition_offsets`). What changes off the loop is
read live beside a view: each shard writer's statistics (thread-safe), the
consumer's cached high watermark and the paused partitions' probe (`sink.lag.PausedEnds`),
so a scrape is current even while the loop is busy. The gauges of each partition and its
shard are set by the scrape (`exposition`), not by the loop: the high watermarks of all
partitions in one pass under the consumer lease (`sink.consumer.lease`), so a scrape waits
for at most one consume() call whatever the partitions, and an idle loop does no
per-partition gauge work (issue #39).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import confluent_kafka
import pyarrow as pa

from config.settings import Settings
from engine.backpressure import BudgetController
from engine.engine import Engine
from engine.maintenance import Maintenance, MaintenanceProcess
from engine.reader import Reader
from engine.shard import ShardWriter
from engine.shard_stats import ShardStats
from sink.base_status import BaseTableStatus
from sink.consumer.broker_stats import BrokerStats
from sink.consumer.lease import ConsumerLease
from sink.consumer.partition import PartitionCounts, PartitionState, PartitionTable, Phase
from sink.dlq import DeadLetterBatch
from sink.lag import PartitionOffsets, PausedEnds, unindexed_rows
from sink.maintenance_role import MaintenanceRole
from sink.metrics import Metrics, memory_limit_bytes, resident_bytes

# How stale the published views may be while rows flow: below any probe's or scrape's
# resolution. A view per partition is not free at a thousand partitions (1.6 ms a publish
# at 1,024, measured: a quarter of the idle loop's CPU at 50 publishes a second), so...
PUBLISH_INTERVAL_S: Final = 0.02
# ...while no row became durable for `PUBLISH_BUSY_S` (and no partition changed phase: that
# publishes at once), the views are republished only this often (a quiet loop ticks as
# often: `sink.service.QUIET_TICK_INTERVAL_S`). What moves then without rows (a dead letter
# acknowledged, a skipped marker) also moves `done`, and the commit that follows publishes
# before it is sent (I14).
PUBLISH_IDLE_INTERVAL_S: Final = 1.0
PUBLISH_BUSY_S: Final = 0.1
# While rows flow, the views are republished no more often than takes this share of the
# loop's time by the last publish's cost: every 20 ms up to ~250 partitions, every ~50 ms
# at 1,024 (2.4 ms a publish there, measured), instead of 12% of a core at 50 a second.
PUBLISH_SHARE: Final = 0.05
# The status's ingest rate averages this many metrics refreshes (10 s at 1 s): long enough
# to smooth consume batches, short enough to show a stall within seconds.
INGEST_WINDOW_SAMPLES: Final = 11


@dataclass(slots=True, eq=False)
class PartitionView:
    """One partition as the loop last published it (see `PartitionState` for the
    fields). `source` is the state itself: compared by identity (was the partition
    released since?) and read for its three offsets alone (`StatusBoard.partition_offsets`).

    Never changed once published, though not frozen: a frozen dataclass sets each field
    through `object.__setattr__`, 3.3 us a view against 0.45 us, and the loop builds one
    per held partition at every publish (every `PUBLISH_INTERVAL_S` while rows flow: at
    1,024 partitions 5.6 ms a publish, over a quarter of a core at 50 a second)."""

    topic: str
    partition: int
    phase: Phase
    paused: bool
    fetched: bool
    stopped: str | None
    decoding_batches: int
    inflight_puts: int
    held: bool
    letters: DeadLetterBatch | None
    pending_timestamp_ms: int | None
    registry_failures: int
    registry_error: str | None
    registry_retry_at: float | None
    open_error: str | None
    open_failures: int
    recover_at: float
    writer: ShardWriter | None
    writer_durable: int
    writer_flushed: int
    writer_unusable: bool
    source: PartitionState = field(repr=False)

    @property
    def key(self) -> tuple[str, int]:
        return (self.topic, self.partition)

    @classmethod
    def of(cls, s: PartitionState) -> PartitionView:
        """The view of `s` now (the loop thread)."""
        return cls(
            s.topic,
            s.partition,
            s.phase,
            s.paused,
            s.fetched,
            s.stopped,
            len(s.decoding),
            len(s.inflight),
            s.held is not None,
            s.unacked_dead_letters(),
            s.oldest_pending_timestamp_ms(),
            s.registry_failures,
            s.registry_error,
            s.registry_retry_at,
            s.open_error,
            s.open_failures,
            s.recover_at,
            s.writer,
            s.writer_durable,
            s.writer_flushed,
            s.writer_unusable,
            s,
        )


class StatusBoard:
    """Metrics, liveness, readiness and status from the published views."""

    def __init__(
        self,
        settings: Settings,
        partitions: PartitionTable,
        *,
        engine: Engine,
        consumer: confluent_kafka.Consumer,
        lease: ConsumerLease,
        paused_ends: PausedEnds,
        broker: BrokerStats,
        metrics: Metrics,
        reader: Reader,
        maintenance: Maintenance | MaintenanceProcess,
        role: MaintenanceRole,
        assigned_once: threading.Event,
        fatal: Callable[[], str | None],
        counts: PartitionCounts,
    ) -> None:
        self.settings = settings
        self.partitions = partitions
        self.engine = engine
        self.consumer = consumer
        self.lease = lease
        self.paused_ends = paused_ends
        self.broker = broker
        self.metrics = metrics
        self.reader = reader
        self.maintenance = maintenance
        self.role = role
        self.assigned_once = assigned_once
        self.fatal = fatal
        self.views: tuple[PartitionView, ...] = ()
        self.published_at = 0.0
        self.counts = counts
        self._published_transitions = -1  # `counts.transitions` at the last publish
        self.last_tick = time.monotonic()
        self._rows_seen = -1  # `metrics.rows_total` at the last tick
        # What `_set_offsets` last set per partition: (its state, the values it set).
        self._offsets_set: dict[tuple[str, int], tuple[PartitionState, Any]] = {}
        self._busy_until = 0.0  # publish every PUBLISH_INTERVAL_S until then
        self.publish_cost_s = 0.0  # how long the last publish took
        # One snapshot's gauges are set (and exposed) together; watermarks are read under it.
        self._offsets_lock = threading.RLock()
        self._consumer_closed = False
        # The base table figures, read at most one at a time and waited for briefly.
        self._base_figures = BaseTableStatus(self._read_base_figures)
        # (monotonic time, rows ingested) once a second: the ingest rate over the last 10 s
        self._ingest_window: deque[tuple[float, int]] = deque(maxlen=INGEST_WINDOW_SAMPLES)

    # ------------------------------------------------------------------ the loop's side

    def ticked(self, now: float) -> None:
        """The loop did a tick's work (liveness): publish the views if a partition changed
        phase since the last publish (a stop, a fence: what its log line says the status
        shows already), or they are older than `PUBLISH_INTERVAL_S` (or than the last
        publish's cost over `PUBLISH_SHARE`, if longer) while rows become durable (and
        `PUBLISH_BUSY_S` after), `PUBLISH_IDLE_INTERVAL_S` otherwise."""
        self.last_tick = now
        rows = self.metrics.rows_total
        if rows != self._rows_seen:
            self._rows_seen = rows
            self._busy_until = now + PUBLISH_BUSY_S
        if now < self._busy_until:
            interval = max(PUBLISH_INTERVAL_S, self.publish_cost_s / PUBLISH_SHARE)
        else:
            interval = PUBLISH_IDLE_INTERVAL_S
        if (
            self.counts.transitions != self._published_transitions
            or now - self.published_at >= interval
        ):
            self.publish()

    def publish(self) -> None:
        """Publish a view of every held partition (the loop thread)."""
        self.published_at = started = time.monotonic()
        self._published_transitions = self.counts.transitions
        self.views = tuple(
            PartitionView.of(s) for s in sorted(self.partitions.states(), key=lambda s: s.key)
        )
        self.publish_cost_s = time.monotonic() - started

    def consumer_closing(self) -> None:
        """No scrape reads a watermark from the consumer once it closes."""
        with self._offsets_lock:
            self._consumer_closed = True

    def refresh_metrics(self, now: float) -> None:
        """Refresh the process-wide gauges and the views unless the tick at `now` just
        published them (the loop, once a second). The gauges of each partition and its
        shard are set at each scrape instead (`exposition`): setting them here cost the
        idle loop a pass over every partition's writer statistics a second (5% of a core
        at 1,024 partitions, measured; issue #39) for gauges nobody reads between
        scrapes."""
        if self.published_at < now:
            self.publish()
        # End offsets of the partitions the consumer does not fetch come from the probe.
        self.paused_ends.track(v.key for v in self.views if not v.fetched)
        self._ingest_window.append((time.monotonic(), self.metrics.rows_total))
        bp = self.engine.controller.stats.snapshot()
        self.metrics.backpressure(
            waits=bp.waits_total,
            wait_seconds=bp.wait_seconds_total,
            active=bp.active_waits,
            rejections=bp.rejections_total,
        )
        controller = self.engine.controller
        if isinstance(controller, BudgetController):
            self.metrics.budget_usage(controller.used_bytes(), controller.budget)
        self.metrics.base_unindexed(self.maintenance.unindexed_rows())
        self.metrics.lance_cache(self.reader.lance_cache_bytes)
        self.metrics.arrow_pool(pa.total_allocated_bytes())
        vector, text = self.reader.unindexed, self.reader.flushed_text
        self.metrics.unindexed_cache(
            self.reader.unindexed_bytes,
            0 if vector is None else vector.fallbacks,
            0 if text is None else text.fallbacks,
        )

    # ------------------------------------------------------------------ any thread

    def partition_offsets(self, view: PartitionView) -> PartitionOffsets:
        """One consistent snapshot of a partition's offsets (any thread; see `sink.lag`):
        read from the slowest-moving to the fastest, the end offset last and from the
        newest fetch response, so no lag clamps to 0 on an end offset older than what is
        subtracted from it.

        Every held partition has one, with a shard writer or without (its open or reopen
        under way or failing, poisoned, fenced): without, durable and flushed are what its
        last writer reported when it was dropped (0 if none opened since the assignment:
        the flush lag then counts from the log start, as `lance-sink lag`'s does without a
        recorded flush), never below `done` and the committed offset; the end offset of a
        partition the consumer does not fetch is the probe's (`sink.lag.PausedEnds`).

        The loop's three offsets (`position`, `committed`, `done`) are read from the
        partition's state as it is now, not from the view: each is one int the loop assigns
        whole, and a view can be a consume wait old, which would overstate the lags by
        what was committed since (everything else the loop owns comes from the view)."""
        return self.snapshots([view])[0]

    def snapshots(
        self, views: Sequence[PartitionView], stats: Sequence[ShardStats | None] | None = None
    ) -> list[PartitionOffsets]:
        """`partition_offsets` of each of `views`, in two passes: every partition's own
        offsets first, then every end offset in one pass under the consumer lease (one
        wait for the loop's consume() in progress, not one per partition). Each end offset
        is still read after the offsets subtracted from it. `stats`: each view's writer's
        statistics if the caller just read them."""
        own = [
            self._own_offsets(view, None if stats is None else stats[i])
            for i, view in enumerate(views)
        ]
        highs = [-1] * len(views)
        with self._offsets_lock:
            if not self._consumer_closed and views:
                with self.lease.hold():
                    for i, view in enumerate(views):
                        with contextlib.suppress(RuntimeError, confluent_kafka.KafkaException):
                            highs[i] = self.consumer.get_watermark_offsets(
                                view.source.tp, cached=True
                            )[1]
        snaps = []
        for view, (consumed, durable, committed, flushed), cached in zip(
            views, own, highs, strict=True
        ):
            # A partition the consumer does not fetch (paused, unassigned while its writer
            # opens): the probe's newer end, once it has one.
            high = max(cached, self.paused_ends.end(view.key))
            end = high if high >= 0 else self.broker.end(view.key)
            snaps.append(
                PartitionOffsets(
                    end, consumed, durable, committed, flushed, view.pending_timestamp_ms
                )
            )
        return snaps

    def _own_offsets(
        self, view: PartitionView, stats: ShardStats | None
    ) -> tuple[int, int, int, int]:
        """A partition's consumed, durable, committed and flushed offsets (see
        `partition_offsets`)."""
        key, live = view.key, view.source
        position = live.position
        committed = max(live.committed, 0)
        if view.writer is not None:
            stats = stats if stats is not None else view.writer.stats()
            writer_durable = stats.durable_offsets.get(key, -1) + 1
            writer_flushed = stats.flushed_offsets.get(key, -1) + 1
        else:
            writer_durable, writer_flushed = view.writer_durable, view.writer_flushed
        durable, flushed = durable_and_flushed(live.done, writer_durable, writer_flushed)
        durable, flushed = max(durable, committed), max(flushed, 0)
        consumed = max(position or 0, durable)
        return consumed, durable, committed, flushed

    def refresh_offsets(self) -> None:
        """Set every partition's gauges (offsets and lags from one snapshot each, paused,
        writer poisoned, dead letters held) and its shard's memory gauges (each scrape,
        just before the exposition)."""
        with self._offsets_lock:
            self._set_offsets()

    def _set_offsets(self) -> None:
        """Set the gauges of every partition whose snapshot changed since they were set
        (setting ~14 labelled gauges per partition was a tenth of a core idle at 1,024
        partitions, measured); a partition with a message pending is set every time (its
        lag in seconds grows with the clock), one with dead letters waiting too."""
        last, sets = self._offsets_set, {}
        views = []
        for view in self.views:
            if self.partitions.get(view.key) is not view.source:  # released meanwhile
                self.metrics.forget_partition(*view.key)
                continue
            views.append(view)
        stats = writer_stats(views)
        for view, st, offsets in zip(views, stats, self.snapshots(views, stats), strict=True):
            key = view.key
            memory = (
                None
                if st is None
                else (st.shard, st.bytes, st.frozen_bytes, st.frozen_count, st.index_bytes)
            )
            letters = view.letters
            value = (offsets, view.paused, view.writer_unusable, memory, letters)
            sets[key] = (view.source, value)
            if (
                offsets.oldest_pending_timestamp_ms is None
                and letters is None
                and last.get(key) is not None
                and last[key][0] is view.source
                and last[key][1] == value
            ):
                continue
            self.metrics.partition_offsets(*key, offsets)
            self.metrics.partition_paused(*key, view.paused)
            self.metrics.partition_poisoned(*key, view.writer_unusable)
            self.metrics.dlq_waiting(*key, letters.waiting_s() if letters else 0.0)
            if st is not None:
                self.metrics.shard_memory(
                    st.shard,
                    unflushed=st.bytes + st.frozen_bytes,
                    frozen_count=st.frozen_count,
                    active=st.bytes,
                    index=st.index_bytes,
                )
        self._offsets_set = sets

    def exposition(self) -> bytes:
        """Prometheus text of every metric, with the offset and lag gauges of this instant."""
        with self._offsets_lock:  # a refresh by the loop cannot interleave
            self._set_offsets()
            return self.metrics.exposition()

    def liveness(self) -> tuple[bool, str]:
        """Alive while the consumer loop iterates (a loop stuck for longer than
        max.poll.interval.ms would be evicted from the group anyway)."""
        stuck = time.monotonic() - self.last_tick
        limit = self.settings.kafka.max_poll_interval_ms / 1000
        if stuck > limit:
            return False, f"consumer loop has not polled for {stuck:.0f} s"
        return True, "consumer loop polling"

    def readiness(self) -> tuple[bool, list[str]]:
        """Ready = joined the group with every assigned partition opened and replayed, a
        broker reachable, and no shard writer poisoned or fenced."""
        reasons = []
        if not self.assigned_once.is_set():
            reasons.append("waiting for the first partition assignment")
        if (unreachable := self.broker.unreachable(time.monotonic())) is not None:
            reasons.append(unreachable)
        reasons.extend(
            f"{view.topic}[{view.partition}]: {reason}"
            for view in self.views
            if (reason := self._not_ready(view)) is not None
        )
        if (fatal := self.fatal()) is not None:
            reasons.append(fatal)
        return not reasons, reasons

    def _not_ready(self, view: PartitionView) -> str | None:
        """Why the partition keeps the sink from being ready, if it does (by its phase)."""
        if view.phase is Phase.FENCED:
            return "fenced by a newer writer"
        if view.phase is Phase.STOPPED:
            return f"stopped, {view.stopped}"
        if view.phase is Phase.OPENING:
            return "opening and replaying its shard"
        if view.phase is Phase.RECOVERING:
            why = view.open_error or "shard writer poisoned"
            return f"no shard writer ({why}), retrying (attempt {view.open_failures + 1})"
        letters = view.letters
        if letters is not None and letters.waiting_s() > self.settings.dlq.stalled_after_s:
            return (
                f"held {letters.waiting_s():.0f} s by {letters.pending} undelivered dead "
                f"letter(s), last error: {letters.last_error}"
            )
        return None

    def status(self) -> dict[str, Any]:
        """One JSON-able summary of the running sink (`lance-sink status`)."""
        views = self.views
        stats = writer_stats(views)
        partitions = [
            self._partition_status(view, snap, st)
            for view, snap, st in zip(views, self.snapshots(views, stats), stats, strict=True)
        ]
        bp = self.engine.controller.stats.snapshot()
        controller = self.engine.controller
        budget = controller if isinstance(controller, BudgetController) else None
        ready, reasons = self.readiness()
        return {
            "group": self.settings.kafka.group_id,
            "topics": list(self.settings.kafka.topics),
            "table": self.settings.table.uri,
            "ready": ready,
            "not_ready_reasons": reasons,
            "partitions": partitions,
            "backpressure": {
                "controller": type(controller).__name__,
                "budget_bytes": budget.budget if budget else None,
                "used_bytes": budget.used_bytes() if budget else None,
                "waits_total": bp.waits_total,
                "wait_seconds_total": round(bp.wait_seconds_total, 3),
                "active_waits": bp.active_waits,
                "rejections_total": bp.rejections_total,
            },
            "ingest": self._ingest_status(),
            # Seconds from a batch's oldest message timestamp to each stage, recent batches.
            "freshness": self.metrics.freshness_percentiles(),
            "memory": {
                "resident_bytes": resident_bytes(),
                "budget_bytes": budget.budget if budget else None,
                "limit_bytes": memory_limit_bytes(),
            },
            "base": self._base_status(),
            "maintenance": self.role.status(),
        }

    def _ingest_status(self) -> dict[str, Any]:
        """Rows made durable per second over the last `INGEST_WINDOW_SAMPLES` refreshes."""
        now, total = time.monotonic(), self.metrics.rows_total
        window = list(self._ingest_window)
        since, before = window[0] if window else (now, total)
        seconds = now - since
        rate = (total - before) / seconds if seconds > 0 else 0.0
        return {"rows_per_second": round(rate, 1), "window_seconds": round(seconds, 1)}

    def _base_status(self) -> dict[str, Any]:
        """The base table's index lag as it is now (`sink.lag.unindexed_rows`), beside the
        figure of the last maintenance run. Bounded in time whatever table storage does
        (`sink.base_status`): a stalled store makes it unknown, with the reason and the
        last figures read."""
        return {
            "unindexed_rows_at_last_maintenance": self.maintenance.unindexed_rows(),
            **self._base_figures.get(),
        }

    def _read_base_figures(self) -> dict[str, Any]:
        """`BaseTableStatus`'s read (on its own thread): the base table's rows and index lag
        from table storage (manifest metadata only)."""
        ds = self.engine.table.dataset()
        per_index = unindexed_rows(ds)
        rows = int(ds.count_rows())
        # The least complete index: what queries wait on (0 without indexes).
        return {
            "rows": rows,
            "unindexed_rows": max(per_index.values(), default=0),
            "unindexed_by_index": per_index,
        }

    def _partition_status(
        self, view: PartitionView, snap: PartitionOffsets, st: ShardStats | None
    ) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "topic": view.topic,
            "partition": view.partition,
            "phase": view.phase.value,
            "paused": view.paused,
            "fenced": view.phase is Phase.FENCED,
            "stopped": view.stopped,
            "decoding_batches": view.decoding_batches,
            "inflight_puts": view.inflight_puts,
            "held": view.held,
        }
        if view.registry_failures:
            retry_at = view.registry_retry_at
            entry["schema_registry"] = {
                "error": view.registry_error,
                "failures": view.registry_failures,
                "retry_in_s": None
                if retry_at is None
                else round(max(retry_at - time.monotonic(), 0.0), 1),
            }
        if view.writer is None and view.phase is not Phase.FENCED:
            entry["open"] = {
                "error": view.open_error,
                "failures": view.open_failures,
                "retry_in_s": round(max(view.recover_at - time.monotonic(), 0.0), 1),
            }
        if (letters := view.letters) is not None:
            entry["dead_letters"] = {
                "pending": letters.pending,
                "waiting_s": round(letters.waiting_s(), 1),
                "stalled": letters.waiting_s() > self.settings.dlq.stalled_after_s,
                "last_error": letters.last_error,
            }
        # One snapshot (see `partition_offsets`), with a shard writer or without.
        entry.update(
            consumed=snap.consumed,
            committed=snap.committed,
            durable=snap.durable,
            flushed=snap.flushed,
            end=snap.end,
        )
        lags = snap.lags()
        if lags is not None:
            entry["lag"] = {**lags, "seconds": round(snap.lag_seconds(), 3)}
        if st is not None:
            entry.update(
                shard=st.shard,
                epoch=st.epoch,
                memtable={
                    "generation": st.generation,
                    "rows": st.rows,
                    "bytes": st.bytes,
                    "index_bytes": st.index_bytes,
                    "frozen_count": st.frozen_count,
                    "frozen_bytes": st.frozen_bytes,
                },
                flush={
                    "flushes": st.flushes_total,
                    "failures": st.flush_failures_total,
                    "rows": st.flushed_rows_total,
                    "position": st.flushed_position,
                },
                poisoned=st.poisoned,
            )
        return entry


def durable_and_flushed(done: int | None, durable: int, flushed: int) -> tuple[int, int]:
    """A partition's durable and flushed offsets (next-offset style) as the gauges show them:
    offsets without rows below `done` (control records, aborted transactions, tombstones,
    acknowledged dead letters) count as durable, and as flushed once every durable row is,
    so a caught-up partition shows no durable or flush lag."""
    if done is None:
        return durable, flushed
    if flushed >= durable:
        flushed = max(flushed, done)
    return max(durable, done), flushed


def writer_stats(views: Sequence[PartitionView]) -> list[ShardStats | None]:
    """Each view's shard writer statistics (None without a writer), read once per writer
    for its offsets and its memtable figures alike."""
    return [view.writer.stats() if view.writer is not None else None for view in views]
