"""The shard writer: one per topic-partition, the single owner of a shard's WAL and memtables.

Lifecycle (who calls what, and when):

- `ShardWriter.open(...)` (the sink, on assign; tests directly) claims a new epoch in the
  shard manifest (I5), finds the flushed watermark (manifest, and for the crash window the
  newest Lance commits), replays the WAL entries after it into memtables with the live
  seal predicate, flushing as it goes (I4), and writes a fence entry at the next WAL
  position. It returns a writer whose `durable_offsets` say where the source must resume:
  **resume after the last durable offset**, i.e. at `durable_offsets[(topic, p)] + 1`.
  If open raises, nothing was acknowledged by this writer and it holds no threads.
- `put(batch, source_range)` (the consumer loop) validates the batch, asks the
  backpressure controller for admission, and buffers it for the next WAL entry; it returns
  a future that resolves once the rows are durable **and** visible (one step: rows enter the
  memtable only after their WAL entry is durable, I2). `put` raises `InvalidRecord` (bad
  batch; nothing accepted), `Backpressure` (refused; nothing accepted) or the poison error.
- The WAL thread (internal) group-commits buffered puts every `max_wal_flush_interval`
  (or when `max_wal_buffer_size` is reached), appends the entry create-only, inserts the
  rows into the active memtable (sealing it first when `should_seal` says so, and after
  when `is_full` says it reached a limit, if the controller's `may_seal` allows; a refused
  seal is asked again at every wake of the WAL thread and by the next put), and resolves
  the futures in put order.
- Flushes run on the shared `Flusher` pool, oldest frozen memtable first, one at a time per
  shard. A failed flush keeps its memtable frozen and counted (I8) and is retried with
  backoff; after `max_attempts` the writer is poisoned (I6).
- `view()` (readers) returns the visible memtables; fails with the poison error. With
  `fence_check_interval_s` = 0 it first probes the manifest for a fence (storage I/O on
  every read); otherwise it does no I/O and relies on the WAL thread, which probes at most
  that often while idle (a busy writer finds a fence at its next append).
- `close(flush=...)` (the sink on revoke/shutdown; always called, also after poisoning)
  stops accepting puts, writes what is buffered, force-seals the active memtable and,
  with `flush=True`, waits (bounded) for every frozen memtable to flush; what is left is
  replayed by the next owner. `stats()` stays readable after close and poisoning.

A fence (a newer epoch appended at our next WAL position, or wrote our next manifest
version) or a persistence failure poisons the writer: every later put and read raises
`Fenced` or `Poisoned`, and nothing more is acknowledged.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import lance
import pyarrow as pa
import structlog

from engine.backpressure import BackpressureController, ShardMemory
from engine.errors import (
    Backpressure,
    Fenced,
    LanceSinkError,
    PersistenceError,
    Poisoned,
)
from engine.manifest import ManifestStore, ShardManifest
from engine.memtable import (
    Memtable,
    MemtableView,
    SealLimits,
    entry_batches,
    is_full,
    should_seal,
)
from engine.schema import TableSpec
from engine.storage import AlreadyExists, Storage, canonical_uri, uri_spellings
from engine.table import BaseTable, flush_properties, holds_generation
from engine.threads import name_os_thread
from engine.wal import EntryEncoder, SourceRange, Wal, WalEntry, merge_ranges

log = structlog.get_logger("lance_sink.engine")

#: How often an idle WAL thread wakes to probe for a fence (when the interval allows).
IDLE_WAKE_S = 0.5


def shard_id(table_uri: str, topic: str, partition: int) -> str:
    """The shard of a topic-partition feeding a table: deterministic and readable.

    The table is identified by its location, `canonical_uri(table_uri)`, so every spelling
    of it (relative or absolute, trailing slash, file://, doubled slashes in an object-store
    key) names the same shard. For a URI already canonical (an absolute path without a
    trailing slash, ``s3://bucket/key`` without empty segments) the id is the one older
    versions gave it; for others see `legacy_shard_ids`.
    """
    return _digest_id(canonical_uri(table_uri), topic, partition)


def legacy_shard_ids(
    table_uri: str, topic: str, partition: int, *, spellings: bool = False
) -> list[str]:
    """Ids older versions gave this shard (they hashed `table.uri` exactly as written), in
    the order to look for their state: the URI as written, then, with `spellings`, every
    other common spelling of the same location (`uri_spellings`). Only ids that differ
    from `shard_id` are listed.

    `spellings` is safe only where the WAL storage is the table's own (the default
    `<table.uri>/_lance_sink`): shard state found there belongs to this table whatever
    spelling named it, while a WAL storage shared by several tables could hold another
    table's shard under a relative spelling that happens to match.
    """
    canonical = canonical_uri(table_uri)
    current = _digest_id(canonical, topic, partition)
    candidates = [table_uri, *(uri_spellings(canonical) if spellings else [])]
    out: list[str] = []
    for uri in candidates:
        legacy = _digest_id(uri, topic, partition)
        if legacy != current and legacy not in out:
            out.append(legacy)
    return out


def _digest_id(uri: str, topic: str, partition: int) -> str:
    digest = hashlib.sha256(f"{uri}\0{topic}\0{partition}".encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in topic)[:80]
    return f"{safe}-{partition}-{digest}"


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


class EngineEvents(Protocol):
    """Domain events the engine reports (the sink's metrics facade implements this)."""

    def wal_appended(self, shard: str, seconds: float, nbytes: int, rows: int) -> None: ...
    def memtable_sealed(self, shard: str, generation: int, rows: int, nbytes: int) -> None: ...
    def flushed(self, shard: str, seconds: float, rows: int) -> None: ...
    def flush_failed(self, shard: str, error: BaseException) -> None: ...
    def replayed(self, shard: str, seconds: float, rows: int, nbytes: int) -> None: ...
    def poisoned(self, shard: str, error: BaseException) -> None: ...


class NoEvents:
    """EngineEvents that records nothing."""

    def wal_appended(self, shard: str, seconds: float, nbytes: int, rows: int) -> None:
        return None

    def memtable_sealed(self, shard: str, generation: int, rows: int, nbytes: int) -> None:
        return None

    def flushed(self, shard: str, seconds: float, rows: int) -> None:
        return None

    def flush_failed(self, shard: str, error: BaseException) -> None:
        return None

    def replayed(self, shard: str, seconds: float, rows: int, nbytes: int) -> None:
        return None

    def poisoned(self, shard: str, error: BaseException) -> None:
        return None


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a resolved put future carries: the WAL entry position, the rows, and when
    (`time.monotonic()`) they became durable and visible."""

    position: int
    rows: int
    durable_at: float


@dataclass(frozen=True, slots=True)
class ShardStats:
    """A snapshot of one shard writer's state (readable after close and poisoning)."""

    shard: str
    epoch: int
    generation: int
    rows: int
    bytes: int
    index_bytes: int
    frozen_count: int
    frozen_bytes: int
    durable_position: int
    visible_position: int
    flushed_position: int
    durable_offsets: dict[tuple[str, int], int]
    flushed_offsets: dict[tuple[str, int], int]
    wal_entries_total: int
    wal_bytes_total: int
    flushes_total: int
    flush_failures_total: int
    flushed_rows_total: int
    replayed_rows: int
    replay_seconds: float
    poisoned: str | None


@dataclass(frozen=True, slots=True)
class ShardView:
    """The visible memtables of a shard, newest first (active, then frozen newest-first)."""

    shard: str
    memtables: tuple[MemtableView, ...]
    #: The newest table version holding a memtable that is no longer in the view (flushed
    #: and dropped, or flushed by an earlier writer before this one replayed). A base
    #: version below it lacks rows the view lacks too: `fresh` is only exact for a base at
    #: or above it, which a view taken before the base always is (fan-out reads, whose owner
    #: takes its view after the coordinator opened the base, check it).
    dropped_through: int = 0

    def fresh(self, base: lance.LanceDataset) -> list[MemtableView]:
        """The memtables whose rows the base table version `base` does not hold.

        Order matters: take the view first, then open `base`, then call this. A memtable
        flushed meanwhile stays in the view (so its rows cannot vanish between the tiers),
        and its live flush state says whether `base` holds it: committed at or below
        `base.version` → skipped; committing right now → the transactions above its floor
        decide; not committing → `base` cannot hold it.
        """
        out = []
        version = int(base.version)
        for view in self.memtables:
            m = view.memtable
            committed, floor = m.committed_version, m.commit_floor  # this order (see above)
            if committed is not None:
                if committed <= version:
                    continue
            elif floor is not None and holds_generation(base, self.shard, m.generation, floor):
                continue
            out.append(view)
        return out


@dataclass
class _Put:
    batch: pa.RecordBatch
    source: SourceRange | None
    future: Future[PutResult]
    nbytes: int
    rows: int
    arrived: float = field(default_factory=time.monotonic)


class Flusher:
    """The shared pool that runs flushes (one loop at a time per shard), and one thread that
    trims flushed WAL entries so deleting files (slow on a discard-mounted disk, a round
    trip per entry on S3) never delays the next flush."""

    def __init__(self, workers: int = 1) -> None:
        self._pool = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="flush", initializer=name_os_thread
        )
        self._trimmer = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="wal-trim", initializer=name_os_thread
        )

    def submit(self, fn: Callable[[], None]) -> None:
        self._pool.submit(fn)

    def trim(self, fn: Callable[[], None]) -> Future[None]:
        return self._trimmer.submit(fn)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self._trimmer.shutdown(wait=True)


def _key(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


def _unkey(key: str) -> tuple[str, int]:
    topic, _, partition = key.rpartition(":")
    return topic, int(partition)


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
        self._wake = threading.Condition(self._lock)
        self._schema = spec.batch_schema
        self._encoder = EntryEncoder()
        self._manifest = ShardManifest()
        # Held while writing a manifest version and assigning it, and while probing for a
        # newer one: a probe must never see our own write before we know of it.
        self._manifest_lock = threading.Lock()
        self._epoch = 0
        self._next_position = 1
        self._durable_position = 0
        self._flushed_position = 0
        self._durable_offsets: dict[tuple[str, int], int] = {}
        self._flushed_offsets: dict[tuple[str, int], int] = {}
        self._pending: list[_Put] = []
        self._pending_bytes = 0
        self._pending_rows = 0
        self._active = Memtable(spec, 1)
        self._frozen: deque[Memtable] = deque()
        self._poison: LanceSinkError | None = None
        self._closing = False
        self._closed = False
        self._flush_running = False
        self._abandon_flushes = False
        self._flush_idle = threading.Event()
        self._trimmed: Future[None] = Future()
        self._trimmed.set_result(None)
        self._flush_idle.set()
        self._checked_lance_version = 0
        self._dropped_through = 0
        self._last_fence_check = 0.0
        self._wal_thread: threading.Thread | None = None
        self._counters = {
            "wal_entries": 0,
            "wal_bytes": 0,
            "flushes": 0,
            "flush_failures": 0,
            "flushed_rows": 0,
            "replayed_rows": 0,
        }
        self._replay_seconds = 0.0

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
    ) -> ShardWriter:
        """Claim the shard, replay its WAL, fence older writers; see the module docstring.

        Raises:
            PersistenceError: storage failed during claim or replay (nothing acknowledged).
            Fenced: an even newer writer claimed the shard while this one replayed.
        """
        writer = cls(shard, spec, table, storage, config, controller, flusher, events)
        writer._claim_and_replay()
        writer.memory.on_seal_request(writer._wake_wal_thread)
        controller.register(writer.memory)
        writer._wal_thread = threading.Thread(
            target=writer._wal_loop, name=f"wal-{shard}", daemon=True
        )
        writer._wal_thread.start()
        return writer

    def _claim_and_replay(self) -> None:
        started = time.monotonic()
        manifest = self.manifests.claim(self.config.advertised_url)
        self._epoch = manifest.epoch
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
        self._manifest = manifest
        self._checked_lance_version = max(manifest.lance_version, mark.version if mark else 0)
        self._dropped_through = self._checked_lance_version
        self._flushed_position = manifest.flushed_position
        self._durable_position = manifest.flushed_position
        self._flushed_offsets = {_unkey(k): v for k, v in manifest.flushed_offsets.items()}
        self._durable_offsets = dict(self._flushed_offsets)
        self._active = Memtable(self.spec, manifest.generation)
        self.log.info("shard_claimed", epoch=self._epoch, flushed_position=self._flushed_position)

        rows = nbytes = 0
        position = self._flushed_position + 1
        present = set(self.wal.positions())
        while True:
            while position in present:
                entry = self.wal.read(position)
                self._apply_replayed(entry)
                rows += entry.num_rows
                nbytes += entry.nbytes
                position += 1
            # Fence: take the next position with an empty entry of our epoch. If an older
            # writer got there first, replay its entry too and try the next position.
            try:
                fence = self._encoder.encode(
                    position, self._epoch, self.shard, self._schema, [], []
                )
                self.wal.append(position, fence)
            except AlreadyExists:
                present.add(position)
                continue
            break
        self._next_position = position + 1
        self._durable_position = position
        self._active.insert([], position, [])
        self._set_memory()
        stale = [p for p in present if p <= self._flushed_position]
        if stale:
            self.wal.delete_through(max(stale))
        self._replay_seconds = time.monotonic() - started
        self._counters["replayed_rows"] = rows
        self.events.replayed(self.shard, self._replay_seconds, rows, nbytes)
        self.log.info(
            "shard_replayed",
            epoch=self._epoch,
            rows=rows,
            bytes=nbytes,
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
            sealed = self._insert_locked(batches, entry.position, entry.sources, replay=True)
        if sealed:
            # Bounded replay (I4): flush each sealed memtable before reading further.
            self._drain_flushes_inline()

    def _drain_flushes_inline(self) -> None:
        while self._frozen:
            memtable = self._frozen[0]
            self._flush_with_retries(memtable)
            if self._poison is not None:
                raise self._poison

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
            active = self._active
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
            self._set_memory()
            if len(self._pending) == 1 or self._pending_bytes >= self.config.max_wal_buffer_bytes:
                self._wake.notify_all()
        return put.future

    def _raise_if_unusable(self) -> None:
        if self._poison is not None:
            raise self._poison
        if self._closing:
            raise Poisoned("the shard writer is closed", shard=self.shard)

    # ------------------------------------------------------------------ WAL thread

    def _wake_wal_thread(self) -> None:
        with self._lock:
            self._wake.notify_all()

    def _idle(self) -> bool:
        return not self._pending and not self._closing and not self.memory.seal_required

    def _wal_loop(self) -> None:
        name_os_thread("wal")  # its Python name holds the shard: too long for the OS
        interval = self.config.max_wal_flush_interval_s
        while True:
            with self._lock:
                self._seal_if_due_locked()
                if self._idle():
                    self._wake.wait(timeout=IDLE_WAKE_S)
                    idle = self._idle()
                else:
                    idle = False
                if not idle:
                    if self._pending:
                        deadline = self._pending[0].arrived + interval
                        while (
                            not self._closing
                            and self._pending_bytes < self.config.max_wal_buffer_bytes
                            and (remaining := deadline - time.monotonic()) > 0
                        ):
                            self._wake.wait(timeout=remaining)
                    taken = self._take_group_locked()
                    if not taken:
                        self._honour_seal_request_locked()
                        if self._closing:
                            return
            if idle:
                self._maybe_check_fence()  # storage I/O: outside the writer lock
            elif taken:
                self._commit_group(taken)

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

    def _seal_if_due_locked(self) -> bool:
        """Seal the active memtable if it is full (`is_full`: it reached a seal limit) or
        its first row is `max_age_s` old, so a quiet partition's rows reach the Lance table
        (and other pods' queries) without waiting for another put: a full one at once, a
        slow one within about `max_age_s` plus one flush. Checked after every live insert
        and on every WAL-thread wake (at least every `IDLE_WAKE_S`); a seal the controller
        refuses now is asked again at the next. Returns True if it sealed."""
        active = self._active
        if not active.rows or self._poison is not None:
            return False
        if is_full(active.rows, active.memory_size, len(active.batches), self.config.limits):
            reason = "threshold"
        else:
            age = self.config.max_age_s
            first = active.first_insert_at
            if age <= 0 or first is None or time.monotonic() - first < age:
                return False
            reason = "age"
        if not self.controller.may_seal(self.memory):
            return False
        self._seal_locked(reason=reason)
        return True

    def _honour_seal_request_locked(self) -> None:
        """Seal the active memtable if a controller asked (ShardMemory.request_seal)."""
        if self.memory.seal_required:
            self.memory.seal_required = False
            if self._active.rows and self._poison is None:
                self._seal_locked(reason="requested")

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
                position, self._epoch, self.shard, self._schema, batches, sources
            )
            self.wal.append(position, payload)
        except AlreadyExists as exc:
            error = Fenced(
                "a newer writer took the next WAL position", shard=self.shard, position=position
            )
            error.__cause__ = exc
            self._poison_with(error)
            self._fail(puts, error)
            return
        except Exception as exc:  # noqa: BLE001 - any storage failure poisons (I6)
            error = Poisoned(f"WAL append failed: {exc}", shard=self.shard, position=position)
            error.__cause__ = exc
            self._poison_with(error)
            self._fail(puts, error)
            return
        seconds = time.monotonic() - started
        with self._lock:
            self._pending_bytes -= sum(p.nbytes for p in puts)
            self._pending_rows -= sum(p.rows for p in puts)
            self._next_position = position + 1
            self._insert_locked(batches, position, sources, replay=False)
            self._honour_seal_request_locked()
        self._counters["wal_entries"] += 1
        self._counters["wal_bytes"] += payload.size
        self.events.wal_appended(self.shard, seconds, payload.size, rows)
        durable_at = time.monotonic()
        for put in puts:
            put.future.set_result(PutResult(position, put.rows, durable_at))

    def _insert_locked(
        self,
        batches: list[pa.RecordBatch] | tuple[pa.RecordBatch, ...],
        position: int,
        sources: list[SourceRange] | tuple[SourceRange, ...],
        *,
        replay: bool,
    ) -> bool:
        """Insert a durable entry into the active memtable: sealing first if `should_seal`
        says so, and after if the memtable is then full (`is_full`), so a quiet partition's
        full memtable flushes without waiting for the next put. Shared by the live path and
        replay (I4). Before an insert the seal is unconditional (the live put that needed it
        asked `may_seal`); after it, replay seals outright as before an insert, the live path
        asks the controller (`_seal_if_due_locked`). Returns True if a seal happened."""
        active = self._active
        sealed = False
        if should_seal(
            active.rows,
            active.memory_size,
            len(active.batches),
            sum(b.num_rows for b in batches),
            sum(b.nbytes for b in batches),
            self.config.limits,
        ):
            self._seal_locked(reason="threshold")
            sealed = True
        self._active.insert(batches, position, sources)
        self._durable_position = position
        for s in sources:
            key = (s.topic, s.partition)
            self._durable_offsets[key] = max(self._durable_offsets.get(key, -1), s.last)
        self._set_memory()
        if not replay:
            return self._seal_if_due_locked() or sealed
        active = self._active
        if is_full(active.rows, active.memory_size, len(active.batches), self.config.limits):
            self._seal_locked(reason="threshold")
            sealed = True
        return sealed

    def _seal_locked(self, reason: str) -> None:
        """Freeze the active memtable and open the next generation; schedule its flush."""
        old = self._active
        old.frozen = True
        self._frozen.append(old)
        self._active = Memtable(self.spec, old.generation + 1)
        self._set_memory()
        self.events.memtable_sealed(self.shard, old.generation, old.rows, old.memory_size)
        self.log.info(
            "memtable_sealed",
            generation=old.generation,
            rows=old.rows,
            bytes=old.memory_size,
            reason=reason,
        )
        if self._wal_thread is not None and not self._flush_running:
            self._flush_running = True
            self._flush_idle.clear()
            self.flusher.submit(self._flush_loop)

    def _set_memory(self) -> None:
        self.memory.active_bytes = self._active.memory_size + self._pending_bytes
        self.memory.frozen_bytes = sum(m.memory_size for m in self._frozen)

    # ------------------------------------------------------------------ flush

    def _flush_loop(self) -> None:
        """Flush frozen memtables oldest-first until none is left (runs on the Flusher)."""
        try:
            while True:
                with self._lock:
                    if not self._frozen or self._poison is not None or self._abandon_flushes:
                        self._flush_running = False
                        self._flush_idle.set()
                        return
                    memtable = self._frozen[0]
                self._flush_with_retries(memtable)
        except BaseException:
            with self._lock:
                self._flush_running = False
                self._flush_idle.set()
            raise

    def _flush_with_retries(self, memtable: Memtable) -> None:
        delay = self.config.flush_retry_initial_s
        attempts = 0
        while self._poison is None and not self._abandon_flushes:
            try:
                self._flush_one(memtable)
            except Fenced as exc:
                self._poison_with(exc)
                return
            except Exception as exc:  # noqa: BLE001 - retried, then poisons (I6)
                attempts += 1
                self._counters["flush_failures"] += 1
                self.events.flush_failed(self.shard, exc)
                self.log.warning(
                    "flush_failed",
                    generation=memtable.generation,
                    attempt=attempts,
                    error=str(exc),
                )
                if attempts >= self.config.flush_max_attempts:
                    error = Poisoned(
                        f"flush failed {attempts} times: {exc}",
                        shard=self.shard,
                        generation=memtable.generation,
                    )
                    error.__cause__ = exc
                    self._poison_with(error)
                    return
                time.sleep(delay)
                delay = min(delay * 2, self.config.flush_retry_max_s)
                continue
            with self._lock:
                self._frozen.popleft()
                self._dropped_through = max(self._dropped_through, memtable.committed_version or 0)
                self._set_memory()
            self.memory.notify()
            return

    def _flush_one(self, memtable: Memtable) -> None:
        """Commit one frozen memtable to Lance, then advance the manifest and trim the WAL."""
        started = time.monotonic()
        already = self._flushed_position
        # A stale writer may have flushed part of this memtable after we replayed it.
        ds = self.table.dataset()
        with self._lock:
            memtable.commit_floor = int(ds.version)
        mark = self.table.find_flush(self.shard, self._checked_lance_version, ds)
        if mark is not None:
            if mark.epoch > self._epoch:
                raise Fenced("a newer writer flushed this shard", shard=self.shard)
            self._checked_lance_version = mark.version
            already = max(already, mark.wal_end)
        with self._manifest_lock:
            if self.manifests.superseded(self._manifest):
                raise Fenced("a newer writer claimed the shard", shard=self.shard)
        offsets = {_key(s.topic, s.partition): s.last for s in memtable.sources}
        rows = 0
        version = self._manifest.lance_version
        if memtable.last_position > already:
            upserts, deletes = memtable.flush_data(after_position=already)
            rows = sum(b.num_rows for b in upserts) + (deletes.num_rows if deletes else 0)
            if rows:
                props = flush_properties(
                    self.shard, self._epoch, memtable.generation, memtable.last_position, offsets
                )
                version = self.table.commit_flush(upserts, deletes, props, memtable)
                self._checked_lance_version = version
        with self._lock:
            # Readers that open the base at `version` or later must skip this memtable.
            memtable.committed_version = version
        flushed_offsets = {**self._manifest.flushed_offsets, **offsets}
        with self._manifest_lock:
            self._manifest = self.manifests.advance(
                self._manifest,
                flushed_position=memtable.last_position,
                flushed_offsets=flushed_offsets,
                lance_version=version,
                generation=memtable.generation + 1,
            )
        with self._lock:
            self._flushed_position = memtable.last_position
            self._flushed_offsets = {_unkey(k): v for k, v in flushed_offsets.items()}
        self._trimmed = self.flusher.trim(lambda: self._trim_wal(memtable.last_position))
        seconds = time.monotonic() - started
        self._counters["flushes"] += 1
        self._counters["flushed_rows"] += rows
        self.events.flushed(self.shard, seconds, rows)
        self.log.info(
            "memtable_flushed",
            generation=memtable.generation,
            rows=rows,
            wal_end=memtable.last_position,
            lance_version=version,
            seconds=round(seconds, 3),
        )

    def _trim_wal(self, position: int) -> None:
        """Delete WAL entries the manifest says are flushed (at or below `position`)."""
        try:
            self.wal.delete_through(position)
        except Exception as exc:  # noqa: BLE001 - trimming is retried by the next flush
            self.log.warning("wal_trim_failed", error=str(exc))

    # ------------------------------------------------------------------ poison / fence

    def _poison_with(self, error: LanceSinkError) -> None:
        with self._lock:
            if self._poison is not None:
                return
            self._poison = error
            pending, self._pending = self._pending, []
            self._pending_bytes = self._pending_rows = 0
            self._set_memory()
            self._wake.notify_all()
        self._fail(pending, error)
        self.memory.notify()
        self.events.poisoned(self.shard, error)
        event = "shard_fenced" if isinstance(error, Fenced) else "shard_poisoned"
        self.log.error(event, epoch=self._epoch, error=str(error))

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
        try:
            with self._manifest_lock:
                superseded = self.manifests.superseded(self._manifest)
        except Exception as exc:  # noqa: BLE001 - a failed probe is retried, not fatal
            self.log.warning("fence_check_failed", error=str(exc))
            return
        if superseded:
            self._poison_with(Fenced("a newer writer claimed the shard", shard=self.shard))

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
            memtables = [self._active, *reversed(self._frozen)]
            views = tuple(m.view() for m in memtables)
            dropped = self._dropped_through
        return ShardView(self.shard, views, dropped)

    # ------------------------------------------------------------------ close / stats

    def seal(self) -> None:
        """Force-seal the active memtable (drain/close/revoke ignore `may_seal`)."""
        with self._lock:
            if self._active.rows and self._poison is None:
                self._seal_locked(reason="forced")

    def wait_flushed(self, timeout: float) -> bool:
        """Wait until no frozen memtable is left (or the writer is poisoned)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._frozen or self._poison is not None:
                    return not self._frozen
            self._flush_idle.wait(min(0.05, max(deadline - time.monotonic(), 0)))
            time.sleep(0.001)
        with self._lock:
            return not self._frozen

    def close(self, *, flush: bool = True, timeout: float = 30.0) -> None:
        """Stop accepting puts, write what is buffered, seal, and optionally flush (bounded).

        Always safe to call, also on a poisoned writer; idempotent. Without `flush` (a
        revoked or lost partition, closed in the consumer's rebalance callback) a WAL trim
        still queued or running is not waited for: it deletes only entries at or below the
        flushed position, which no replay reads, and deleting is idempotent, so it may
        overlap the next owner's replay and trims. (The trimmer is one thread for all
        shards: a revoke waited behind other shards' trims, 35 s seen on S3.)
        """
        if self._closed:
            return
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        if self._wal_thread is not None:
            self._wal_thread.join(timeout)
        if flush and self._poison is None:
            self.seal()
            if not self.wait_flushed(timeout):
                self.log.warning("close_flush_incomplete", frozen=len(self._frozen))
        # Whatever is still frozen is left to the next owner's replay; a flush already
        # running finishes first, so two owners never flush the same memtable.
        with self._lock:
            self._abandon_flushes = True
        if not self._flush_idle.wait(timeout):
            self.log.warning("close_flush_still_running")
        if flush:
            try:
                self._trimmed.result(timeout)
            except TimeoutError:
                self.log.warning("close_wal_trim_still_running")
        self.controller.unregister(self.memory)
        self.memory.closed = True
        self.memory.notify()
        self._closed = True
        self.log.info("shard_closed", epoch=self._epoch, flushed_position=self._flushed_position)

    @property
    def durable_offsets(self) -> dict[tuple[str, int], int]:
        """Last durable source offset per (topic, partition): resume at value + 1."""
        with self._lock:
            return dict(self._durable_offsets)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def poisoned(self) -> LanceSinkError | None:
        return self._poison

    def stats(self) -> ShardStats:
        """Counters and cursors; never raises (readable when poisoned or closed)."""
        with self._lock:
            frozen = list(self._frozen)
            active = self._active
            return ShardStats(
                shard=self.shard,
                epoch=self._epoch,
                generation=active.generation,
                rows=active.rows,
                bytes=active.memory_size,
                index_bytes=sum(m.index_bytes + m.cache_bytes for m in [active, *frozen]),
                frozen_count=len(frozen),
                frozen_bytes=sum(m.memory_size for m in frozen),
                durable_position=self._durable_position,
                visible_position=self._durable_position,
                flushed_position=self._flushed_position,
                durable_offsets=dict(self._durable_offsets),
                flushed_offsets=dict(self._flushed_offsets),
                wal_entries_total=self._counters["wal_entries"],
                wal_bytes_total=self._counters["wal_bytes"],
                flushes_total=self._counters["flushes"],
                flush_failures_total=self._counters["flush_failures"],
                flushed_rows_total=self._counters["flushed_rows"],
                replayed_rows=self._counters["replayed_rows"],
                replay_seconds=self._replay_seconds,
                poisoned=None if self._poison is None else str(self._poison),
            )
