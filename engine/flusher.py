"""Flushes: the pool shared by every shard writer of a process (`Flusher`), and one shard's
flushes with what they have flushed (`ShardFlush`: the shard manifest, the flushed position
and offsets, the Lance version checked for other writers' flushes).

Lifecycle (who calls what, and when):

- `ShardFlush.claim(...)` (`ShardWriter.open`, once, before replay) claims a new epoch in the
  shard manifest (I5) and finds the flushed watermark: the manifest's, or for the crash
  window (the Lance commit landed, the manifest update did not) the newest Lance commit of
  the shard, which it writes into the manifest. A storage failure raises out of it, and the
  writer's open with it.
- `schedule()` (the writer, under its lock, when it seals a memtable) queues the shard for
  its table's next flush round (`engine.coalesce.FlushCoalescer`) unless it is queued or
  in a round already: a round commits the oldest frozen memtable of each shard waiting
  then in one Lance commit, paced per table (`flush.max_commits_per_s`), so frozen
  memtables still flush oldest first, one at a time per shard. `drain_inline()` (replay,
  I4) flushes them on the caller's thread, each in its own commit.
- A shard's flush is three steps called by the round: `prepare` (the fence checks and the
  memtable's rows after what a stale writer flushed of it meanwhile, with its flush
  record), the round's commit (the flush records of all its shards in the properties),
  `finish` (advance the manifest: flushed position and offsets, Lance version, next
  generation; hand the WAL trim to the `Flusher`'s trim thread; only then does the
  memtable leave the frozen queue, so its rows never leave the writer's view before the
  base holds them). `settle` queues it again or marks it idle.
- A failed flush (`failed`) keeps its memtable frozen and counted (I8) and is retried with
  backoff (`retry_initial_s`, doubling up to `retry_max_s`, counted per shard also when the
  commit held other shards); after `max_attempts` failures in a row, or at once on a fence
  (`Fenced`: a newer epoch flushed the shard, or claimed it first, or wrote our next
  manifest version), the writer is poisoned (I6) and it is not queued again.
- `abandon()` (the writer's close) takes the shard out of the queue; a flush already in a
  round finishes first (`wait_idle`), so two owners never flush the same memtable, and
  what is left frozen is replayed by the next owner. A WAL trim may outlive the writer
  (`wait_trimmed` bounds the wait for it): it deletes only flushed entries, which no replay
  reads.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import lance
import pyarrow as pa
import structlog

from engine.backpressure import ShardMemory
from engine.coalesce import CoalesceLimits, FlushCoalescer
from engine.errors import Fenced, LanceSinkError, Poisoned
from engine.manifest import ManifestStore, ShardManifest, ShardOrigin
from engine.memtable import Memtable
from engine.shard_stats import EngineEvents
from engine.table import BaseTable, FlushMark, FlushRecord, commit_properties
from engine.threads import name_os_thread
from engine.wal import Wal

log = structlog.get_logger("lance_sink.engine")

#: Threads that run a flush round's per-shard steps at once (each a few storage round trips:
#: on S3 a thousand shards one after another took longer than a drain may).
SHARD_IO_THREADS = 8
#: Threads that trim flushed WAL entries (a listing and a bulk delete each: a drain of a
#: thousand shards on S3 waited for them one after another). Two trims of one shard may
#: overlap: each deletes only entries at or below its position, and deleting is idempotent.
TRIM_THREADS = 4


class Flusher:
    """The shared pool that runs flush rounds (one driver at a time per table, see
    `engine.coalesce`) with the threads of a round's per-shard steps, and a few threads
    that trim flushed WAL entries so deleting files (slow on a discard-mounted disk, a
    round trip on S3) never delays the next flush. `coalesce` paces and sizes each table's
    flush commits."""

    def __init__(self, workers: int = 1, coalesce: CoalesceLimits | None = None) -> None:
        self._pool = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="flush", initializer=name_os_thread
        )
        self._trimmer = ThreadPoolExecutor(
            max_workers=TRIM_THREADS, thread_name_prefix="wal-trim", initializer=name_os_thread
        )
        # A round's per-shard steps (fence checks, manifest updates): storage round trips.
        self._shard_io = ThreadPoolExecutor(
            max_workers=SHARD_IO_THREADS, thread_name_prefix="flush-io", initializer=name_os_thread
        )
        self.limits = coalesce or CoalesceLimits()
        self._coalescers: dict[BaseTable, FlushCoalescer] = {}
        self._lock = threading.Lock()
        self._leaving_trims = False

    def submit(self, fn: Callable[[], None]) -> None:
        self._pool.submit(fn)

    def coalescer(self, table: BaseTable) -> FlushCoalescer:
        """The flush rounds of `table` in this process (made on first use)."""
        with self._lock:
            coalescer = self._coalescers.get(table)
            if coalescer is None:
                coalescer = FlushCoalescer(table, self.submit, self.limits, self._shard_io)
                self._coalescers[table] = coalescer
            return coalescer

    def trim(self, fn: Callable[[], None]) -> Future[None]:
        """Run the WAL trim `fn` on a trim thread (not at all once `leave_trims`)."""

        def run() -> None:
            if not self._leaving_trims:
                fn()

        return self._trimmer.submit(run)

    def leave_trims(self) -> None:
        """Run no WAL trim from now on, queued ones included (a drain: they delete only
        flushed entries, which the next owner's first flush deletes; on S3 a thousand
        shards' trims competed with the drain's manifest writes)."""
        self._leaving_trims = True

    def shutdown(self, *, cancel_trims: bool = False) -> None:
        """Stop the threads once their work is done; `cancel_trims` drops the WAL trims not
        started yet (they delete only flushed entries: the next owner's first flush trims
        them)."""
        self._pool.shutdown(wait=True)
        self._shard_io.shutdown(wait=True)
        self._trimmer.shutdown(wait=True, cancel_futures=cancel_trims)


def _key(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


def _unkey(key: str) -> tuple[str, int]:
    topic, _, partition = key.rpartition(":")
    return topic, int(partition)


@dataclass(slots=True)
class PendingFlush:
    """One shard's part of a flush commit (`ShardFlush.prepare`): its oldest frozen memtable,
    the rows to write (after what was flushed already) and its flush record."""

    shard: ShardFlush
    memtable: Memtable
    upserts: list[pa.RecordBatch]
    deletes: pa.Table | None
    record: FlushRecord
    rows: int
    nbytes: int
    started: float


class ShardFlush:
    """One shard's flushes (see the module docstring), owned by its `ShardWriter`.

    It shares the writer's lock and frozen queue: `flushed_position`, `flushed_offsets`,
    `dropped_through` and the memtables' flush state change under that lock, and the writer
    reads them under it. The writer's poison is asked through `poisoned` and set through
    `poison`; `account` recomputes the writer's memory accounting (called under the lock
    when a flushed memtable leaves the queue).
    """

    def __init__(
        self,
        shard: str,
        table: BaseTable,
        wal: Wal,
        manifests: ManifestStore,
        flusher: Flusher,
        events: EngineEvents,
        memory: ShardMemory,
        *,
        lock: threading.RLock,
        frozen: deque[Memtable],
        poisoned: Callable[[], LanceSinkError | None],
        poison: Callable[[LanceSinkError], None],
        account: Callable[[], None],
        retry_initial_s: float,
        retry_max_s: float,
        max_attempts: int,
    ) -> None:
        self.shard = shard
        self.table = table
        self.wal = wal
        self.manifests = manifests
        self.flusher = flusher
        self.events = events
        self.memory = memory
        self.log = log.bind(shard=shard)
        self._lock = lock
        self._frozen = frozen
        self._poisoned = poisoned
        self._poison = poison
        self._account = account
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._max_attempts = max_attempts
        #: The epoch this writer claimed (0 until `claim`).
        self.epoch = 0
        self.manifest = ShardManifest()
        # Held while writing a manifest version and assigning it, and while probing for a
        # newer one: a probe must never see our own write before we know of it.
        self._manifest_lock = threading.Lock()
        self.flushed_position = 0
        self.flushed_offsets: dict[tuple[str, int], int] = {}
        #: The newest table version holding a memtable no longer in the writer's view (see
        #: `ShardView.dropped_through`).
        self.dropped_through = 0
        self._checked_lance_version = 0
        self._coalescer = flusher.coalescer(table)
        #: Queued or in a round (set by `schedule`, cleared when settled idle or abandoned).
        self._running = False
        #: In a round (or `drain_inline`) between `prepare` and `settle`.
        self._in_round = False
        self._abandoned = False
        self._release_when_flushed = False
        self._attempts = 0
        self._delay = retry_initial_s
        #: Not flushed again before this `time.monotonic()` (backoff after a failure).
        self.retry_at = 0.0
        #: When its current wait for a round began (rounds take the longest waiting first).
        self.waiting_since = 0.0
        self._idle = threading.Event()
        self._idle.set()
        self._trimmed: Future[None] = Future()
        self._trimmed.set_result(None)
        self.flushes_total = 0
        self.flush_failures_total = 0
        self.flushed_rows_total = 0

    # ------------------------------------------------------------------ claim / fence

    def claim(self, advertised_url: str, origin: ShardOrigin | None = None) -> ShardManifest:
        """Claim the shard with a new epoch (recording `origin`, see `ManifestStore.claim`)
        and find the flushed watermark (see the module docstring); returns the manifest the
        writer starts from."""
        manifest = self.manifests.claim(advertised_url, origin)
        self.epoch = manifest.epoch
        mark = self.table.find_flush(self.shard, manifest.lance_version)
        if mark is not None and mark.wal_end > manifest.flushed_position:
            # Crash window: the Lance commit landed, the manifest update did not.
            manifest = self.manifests.advance(
                manifest,
                flushed_position=mark.wal_end,
                flushed_offsets={**manifest.flushed_offsets, **mark.offsets},
                lance_version=mark.version,
                generation=max(manifest.generation, mark.generation + 1),
            )
        self.manifest = manifest
        self._checked_lance_version = max(manifest.lance_version, mark.version if mark else 0)
        self.dropped_through = self._checked_lance_version
        self.flushed_position = manifest.flushed_position
        self.flushed_offsets = {_unkey(k): v for k, v in manifest.flushed_offsets.items()}
        return manifest

    def release(self) -> None:
        """Record in the manifest that the shard's rows are all in the Lance table and no
        process serves it (`ShardManifest.released`), as the last act of a clean close.
        Best effort: a newer claim (fenced) or a failed write leaves the manifest as it
        was, which only makes other pods' answers name the shard as missing."""
        with self._manifest_lock:
            try:
                self.manifest = self.manifests.advance(self.manifest, owner_url="", released=True)
            except Exception as exc:  # noqa: BLE001 - see above
                self.log.info("shard_release_not_recorded", error=str(exc))

    def release_when_flushed(self) -> None:
        """The writer is closing with nothing left to put: the flush that empties the
        frozen queue also records the release (one manifest write for both; a drain of a
        thousand shards on S3 wrote each twice)."""
        with self._lock:
            self._release_when_flushed = True

    def superseded(self) -> bool:
        """True if a newer writer claimed the shard (probes the manifest: storage I/O)."""
        with self._manifest_lock:
            return self.manifests.superseded(self.manifest)

    # ------------------------------------------------------------------ flushes

    def schedule(self) -> None:
        """Queue the shard for the next flush round of its table (`engine.coalesce`) unless
        it is queued or in a round (the caller holds the lock)."""
        if not self._running:
            self._running = True
            self._idle.clear()
            self.waiting_since = time.monotonic()
            self._coalescer.ready(self)

    def drain_inline(self) -> None:
        """Flush every frozen memtable on this thread, each in its own commit (replay);
        raises the poison error."""
        while True:
            with self._lock:
                if not self._frozen:
                    return
            try:
                ds = self.table.dataset()
                part = self.prepare(int(ds.version), self.flush_mark(ds))
                if part is None:
                    break
                version = None
                if part.rows:
                    props = commit_properties([part.record])
                    version = self.table.commit_flush(
                        part.upserts, part.deletes, props, part.memtable
                    )
                self.finish(part, version)
            except Exception as exc:  # noqa: BLE001 - retried, then poisons (I6)
                self.failed(exc)
                if self._poisoned() is None:
                    time.sleep(max(self.retry_at - time.monotonic(), 0.0))
            finally:
                with self._lock:
                    self._in_round = False
        error = self._poisoned()
        if error is not None:
            raise error

    def abandon(self) -> None:
        """Start no further flush: what is frozen is left to the next owner's replay. A
        queued shard leaves the queue at once; one in a round finishes its flush first."""
        with self._lock:
            self._abandoned = True
            if self._running and not self._in_round:
                self._coalescer.discard(self)
                self._running = False
                self._idle.set()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the shard is neither queued nor in a round; False if it still was
        after `timeout`."""
        return self._idle.wait(timeout)

    def wait_trimmed(self, timeout: float) -> None:
        """Wait for the last WAL trim handed to the trim thread.

        Raises:
            TimeoutError: it was still queued or running after `timeout`.
        """
        self._trimmed.result(timeout)

    def frozen_size(self) -> tuple[int, int]:
        """(rows, data bytes) of the oldest frozen memtable, the one a round takes (an
        upper bound of what it commits: a stale writer may have flushed part of it)."""
        with self._lock:
            if not self._frozen:
                return 0, 0
            return self._frozen[0].rows, self._frozen[0].data_bytes

    def flush_mark(self, ds: lance.LanceDataset) -> FlushMark | None:
        """The newest flush of this shard in `ds` above the version checked last (a stale
        writer's, or ours): what `prepare` checks. Reads `ds`, which one thread at a time
        may use (pylance: "Already mutably borrowed"), so a round calls it on its driver.

        Raises:
            Exception: storage failed (a failed attempt: `failed`).
        """
        return self.table.find_flush(self.shard, self._checked_lance_version, ds)

    def prepare(self, version: int, mark: FlushMark | None) -> PendingFlush | None:
        """This shard's part of a flush commit (a round, or `drain_inline`): its oldest frozen
        memtable's rows after what is flushed (by us, or by a stale writer meanwhile), with
        its flush record; None when there is nothing to flush (no frozen memtable, poisoned,
        abandoned). `version` is the table version the round checks (also for other shards)
        and `mark` this shard's newest flush in it (`flush_mark`). Touches no dataset, so a
        round prepares its shards on several threads.

        Raises:
            Fenced: a newer writer flushed the shard or claimed it (I3, I5).
            Exception: storage failed (a failed attempt: `failed`).
        """
        with self._lock:
            if not self._frozen or self._poisoned() is not None or self._abandoned:
                return None
            self._in_round = True
            memtable = self._frozen[0]
            # Readers that open a base above this version must ask whether it holds us.
            memtable.commit_floor = version
        started = time.monotonic()
        already = self.flushed_position
        # A stale writer may have flushed part of this memtable after we replayed it.
        if mark is not None:
            if mark.epoch > self.epoch:
                raise Fenced("a newer writer flushed this shard", shard=self.shard)
            self._checked_lance_version = mark.version
            already = max(already, mark.wal_end)
        if self.superseded():
            raise Fenced("a newer writer claimed the shard", shard=self.shard)
        offsets = {_key(s.topic, s.partition): s.last for s in memtable.sources}
        upserts: list[pa.RecordBatch] = []
        deletes: pa.Table | None = None
        if memtable.last_position > already:
            upserts, deletes = memtable.flush_data(after_position=already)
        rows = sum(b.num_rows for b in upserts) + (deletes.num_rows if deletes else 0)
        nbytes = sum(b.nbytes for b in upserts) + (deletes.nbytes if deletes else 0)
        record = FlushRecord(
            self.shard, self.epoch, memtable.generation, memtable.last_position, offsets
        )
        return PendingFlush(self, memtable, upserts, deletes, record, rows, nbytes, started)

    def finish(self, part: PendingFlush, version: int | None) -> None:
        """After the commit of `part` at `version` (None: nothing was left to commit):
        advance the manifest, hand the WAL trim over, and drop the memtable from the frozen
        queue, so its rows never leave the writer's view before the base holds them.

        Raises:
            Exception: the manifest update failed (a failed attempt: `failed`; the retry
                finds the flush mark in the table and commits nothing).
        """
        memtable = part.memtable
        if version is None:
            version = self.manifest.lance_version
        else:
            self._checked_lance_version = max(self._checked_lance_version, version)
        with self._lock:
            # Readers that open the base at `version` or later must skip this memtable.
            memtable.committed_version = version
        offsets = part.record.offsets
        flushed_offsets = {**self.manifest.flushed_offsets, **offsets}
        with self._lock:
            last = self._release_when_flushed and len(self._frozen) == 1
        released: dict[str, object] = {"owner_url": "", "released": True} if last else {}
        with self._manifest_lock:
            self.manifest = self.manifests.advance(
                self.manifest,
                collect=False,  # on the trim thread: a listing and a delete
                flushed_position=memtable.last_position,
                flushed_offsets=flushed_offsets,
                lance_version=version,
                generation=memtable.generation + 1,
                **released,
            )
        manifest_version = self.manifest.version
        with self._lock:
            self.flushed_position = memtable.last_position
            self.flushed_offsets = {_unkey(k): v for k, v in flushed_offsets.items()}
        self._trimmed = self.flusher.trim(
            lambda: self._trim_wal(memtable.last_position, manifest_version)
        )
        with self._lock:
            self._frozen.popleft()
            self.dropped_through = max(self.dropped_through, version)
            self._account()
        self.memory.notify()
        self._attempts = 0
        self._delay = self._retry_initial_s
        self.retry_at = 0.0
        self.waiting_since = time.monotonic()  # its next memtable queues behind the others
        seconds = time.monotonic() - part.started
        self.flushes_total += 1
        self.flushed_rows_total += part.rows
        self.events.flushed(self.shard, seconds, part.rows)
        self.log.info(
            "memtable_flushed",
            generation=memtable.generation,
            rows=part.rows,
            wal_end=memtable.last_position,
            lance_version=version,
            seconds=round(seconds, 3),
        )

    def failed(self, exc: Exception) -> None:
        """A flush attempt of this shard failed with `exc`: a fence poisons the writer at
        once; anything else is retried after a backoff (`retry_at`), and poisons it after
        `max_attempts` failed attempts in a row (I6). The memtable stays frozen (I8)."""
        if isinstance(exc, Fenced):
            self._poison(exc)
            return
        self._attempts += 1
        self.flush_failures_total += 1
        self.events.flush_failed(self.shard, exc)
        with self._lock:
            generation = self._frozen[0].generation if self._frozen else None
        self.log.warning(
            "flush_failed", generation=generation, attempt=self._attempts, error=str(exc)
        )
        if self._attempts >= self._max_attempts:
            error = Poisoned(
                f"flush failed {self._attempts} times: {exc}",
                shard=self.shard,
                generation=generation,
            )
            error.__cause__ = exc
            self._poison(error)
            return
        self.retry_at = time.monotonic() + self._delay
        self._delay = min(self._delay * 2, self._retry_max_s)

    def settle(self, coalescer: FlushCoalescer) -> None:
        """After a round that took the shard: queue it again while it has frozen memtables
        to flush, else it is idle."""
        with self._lock:
            self._in_round = False
            if not self._running:
                return  # abandoned while it waited for the round
            if self._frozen and self._poisoned() is None and not self._abandoned:
                coalescer.ready(self)
                return
            self._running = False
            self._idle.set()

    def _trim_wal(self, position: int, manifest_version: int) -> None:
        """Delete WAL entries the manifest says are flushed (at or below `position`), and
        manifest versions before the one preceding `manifest_version`."""
        try:
            self.wal.delete_through(position)
            self.manifests.collect(manifest_version)
        except Exception as exc:  # noqa: BLE001 - trimming is retried by the next flush
            self.log.warning("wal_trim_failed", error=str(exc))
