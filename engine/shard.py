"""The shard writer: one per topic-partition, the single owner of a shard's WAL and memtables.

Lifecycle (who calls what, and when):

- `ShardWriter.open(...)` (the sink, on assign; tests directly) claims a new epoch in the
  shard manifest (I5), finds the flushed watermark (manifest, and for the crash window the
  newest Lance commits: `engine.flusher.ShardFlush.claim`), replays the WAL entries after
  it into memtables with the live seal predicate, flushing as it goes (I4), and writes a
  fence entry at the next WAL position (`engine.replay`). It returns a writer whose
  `durable_offsets` say where the source must resume: **resume after the last durable
  offset**, i.e. at `durable_offsets[(topic, p)] + 1`.
  If open raises, nothing was acknowledged by this writer and it is not scheduled.
- `put(batch, source_range)` (the consumer loop) validates the batch, asks the
  backpressure controller for admission, and buffers it for the next WAL entry; it returns
  a future that resolves once the rows are durable **and** visible (one step: rows enter the
  memtable only after their WAL entry is durable, I2). `put` raises `InvalidRecord` (bad
  batch; nothing accepted), `Backpressure` (refused; nothing accepted) or the poison error.
- The WAL steps (internal, `_wal_step`, run by the process's `WalScheduler`: a pool of WAL
  workers and one timer shared by every shard, never two workers on one shard) group-commit
  buffered puts every `max_wal_flush_interval` (or when `max_wal_buffer_size` is reached),
  append the entry create-only, insert the rows into the active memtable (sealing it first
  when `should_seal` says so, and after when `is_full` says it reached a limit, if the
  controller's `may_seal` allows; a refused seal is asked again every `IDLE_WAKE_S` and by
  the next put), and resolve the futures in put order. A put schedules the step (at once
  when the buffer is full, else at its group-commit deadline), so do a seal request, the
  active memtable's `max_age_s` and close; an idle writer's step does not run.
- The idle fence probe (`_idle_fence_probe`, run by the scheduler's probe lane, not a WAL
  step) lists the shard manifest for a newer epoch while the writer is idle, at most every
  `max(fence_check_interval_s, IDLE_WAKE_S)` and within the process's probe rate
  (`WalScheduler`, `wal.fence_probes_per_s`): with more idle shards than that rate times
  the interval, each is probed every `shards / rate` seconds instead. An `Engine` learns
  of claims from its claim board's sweep instead (`engine.claim_board`: one listing per
  interval, then `probe_fence` of the shards a claim names) and opens its writers with a
  long `idle_probe_interval`: their own probes are the safety net.
- Flushes run on the shared `Flusher` pool, oldest frozen memtable first, one at a time per
  shard. A failed flush keeps its memtable frozen and counted (I8) and is retried with
  backoff; after `max_attempts` the writer is poisoned (I6). `engine.flusher` tells the
  flush's own steps and what close waits for.
- `view()` (readers) returns the visible memtables; fails with the poison error. With
  `fence_check_interval_s` = 0 it first probes the manifest for a fence (storage I/O on
  every read); otherwise it does no I/O and relies on the idle fence probe (a busy writer
  finds a fence at its next append).
- `close(flush=...)` (the sink on revoke/shutdown; always called, also after poisoning)
  stops accepting puts, writes what is buffered (on the scheduler, or on the caller's thread
  if the engine's scheduler already stopped), force-seals the active memtable and,
  with `flush=True`, waits (bounded) for every frozen memtable to flush; what is left is
  replayed by the next owner. `stats()` stays readable after close and poisoning.

A fence (a newer epoch appended at our next WAL position, or wrote our next manifest
version) or a persistence failure poisons the writer (`poison`): every later put and read
raises `Fenced` or `Poisoned`, and nothing more is acknowledged.

The writer's parts, each with its own lifecycle notes: `engine.shard_memtables` (the active
and frozen memtables, the seal rules, the view readers take), `engine.flusher` (flushes and
what is flushed), `engine.replay` (the WAL walk and fence of open), `engine.shard_stats`
(events and the stats snapshot); shard ids are `engine.shard_ids`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import pyarrow as pa
import structlog

from engine.backpressure import BackpressureController, ShardMemory
from engine.errors import Backpressure, Fenced, LanceSinkError, PersistenceError, Poisoned
from engine.flusher import Flusher, ShardFlush
from engine.manifest import ManifestStore, ShardOrigin
from engine.memtable import SealLimits, entry_batches, is_full, should_seal
from engine.replay import replay_wal
from engine.schema import TableSpec
from engine.shard_memtables import ShardMemtables, ShardView
from engine.shard_stats import EngineEvents, NoEvents, ShardStats
from engine.storage import AlreadyExists, Storage
from engine.table import BaseTable
from engine.wal import EntryEncoder, SourceRange, Wal, WalEntry, merge_ranges
from engine.wal_scheduler import ScheduledShard, WalScheduler, default_scheduler

log = structlog.get_logger("lance_sink.engine")

#: The shortest period of an idle writer's background fence probe (with a shorter
#: `fence_check_interval_s`, 0 included: reads then probe themselves), and how soon a seal
#: the controller refused (a full memtable, or one `max_age_s` old) is asked again.
IDLE_WAKE_S = 0.5


@dataclass(frozen=True, slots=True)
class WriterConfig:
    """Tuning of one shard writer (from `WalSettings`, `MemtableSettings`, `FlushSettings`)."""

    limits: SealLimits
    max_wal_flush_interval_s: float = 0.02
    max_wal_buffer_bytes: int = 16 << 20
    flush_retry_initial_s: float = 0.2
    flush_retry_max_s: float = 10.0
    flush_max_attempts: int = 8
    fence_check_interval_s: float = 0.0
    #: Seal the active memtable once its first row is this old (0 = on size only).
    max_age_s: float = 0.0
    #: Where this process serves its memtables to other pods (`query.advertised_url`),
    #: recorded in the manifest by the claim ("" = nowhere).
    advertised_url: str = ""


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a resolved put future carries: the WAL entry position, the rows, and when
    (`time.monotonic()`) they became durable and visible."""

    position: int
    rows: int
    durable_at: float


@dataclass
class _Put:
    batch: pa.RecordBatch
    source: SourceRange | None
    future: Future[PutResult]
    nbytes: int
    rows: int
    arrived: float = field(default_factory=time.monotonic)


class ShardWriter:
    """See the module docstring for the lifecycle; construct with `ShardWriter.open`."""

    def __init__(
        self,
        shard: str,
        spec: TableSpec,
        table: BaseTable,
        storage: Storage,
        config: WriterConfig,
        controller: BackpressureController,
        flusher: Flusher,
        events: EngineEvents | None = None,
    ) -> None:
        self.shard = shard
        self.spec = spec
        self.table = table
        self.config = config
        self.controller = controller
        self.flusher = flusher
        self.events: EngineEvents = events or NoEvents()
        self.wal = Wal(storage, shard)
        self.manifests = ManifestStore(storage, shard)
        self.memory = ShardMemory(shard)
        self.log = log.bind(shard=shard)
        self._lock = threading.RLock()
        self._schema = spec.batch_schema
        self._encoder = EntryEncoder()
        self._next_position = 1
        self._pending: list[_Put] = []
        self._pending_bytes = 0
        self._pending_rows = 0
        self._poison: LanceSinkError | None = None
        self._closing = False
        self._closed = False
        self._last_fence_check = 0.0
        self._scheduler: WalScheduler | None = None
        self._task: ScheduledShard | None = None
        #: Set by the last WAL step after close: everything buffered was written (or failed).
        self._wal_done = threading.Event()
        self._counters = {"wal_entries": 0, "wal_bytes": 0, "replayed_rows": 0}
        self._replay_seconds = 0.0
        self._memtables = ShardMemtables(
            shard,
            spec,
            config.limits,
            config.max_age_s,
            controller,
            self.memory,
            self.events,
            poisoned=lambda: self._poison,
            pending_bytes=lambda: self._pending_bytes,
            sealed=self._schedule_flush,
        )
        self._flush = ShardFlush(
            shard,
            table,
            self.wal,
            self.manifests,
            flusher,
            self.events,
            self.memory,
            lock=self._lock,
            frozen=self._memtables.frozen,
            poisoned=lambda: self._poison,
            poison=self.poison,
            account=self._memtables.account,
            retry_initial_s=config.flush_retry_initial_s,
            retry_max_s=config.flush_retry_max_s,
            max_attempts=config.flush_max_attempts,
        )

    # ------------------------------------------------------------------ open / replay

    @classmethod
    def open(
        cls,
        shard: str,
        spec: TableSpec,
        table: BaseTable,
        storage: Storage,
        config: WriterConfig,
        controller: BackpressureController,
        flusher: Flusher,
        events: EngineEvents | None = None,
        *,
        origin: ShardOrigin | None = None,
        scheduler: WalScheduler | None = None,
        idle_probe_interval: float | None = None,
    ) -> ShardWriter:
        """Claim the shard, replay its WAL, fence older writers; see the module docstring.

        `origin` (the table, topic and partition; `Engine.open_shard` passes it) is recorded
        in the manifest; without it the previous version's is kept. `scheduler` runs the
        writer's WAL work (`Engine` passes its own); without it the process-wide default.
        `idle_probe_interval`: how often the idle fence probe runs (default
        `max(fence_check_interval_s, IDLE_WAKE_S)`; an `Engine` that sweeps the claim board
        probes far less often, `engine.claim_board`).

        Raises:
            PersistenceError: storage failed during claim or replay (nothing acknowledged).
            Fenced: an even newer writer claimed the shard while this one replayed.
        """
        writer = cls(shard, spec, table, storage, config, controller, flusher, events)
        writer._claim_and_replay(origin)
        writer._scheduler = scheduler or default_scheduler()
        writer._task = writer._scheduler.register(
            shard,
            writer._wal_step,
            probe=writer._idle_fence_probe,
            probe_interval=idle_probe_interval or max(config.fence_check_interval_s, IDLE_WAKE_S),
        )
        writer.memory.on_seal_request(writer._wake_wal)
        controller.register(writer.memory)
        # The first step: the memtable replay left may be due for an age seal.
        writer._scheduler.wake_at(writer._task, time.monotonic() + IDLE_WAKE_S)
        return writer

    def _claim_and_replay(self, origin: ShardOrigin | None) -> None:
        started = time.monotonic()
        manifest = self._flush.claim(self.config.advertised_url, origin)
        self._memtables.start(
            manifest.generation, manifest.flushed_position, self._flush.flushed_offsets
        )
        self.log.info("shard_claimed", epoch=self.epoch, flushed_position=manifest.flushed_position)
        replayed = replay_wal(
            self.wal,
            self._encoder,
            self.shard,
            self.epoch,
            self._schema,
            manifest.flushed_position,
            self._apply_replayed,
        )
        position = replayed.fence_position
        self._next_position = position + 1
        self._memtables.insert_fence(position)
        # Entries flushed before the claim, or while replaying, are trimmed now.
        stale = [p for p in replayed.positions if p <= self._flush.flushed_position]
        if stale:
            self.wal.delete_through(max(stale))
        self._replay_seconds = time.monotonic() - started
        self._counters["replayed_rows"] = replayed.rows
        self.events.replayed(self.shard, self._replay_seconds, replayed.rows, replayed.nbytes)
        self.log.info(
            "shard_replayed",
            epoch=self.epoch,
            rows=replayed.rows,
            bytes=replayed.nbytes,
            seconds=round(self._replay_seconds, 3),
            next_position=self._next_position,
        )

    def _apply_replayed(self, entry: WalEntry) -> None:
        """Insert a replayed entry exactly as the live path did, flushing as memtables seal."""
        if entry.shard != self.shard:
            raise PersistenceError(
                f"WAL entry {entry.position} belongs to shard {entry.shard}", shard=self.shard
            )
        # An entry written before the table evolved lacks its new columns: they read null.
        batches = [self.spec.conform(b) for b in entry.batches]
        with self._lock:
            sealed = self._memtables.insert(batches, entry.position, entry.sources, replay=True)
        if sealed:
            # Bounded replay (I4): flush each sealed memtable before reading further.
            self._flush.drain_inline()

    # ------------------------------------------------------------------ put

    def put(self, batch: pa.RecordBatch, source: SourceRange | None = None) -> Future[PutResult]:
        """Accept `batch` for the next WAL entry; see the module docstring.

        Raises:
            InvalidRecord: the batch does not fit the table (nothing accepted).
            Backpressure: admission or a needed seal was refused (nothing accepted).
            Fenced / Poisoned: the writer can no longer acknowledge anything.
        """
        self._raise_if_unusable()
        batch = self.spec.validate(batch)
        nbytes = batch.nbytes
        self.controller.maybe_apply_backpressure(nbytes, self.memory)
        with self._lock:
            self._raise_if_unusable()
            active = self._memtables.active
            if should_seal(
                active.rows + self._pending_rows,
                active.memory_size + self._pending_bytes,
                len(active.batches),
                batch.num_rows,
                nbytes,
                self.config.limits,
            ) and not self.controller.may_seal(self.memory):
                raise Backpressure("seal refused by the controller", shard=self.shard)
            put = _Put(batch, source, Future(), nbytes, batch.num_rows)
            self._pending.append(put)
            self._pending_bytes += nbytes
            self._pending_rows += batch.num_rows
            self._memtables.account()
            if self._pending_bytes >= self.config.max_wal_buffer_bytes:
                self._wake_wal()
            elif len(self._pending) == 1:
                self._wake_wal_at(put.arrived + self.config.max_wal_flush_interval_s)
        return put.future

    def _raise_if_unusable(self) -> None:
        if self._poison is not None:
            raise self._poison
        if self._closing:
            raise Poisoned("the shard writer is closed", shard=self.shard)

    # ------------------------------------------------------------------ WAL steps

    def _wake_wal(self) -> None:
        """Run the WAL step soon (a full buffer, a seal request, close)."""
        if self._task is not None and self._scheduler is not None:
            self._scheduler.wake(self._task)

    def _wake_wal_at(self, when: float) -> None:
        if self._task is not None and self._scheduler is not None:
            self._scheduler.wake_at(self._task, when)

    def _idle(self) -> bool:
        return not self._pending and not self._closing and not self.memory.seal_required

    def _wal_step(self) -> float | None:
        """One pass of the WAL work, run by a `WalScheduler` worker (never two at once for
        a shard): seal the active memtable if due, write one WAL entry of the buffered puts
        once the first is `max_wal_flush_interval_s` old or they fill `max_wal_buffer_bytes`
        (at once when closing), honour a seal request. Returns when it next wants to run
        (see `_next_wake`). An unexpected failure poisons the writer (I6). The idle fence
        probe is not a step: the scheduler's probe lane runs `_idle_fence_probe`."""
        try:
            return self._wal_step_once()
        except Exception as exc:  # noqa: BLE001 - nothing more is acknowledged (I6)
            error = Poisoned(f"WAL step failed: {exc}", shard=self.shard)
            error.__cause__ = exc
            self.poison(error)
            if self._closing:
                self._wal_done.set()
            return None

    def _wal_step_once(self) -> float | None:
        taken: list[_Put] = []
        with self._lock:
            self._memtables.seal_if_due()
            now = time.monotonic()
            if self._pending and (
                self._closing
                or self._pending_bytes >= self.config.max_wal_buffer_bytes
                or now >= self._pending[0].arrived + self.config.max_wal_flush_interval_s
            ):
                taken = self._take_group_locked()
            if not taken:
                self._memtables.honour_seal_request()
                if self._closing and not self._pending:
                    self._wal_done.set()
                    return None
        if taken:
            self._commit_group(taken)
        with self._lock:
            return self._next_wake()

    def _idle_fence_probe(self) -> None:
        """The idle fence probe (the scheduler's probe lane calls it, at most every
        `max(fence_check_interval_s, IDLE_WAKE_S)` and within the process's probe rate):
        probe the manifest (storage I/O) if the writer is idle and usable. A busy writer is
        not probed: its next WAL append finds the newer writer's fence entry."""
        with self._lock:
            if not self._idle() or self._poison is not None:
                return
            self._last_fence_check = time.monotonic()
        self._probe_fence()

    def _next_wake(self) -> float | None:
        """When the WAL step must run next (the caller holds the lock): now while closing
        or a full buffer waits, the group-commit deadline of the first buffered put, the
        active memtable's max-age seal (or a retry of a seal the controller refused); None
        when idle or poisoned (nothing more to do until a put, a seal request or close)."""
        now = time.monotonic()
        if self._closing:
            return now
        if self._poison is not None:
            return None
        wakes = []
        if self._pending:
            if self._pending_bytes >= self.config.max_wal_buffer_bytes:
                return now
            wakes.append(self._pending[0].arrived + self.config.max_wal_flush_interval_s)
        active = self._memtables.active
        if active.rows:
            if is_full(active.rows, active.memory_size, len(active.batches), self.config.limits):
                wakes.append(now + IDLE_WAKE_S)  # the controller refused the seal
            elif self.config.max_age_s > 0 and active.first_insert_at is not None:
                due = active.first_insert_at + self.config.max_age_s
                wakes.append(due if due > now else now + IDLE_WAKE_S)
        return min(wakes, default=None)

    def _take_group_locked(self) -> list[_Put]:
        """The oldest pending puts that fit one WAL entry: at least one, then as many as
        stay within `max_wal_buffer_bytes`. Bounding the entry bounds the memtable overshoot
        to one put and lets flushes overlap WAL appends when puts outrun the disk."""
        limit = self.config.max_wal_buffer_bytes
        count, nbytes = 0, 0
        for put in self._pending:
            if count and nbytes + put.nbytes > limit:
                break
            count += 1
            nbytes += put.nbytes
        taken, self._pending = self._pending[:count], self._pending[count:]
        return taken

    def _commit_group(self, puts: list[_Put]) -> None:
        """Write one WAL entry for `puts`, make it visible, resolve the futures in order."""
        if self._poison is not None:
            self._fail(puts, self._poison)
            return
        position = self._next_position
        batches = entry_batches([p.batch for p in puts])
        rows = sum(p.rows for p in puts)
        sources = merge_ranges([p.source for p in puts if p.source is not None])
        started = time.monotonic()
        error: LanceSinkError
        try:
            payload = self._encoder.encode(
                position, self.epoch, self.shard, self._schema, batches, sources
            )
            self.wal.append(position, payload)
        except AlreadyExists as exc:
            error = Fenced(
                "a newer writer took the next WAL position", shard=self.shard, position=position
            )
            error.__cause__ = exc
            self.poison(error)
            self._fail(puts, error)
            return
        except Exception as exc:  # noqa: BLE001 - any storage failure poisons (I6)
            error = Poisoned(f"WAL append failed: {exc}", shard=self.shard, position=position)
            error.__cause__ = exc
            self.poison(error)
            self._fail(puts, error)
            return
        seconds = time.monotonic() - started
        with self._lock:
            self._pending_bytes -= sum(p.nbytes for p in puts)
            self._pending_rows -= sum(p.rows for p in puts)
            self._next_position = position + 1
            self._memtables.insert(batches, position, sources, replay=False)
            self._memtables.honour_seal_request()
        self._counters["wal_entries"] += 1
        self._counters["wal_bytes"] += payload.size
        self.events.wal_appended(self.shard, seconds, payload.size, rows)
        durable_at = time.monotonic()
        for put in puts:
            put.future.set_result(PutResult(position, put.rows, durable_at))

    def _schedule_flush(self) -> None:
        """After a seal: flush on the pool once the writer is live (replay flushes inline)."""
        if self._task is not None:
            self._flush.schedule()

    # ------------------------------------------------------------------ poison / fence

    def poison(self, error: LanceSinkError) -> None:
        """Make `error` terminal for this writer (I6): fail every buffered put with it; every
        later put and read raises it, and nothing more is acknowledged or flushed (a flush
        already running finishes). The first error stays; later calls do nothing.

        Called by the WAL step (an append failed, or found its position taken), the
        flushes (a fence, or `flush_max_attempts` failures) and the fence probe; a caller
        may poison a writer to stop it at an instant as a crash would (nothing buffered is
        written), then `close` it: recovery is close-and-reopen.
        """
        with self._lock:
            if self._poison is not None:
                return
            self._poison = error
            pending, self._pending = self._pending, []
            self._pending_bytes = self._pending_rows = 0
            self._memtables.account()
        self._fail(pending, error)
        self.memory.notify()
        self.events.poisoned(self.shard, error)
        event = "shard_fenced" if isinstance(error, Fenced) else "shard_poisoned"
        self.log.error(event, epoch=self.epoch, error=str(error))

    @staticmethod
    def _fail(puts: list[_Put], error: BaseException) -> None:
        for put in puts:
            if not put.future.done():
                put.future.set_exception(error)

    def _maybe_check_fence(self) -> None:
        """Probe the manifest for a newer epoch (at most every fence_check_interval)."""
        now = time.monotonic()
        if self._poison is not None or now - self._last_fence_check < max(
            self.config.fence_check_interval_s, 0.0
        ):
            return
        self._last_fence_check = now
        self._probe_fence()

    def probe_fence(self) -> None:
        """Probe the manifest now (storage I/O) and poison the writer if a newer writer
        claimed the shard (the engine's claim-board sweep calls it for the shards a claim
        names); a failed probe is logged, not raised."""
        if self._poison is None:
            self._probe_fence()

    def _probe_fence(self) -> None:
        try:
            superseded = self._flush.superseded()
        except Exception as exc:  # noqa: BLE001 - a failed probe is retried, not fatal
            self.log.warning("fence_check_failed", error=str(exc))
            return
        if superseded:
            self.poison(Fenced("a newer writer claimed the shard", shard=self.shard))

    def check_fence(self) -> None:
        """Raise `Fenced` (and poison) if a newer writer claimed the shard."""
        self._maybe_check_fence()
        if self._poison is not None:
            raise self._poison

    # ------------------------------------------------------------------ reads

    def view(self) -> ShardView:
        """The visible memtables, newest first. Raises the poison error (I5, I6)."""
        if self._poison is None and self.config.fence_check_interval_s <= 0:
            self._maybe_check_fence()  # strict: every read probes (see the module docstring)
        if self._poison is not None:
            raise self._poison
        with self._lock:
            return self._memtables.view(self._flush.dropped_through)

    # ------------------------------------------------------------------ close / stats

    def seal(self, *, closing: bool = False) -> None:
        """Force-seal the active memtable (drain/close/revoke ignore `may_seal`).

        `closing`: no put is accepted from now on (the writer is about to close), and when
        nothing is left buffered the flush that empties the frozen queue also records the
        release (one manifest write for both). A drain seals every shard so before closing
        any: the closes wait for free threads, and most shards' flushes end before theirs
        starts (a thousand shards on S3 then wrote each manifest twice)."""
        with self._lock:
            if closing:
                self._closing = True
            if self._memtables.active.rows and self._poison is None:
                self._memtables.seal(reason="forced")
            if self._closing and not self._pending and not self._memtables.active.rows:
                # Stays true: a closing writer takes no put, and only puts fill these.
                self._flush.release_when_flushed()
        if closing:
            self._wake_wal()  # writes what is buffered at once (`_next_wake` while closing)

    def wait_flushed(self, timeout: float) -> bool:
        """Wait until no frozen memtable is left (or the writer is poisoned)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._memtables.frozen or self._poison is not None:
                    return not self._memtables.frozen
            self._flush.wait_idle(min(0.05, max(deadline - time.monotonic(), 0)))
            time.sleep(0.001)
        with self._lock:
            return not self._memtables.frozen

    def close(self, *, flush: bool = True, timeout: float = 30.0, wait_trims: bool = True) -> None:
        """Stop accepting puts, write what is buffered, seal, and optionally flush (bounded).

        Always safe to call, also on a poisoned writer; idempotent. Without `flush` (a
        revoked or lost partition, closed in the consumer's rebalance callback) a WAL trim
        still queued or running is not waited for: it deletes only entries at or below the
        flushed position, which no replay reads, and deleting is idempotent, so it may
        overlap the next owner's replay and trims. (The trim threads serve every shard:
        a revoke waited behind other shards' trims, 35 s seen on S3.) With `flush`, the
        shard is released (all its rows in the table) before the wait for its trims, which
        `wait_trims=False` skips (a drain: the next owner's first flush deletes what a trim
        cancelled at the engine's close left).
        """
        if self._closed:
            return
        with self._lock:
            self._closing = True
        self._finish_wal(timeout)
        if flush and self._poison is None:
            self.seal()  # closing: with nothing buffered, the last flush records the release
            if not self.wait_flushed(timeout):
                self.log.warning("close_flush_incomplete", frozen=len(self._memtables.frozen))
        # Whatever is still frozen is left to the next owner's replay; a flush already
        # running finishes first, so two owners never flush the same memtable.
        self._flush.abandon()
        if not self._flush.wait_idle(timeout):
            self.log.warning("close_flush_still_running")
        if flush:
            with self._lock:
                drained = (
                    self._poison is None
                    and not self._pending
                    and not self._memtables.frozen
                    and not self._memtables.active.rows
                )
            if drained and not self._flush.manifest.released:
                self._flush.release()  # every row in the table: other pods ask nobody for it
        if flush and wait_trims:
            try:
                self._flush.wait_trimmed(timeout)
            except TimeoutError:
                self.log.warning("close_wal_trim_still_running")
        self.controller.unregister(self.memory)
        self.memory.closed = True
        self.memory.notify()
        self._closed = True
        self.log.info(
            "shard_closed", epoch=self.epoch, flushed_position=self._flush.flushed_position
        )

    def _finish_wal(self, timeout: float) -> None:
        """Close: let the WAL steps write what is buffered, then leave the scheduler. With
        the scheduler stopped (the engine closed first) the steps run on this thread."""
        task, scheduler = self._task, self._scheduler
        if task is None or scheduler is None:
            return
        scheduler.wake(task)
        deadline = time.monotonic() + timeout
        while not self._wal_done.wait(0.1):
            if time.monotonic() >= deadline:
                self.log.warning("close_wal_incomplete", pending=len(self._pending))
                break
            if scheduler.closed:
                scheduler.unregister(task)
                while not self._wal_done.is_set() and time.monotonic() < deadline:
                    if task.state == ScheduledShard.RUNNING:  # a worker not yet stopped
                        time.sleep(0.01)
                    else:
                        self._wal_step()
                break
        scheduler.unregister(task)

    @property
    def durable_offsets(self) -> dict[tuple[str, int], int]:
        """Last durable source offset per (topic, partition): resume at value + 1."""
        with self._lock:
            return dict(self._memtables.durable_offsets)

    @property
    def epoch(self) -> int:
        """The epoch this writer claimed in the shard manifest."""
        return self._flush.epoch

    @property
    def poisoned(self) -> LanceSinkError | None:
        return self._poison

    def stats(self) -> ShardStats:
        """Counters and cursors; never raises (readable when poisoned or closed)."""
        flush, memtables = self._flush, self._memtables
        with self._lock:
            frozen = list(memtables.frozen)
            active = memtables.active
            return ShardStats(
                shard=self.shard,
                epoch=self.epoch,
                generation=active.generation,
                rows=active.rows,
                bytes=active.memory_size,
                index_bytes=sum(m.index_bytes + m.cache_bytes for m in [active, *frozen]),
                frozen_count=len(frozen),
                frozen_bytes=sum(m.memory_size for m in frozen),
                durable_position=memtables.durable_position,
                visible_position=memtables.durable_position,
                flushed_position=flush.flushed_position,
                durable_offsets=dict(memtables.durable_offsets),
                flushed_offsets=dict(flush.flushed_offsets),
                wal_entries_total=self._counters["wal_entries"],
                wal_bytes_total=self._counters["wal_bytes"],
                flushes_total=flush.flushes_total,
                flush_failures_total=flush.flush_failures_total,
                flushed_rows_total=flush.flushed_rows_total,
                replayed_rows=self._counters["replayed_rows"],
                replay_seconds=self._replay_seconds,
                poisoned=None if self._poison is None else str(self._poison),
            )
