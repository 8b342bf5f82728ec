"""Flush coalescing: the frozen memtables of the shards of one table that wait at the same
time go into one Lance commit, at most `max_commits_per_s` commits a second per table per
process, whatever the partition count (1,024 partitions flushing in one round were 1,024
Lance commits and 1,024 small fragments).

Lifecycle (who calls what, and when):

- `Flusher.coalescer(table)` makes one `FlushCoalescer` per table of a `Flusher` (the
  engine's: one table), on first use by a shard's `ShardFlush`.
- `ready(shard)` (`ShardFlush.schedule`, under the shard writer's lock, after a seal)
  queues the shard and starts the driver on the `Flusher` pool unless it runs. `discard`
  (`ShardFlush.abandon`) takes a queued shard out.
- The driver (`_drive`) runs rounds until no shard is queued. A round takes every queued
  shard whose backoff is over, once the pacing allows (the previous commit started at
  least `1 / max_commits_per_s` earlier): with nothing else waiting and the rate unused a
  single shard commits at once, as before coalescing. Per shard, in queue order
  (`ShardFlush.prepare`): its oldest frozen memtable, the fence checks (a newer epoch's
  flush mark in the table, a newer claim of the manifest: I3/I5) and the rows after what a
  stale writer flushed of it. A fenced shard is poisoned alone; the others commit.
- The round's parts go into one commit (`BaseTable.commit_flush`) whose properties carry
  each shard's flush record (`engine.table.commit_properties`), up to `max_rows` rows and
  `max_bytes` bytes (a shard that would pass them waits for the next round; one alone
  always commits). Upsert tables: merge-insert of a source holding a key twice is
  ambiguous, so a shard whose keys (upserted or deleted) overlap those of a shard already
  in the round waits for the next round; within a shard the memtable already keeps the
  newest row per key.
- After the commit, each shard advances its own manifest and hands its own WAL trim over
  (`ShardFlush.finish`). A failed commit is a failed attempt of every shard in it
  (`ShardFlush.failed`: per-shard counts and backoff, poison after `max_attempts`); a
  failed manifest update is one of that shard only (its retry finds its mark in the table
  and commits nothing). Then every shard of the round is settled: queued again while it
  has frozen memtables, else idle (`ShardFlush.wait_idle`).

A shard is in at most one round at a time and has at most one memtable in a commit (its
flush record names one generation), so memtables of a shard still flush oldest first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import structlog

from engine.table import BaseTable, FlushMark, commit_properties

if TYPE_CHECKING:
    from engine.flusher import PendingFlush, ShardFlush

log = structlog.get_logger("lance_sink.engine")

_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True, slots=True)
class CoalesceLimits:
    """Pacing and size of coalesced flush commits (`FlushSettings`).

    4 commits a second keeps a 1,024-partition process at 4 conditional PUTs (plus manifest
    writes) a second on S3 instead of one per partition, and delays a flush by at most
    250 ms behind the previous commit. 1,000,000 rows / 512 MiB are five full default
    memtables (`memtable.max_rows` 200,000, `memtable.max_bytes` 128 MiB): a commit stays
    a few large fragments, and its rows are already in memory (frozen memtables)."""

    max_commits_per_s: float = 4.0
    max_rows: int = 1_000_000
    max_bytes: int = 512 << 20


class FlushCoalescer:
    """One table's flush rounds in this process (see the module docstring)."""

    def __init__(
        self,
        table: BaseTable,
        submit: Callable[[Callable[[], None]], None],
        limits: CoalesceLimits,
        shard_io: Executor | None = None,
    ) -> None:
        self.table = table
        self.limits = limits
        self._submit = submit
        self._shard_io = shard_io
        self._cond = threading.Condition()
        self._ready: dict[ShardFlush, None] = {}  # insertion order = queue order
        self._driving = False
        self._next_commit_at = 0.0
        #: Lance flush commits this coalescer made, and shard flushes they held.
        self.commits_total = 0
        self.shard_flushes_total = 0

    def ready(self, shard: ShardFlush) -> None:
        """Queue `shard` for the next round (it has a frozen memtable to flush)."""
        with self._cond:
            self._ready[shard] = None
            if not self._driving:
                self._driving = True
                self._submit(self._drive)
            else:
                self._cond.notify()

    def discard(self, shard: ShardFlush) -> None:
        """Take `shard` out of the queue (not out of a running round)."""
        with self._cond:
            self._ready.pop(shard, None)
            self._cond.notify()

    def _drive(self) -> None:
        """Run rounds until no shard is queued (on the Flusher pool)."""
        try:
            while True:
                shards = self._take()
                if shards is None:
                    return
                self._round(shards)
        except BaseException as exc:
            log.error("flush_driver_failed", table=self.table.uri, error=str(exc))
            with self._cond:
                self._driving = False
            raise

    def _take(self) -> list[ShardFlush] | None:
        """The shards of the next round, once pacing and their backoff allow; None (and the
        driver stops) when none is queued."""
        with self._cond:
            while True:
                if not self._ready:
                    self._driving = False
                    return None
                now = time.monotonic()
                due = [s for s in self._ready if s.retry_at <= now]
                if due and now >= self._next_commit_at:
                    # Longest waiting first: a shard a cap or a key overlap held back
                    # goes before shards queued after it, so none starves.
                    due.sort(key=lambda s: s.waiting_since)
                    for s in due:
                        del self._ready[s]
                    return due
                wake = self._next_commit_at if due else min(s.retry_at for s in self._ready)
                self._cond.wait(max(wake - now, 0.0))

    def _round(self, shards: list[ShardFlush]) -> None:
        try:
            self._commit_round(shards)
        finally:
            for shard in shards:
                shard.settle(self)

    def _commit_round(self, shards: list[ShardFlush]) -> None:
        try:
            ds = self.table.dataset()
        except Exception as exc:  # noqa: BLE001 - a failed attempt of each (retried)
            for shard in shards:
                shard.failed(exc)
            return
        parts: list[PendingFlush] = []
        rows = nbytes = 0
        keys = _Keys(list(self.table.spec.primary_key)) if self.table.spec.upsert else None
        version = int(ds.version)
        # The flush marks read `ds`, which one thread at a time may use; the table keeps the
        # transactions read, so each version is read once for all shards.
        marked: list[tuple[ShardFlush, FlushMark | None]] = []
        for shard in self._capped(shards):
            try:
                marked.append((shard, shard.flush_mark(ds)))
            except Exception as exc:  # noqa: BLE001 - a failed attempt (retried)
                shard.failed(exc)
        for part in self._each(lambda sm: _prepared(sm[0], version, sm[1]), marked):
            if part is None:
                continue
            if parts and (
                rows + part.rows > self.limits.max_rows
                or nbytes + part.nbytes > self.limits.max_bytes
            ):
                continue
            if keys is not None and not keys.add(part):
                log.debug("flush_deferred_overlapping_keys", shard=part.shard.shard)
                continue
            parts.append(part)
            rows += part.rows
            nbytes += part.nbytes
        if parts:
            self._commit(parts, rows)

    def _commit(self, parts: list[PendingFlush], rows: int) -> None:
        started = time.monotonic()
        self._next_commit_at = started + 1.0 / self.limits.max_commits_per_s
        upserts = [b for p in parts for b in p.upserts]
        dels = [p.deletes for p in parts if p.deletes is not None and p.deletes.num_rows]
        deletes = pa.concat_tables(dels) if dels else None
        try:
            version = self.table.commit_flush(
                upserts,
                deletes,
                commit_properties([p.record for p in parts]),
                parts[0].memtable if len(parts) == 1 else None,
            )
        except Exception as exc:  # noqa: BLE001 - a failed attempt of every shard in it
            for part in parts:
                part.shard.failed(exc)
            return
        self.commits_total += 1
        self.shard_flushes_total += len(parts)
        log.info(
            "flush_committed",
            table=self.table.uri,
            shards=len(parts),
            rows=rows,
            lance_version=version,
            seconds=round(time.monotonic() - started, 3),
        )
        self._each(lambda part: _finished(part, version), parts)

    def _capped(self, shards: list[ShardFlush]) -> list[ShardFlush]:
        """The first of `shards` whose frozen memtables fit a commit's `max_rows` and
        `max_bytes` (at least one): the rest are not prepared and wait for the next round
        (settled back into the queue)."""
        rows = nbytes = 0
        for i, shard in enumerate(shards):
            if i and (rows >= self.limits.max_rows or nbytes >= self.limits.max_bytes):
                return shards[:i]
            more_rows, more_bytes = shard.frozen_size()
            rows, nbytes = rows + more_rows, nbytes + more_bytes
        return shards

    def _each(self, fn: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
        """`fn` of each of `items`, in order: on the shard I/O pool when there are several
        (each checks or writes one shard's manifest and flush marks: a round trip each on
        S3, 1,024 of them one after another took longer than a drain may), else here."""
        items = list(items)
        if self._shard_io is None or len(items) < 2:
            return [fn(item) for item in items]
        return list(self._shard_io.map(fn, items))


def _prepared(shard: ShardFlush, version: int, mark: FlushMark | None) -> PendingFlush | None:
    """`shard.prepare(version, mark)`, or None: nothing to flush, nothing left to commit
    (finished at once), or a failed attempt (`failed`: a fence poisons it, others retry)."""
    try:
        part = shard.prepare(version, mark)
        if part is not None and not part.rows:  # a stale writer flushed all of it
            shard.finish(part, None)
            part = None
    except Exception as exc:  # noqa: BLE001 - see above
        shard.failed(exc)
        return None
    return part


def _finished(part: PendingFlush, version: int) -> None:
    """`finish` a committed part; a failed manifest update is a failed attempt of that
    shard alone (its retry finds its mark in the table and commits nothing)."""
    try:
        part.shard.finish(part, version)
    except Exception as exc:  # noqa: BLE001 - see above
        part.shard.failed(exc)


class _Keys:
    """The primary keys (upserted and deleted) of the parts in an upsert round."""

    def __init__(self, columns: list[str]) -> None:
        self.columns = columns
        self._tables: list[pa.Table] = []
        self._tuples: set[tuple[object, ...]] = set()

    def add(self, part: PendingFlush) -> bool:
        """Add `part`'s keys unless one is already in; False (nothing added) if one is."""
        keys = _part_keys(part, self.columns)
        if len(self.columns) == 1:
            if self._tables:
                held = pa.concat_tables(self._tables).column(0).combine_chunks()
                column = keys.column(0)
                if pc.any(pc.is_in(column, value_set=held)).as_py():
                    return False
            self._tables.append(keys)
            return True
        tuples = set(zip(*(keys.column(c).to_pylist() for c in self.columns), strict=True))
        if tuples & self._tuples:
            return False
        self._tuples |= tuples
        return True


def _part_keys(part: PendingFlush, columns: list[str]) -> pa.Table:
    pieces = [pa.Table.from_batches([b]).select(columns) for b in part.upserts if b.num_rows]
    if part.deletes is not None and part.deletes.num_rows:
        pieces.append(part.deletes.select(columns))
    if not pieces:
        return pa.table({c: pa.array([], pa.null()) for c in columns})
    return pa.concat_tables(pieces, promote_options="permissive")
