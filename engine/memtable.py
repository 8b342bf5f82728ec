"""Memtables: the durable, visible rows of one shard that are not yet in the Lance table.

A memtable is one generation. It holds:

- the record batches of the WAL entries it covers, in WAL order (own copies: a batch never
  pins a larger parent buffer, so counted bytes are resident bytes);
- for upsert tables, a primary-key map (key -> newest row id in this memtable) and a
  per-row `dead` flag (superseded by a newer row of the same key, or a delete);
- the WAL positions and source offset ranges it covers.

Only the shard writer's WAL step (live path) or `ShardWriter.open` (replay) inserts, under
the writer lock. Readers take an immutable `MemtableView` under the same lock and then read
without it. `should_seal` (before an insert) and `is_full` (after it) are the one seal rule,
used by both the live path and replay (invariant I4).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.schema import OP_COLUMN, OP_DELETE, OP_UPSERT, TableSpec
from engine.wal import SourceRange, merge_ranges

# CPython object sizes used to account the primary-key map (measured by tests against
# tracemalloc): an int below 2**30 is 28 bytes, a compact ASCII str is 49 + len bytes, a
# tuple is 40 + 8 per item.
_INT_BYTES = 28
_STR_HEADER_BYTES = 49
_BYTES_HEADER_BYTES = 33
_TUPLE_HEADER_BYTES = 40


@dataclass(frozen=True, slots=True)
class SealLimits:
    """Thresholds of the active memtable (from `MemtableSettings`)."""

    max_rows: int
    max_bytes: int
    max_batches: int


def should_seal(
    rows: int,
    nbytes: int,
    batches: int,
    incoming_rows: int,
    incoming_bytes: int,
    limits: SealLimits,
) -> bool:
    """The seal predicate: must the active memtable be sealed before this insert?

    One function for the live path and replay (I4), so a replayed WAL produces the same
    memtable boundaries as the live run did. An empty memtable is never sealed (a single
    oversized insert makes a memtable of its own).
    """
    if rows == 0:
        return False
    return (
        rows + incoming_rows > limits.max_rows
        or nbytes + incoming_bytes > limits.max_bytes
        or batches + 1 > limits.max_batches
    )


def is_full(rows: int, nbytes: int, batches: int, limits: SealLimits) -> bool:
    """The seal rule after an insert: has the active memtable reached a limit?

    A memtable that has is sealed then, not at the next insert: a quiet partition's rows
    would otherwise wait in the active memtable for the next put (or `max_age_s`). Together
    with `should_seal` a memtable holds at most each limit, unless one insert alone exceeds
    it. An empty memtable is never full.
    """
    return rows > 0 and (
        rows >= limits.max_rows or nbytes >= limits.max_bytes or batches >= limits.max_batches
    )


@dataclass(frozen=True, slots=True)
class MemtableView:
    """An immutable snapshot of a memtable for readers (taken under the writer lock).

    `live` holds, per batch, the mask of visible rows (None = all rows), for upsert tables.
    `memtable` is the live memtable: its flush state (`commit_floor`, `committed_version`)
    is read when a reader decides whether a base version already holds these rows
    (`ShardView.fresh`), after it opened that base version.
    """

    generation: int
    batches: tuple[pa.RecordBatch, ...]
    live: tuple[np.ndarray | None, ...]
    keys: dict[Any, int] | None
    frozen: bool
    memtable: Memtable


class Memtable:
    """One generation of a shard's unflushed rows. See the module docstring for the lifecycle."""

    def __init__(self, spec: TableSpec, generation: int) -> None:
        self.spec = spec
        self.generation = generation
        self.batches: list[pa.RecordBatch] = []
        self.batch_positions: list[int] = []  # WAL position of each batch
        self.first_position = 0
        self.last_position = 0
        self.first_insert_at: float | None = None  # time.monotonic() of the first insert
        self.sources: list[SourceRange] = []
        self.rows = 0
        self.data_bytes = 0
        self.index_bytes = 0
        self.cache_bytes = 0
        self.frozen = False
        # Set under the writer lock before the flush commits: any commit of this memtable
        # has a table version above `commit_floor`. After it committed: its version.
        self.commit_floor: int | None = None
        self.committed_version: int | None = None
        self._keys: dict[Any, int] | None = {} if spec.upsert else None
        self._dead = bytearray()
        self._key_object_bytes = 0.0  # running mean size of one key object
        self._lock = threading.Lock()

    @property
    def memory_size(self) -> int:
        """Resident bytes: row data plus every in-memory index (I7), the readers' caches
        (vector norms, FTS tokens) included."""
        return self.data_bytes + self.index_bytes + self.cache_bytes

    def account_cache(self, nbytes: int) -> None:
        """A reader built a cache for this memtable (held as long as the memtable is)."""
        with self._lock:
            self.cache_bytes += nbytes

    def insert(
        self,
        batches: list[pa.RecordBatch] | tuple[pa.RecordBatch, ...],
        position: int,
        sources: list[SourceRange] | tuple[SourceRange, ...],
    ) -> None:
        """Append the rows of the WAL entry at `position` (already durable).

        The batches must own their buffers (see `own_copy`); the caller holds the writer
        lock.
        """
        if self.first_position == 0:
            self.first_position = position
        if self.first_insert_at is None:
            self.first_insert_at = time.monotonic()
        self.last_position = position
        self.sources = merge_ranges([*self.sources, *sources])
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if self._keys is not None:
                self._index_keys(batch, self.rows)
            with self._lock:
                self.batches.append(batch)
                self.batch_positions.append(position)
                self.rows += batch.num_rows
            self.data_bytes += batch.get_total_buffer_size()
        self._account_index()

    def _index_keys(self, batch: pa.RecordBatch, base: int) -> None:
        assert self._keys is not None
        n = batch.num_rows
        keys = key_values(batch, self.spec.primary_key)
        index = self._keys
        old = np.fromiter((index.get(k, -1) for k in keys), dtype=np.int64, count=n)
        before = len(index)
        index.update(zip(keys, range(base, base + n), strict=True))
        added = len(index) - before
        self._dead.extend(b"\x00" * n)
        dead = np.frombuffer(self._dead, dtype=np.uint8)
        superseded = old[old >= 0]
        dead[superseded] = 1
        # Duplicates within the batch: only the last occurrence of a key stays live.
        newest = np.fromiter((index[k] for k in keys), dtype=np.int64, count=n)
        ids = np.arange(base, base + n, dtype=np.int64)
        dead[ids[newest != ids]] = 1
        if added:
            per_key = _key_object_bytes(batch, self.spec.primary_key)
            total = self._key_object_bytes * before + per_key * added
            self._key_object_bytes = total / len(index)

    def _account_index(self) -> None:
        if self._keys is None:
            self.index_bytes = 0
            return
        entries = len(self._keys)
        self.index_bytes = int(
            sys.getsizeof(self._keys)
            + entries * (self._key_object_bytes + _INT_BYTES)
            + len(self._dead)
        )

    def without_column(self, name: str | None) -> Memtable:
        """A frozen memtable of this one's rows without column `name` (None: with every
        column), as one batch (a copy). What the reader keeps of a flushed memtable for full-text
        search, without its vectors and scored in one pass instead of one per put
        (`engine.unindexed.FlushedText`). Append tables only (no primary-key map)."""
        if self._keys is not None:
            raise ValueError("an upsert memtable's rows are not projected")
        with self._lock:
            batches = list(self.batches)
        out = Memtable(self.spec, self.generation)
        if batches:
            kept = pa.Table.from_batches(batches)
            if name is not None:
                kept = kept.drop_columns([name])
            out.batches = kept.combine_chunks().to_batches(max_chunksize=kept.num_rows)
            out.batch_positions = [self.last_position]
        out.first_position = self.first_position
        out.last_position = self.last_position
        out.sources = list(self.sources)
        out.rows = sum(b.num_rows for b in out.batches)
        out.data_bytes = sum(b.get_total_buffer_size() for b in out.batches)
        out.frozen = True
        out.commit_floor = self.commit_floor
        out.committed_version = self.committed_version
        return out

    @classmethod
    def of_rows(cls, spec: TableSpec, rows: pa.Table, batch_rows: int) -> Memtable:
        """A frozen memtable holding `rows` (some of the table's columns) in batches of
        `batch_rows`, at no WAL position: base rows read back for full-text search
        (`engine.unindexed.FlushedText.refresh`). Append tables only (no primary-key map)."""
        out = cls(spec, 0)
        rows = rows.combine_chunks()
        if rows.num_rows:
            out.batches = rows.to_batches(max_chunksize=batch_rows)  # slices of one buffer
            out.batch_positions = [0] * len(out.batches)
        out.rows = rows.num_rows
        out.data_bytes = rows.get_total_buffer_size()  # once, not once per slice
        out.frozen = True
        return out

    def view(self) -> MemtableView:
        """An immutable snapshot for readers."""
        with self._lock:
            batches = tuple(self.batches)
        live: list[np.ndarray | None] = []
        if self._keys is None:
            live = [None] * len(batches)
        else:
            dead = np.frombuffer(bytes(self._dead[: sum(b.num_rows for b in batches)]), np.uint8)
            start = 0
            for b in batches:
                mask = dead[start : start + b.num_rows] == 0
                ops = b.column(OP_COLUMN).to_numpy()
                live.append(mask & (ops == OP_UPSERT))
                start += b.num_rows
        return MemtableView(
            self.generation,
            batches,
            tuple(live),
            self._keys,
            self.frozen,
            self,
        )

    def flush_data(self, after_position: int = 0) -> tuple[list[pa.RecordBatch], pa.Table | None]:
        """What a flush writes: the rows to append (or upsert), and the keys to delete.

        For append tables every row, in order. For upsert tables the newest row of each key:
        upserts in table schema, deletes as a table of key columns. Rows of WAL entries at
        or below `after_position` are left out (a stale writer already flushed them).
        """
        batches = [(b, p) for b, p in zip(self.batches, self.batch_positions, strict=True)]
        if self._keys is None:
            return [self.spec.to_table_batch(b) for b, p in batches if p > after_position], None
        dead = np.frombuffer(bytes(self._dead), np.uint8)
        upserts: list[pa.RecordBatch] = []
        deletes: list[pa.RecordBatch] = []
        start = 0
        for b, position in batches:
            alive = dead[start : start + b.num_rows] == 0
            start += b.num_rows
            if position <= after_position or not alive.any():
                continue
            newest = b.filter(pa.array(alive))
            is_delete = pc.equal(newest.column(OP_COLUMN), OP_DELETE)
            dels = newest.filter(is_delete)
            if dels.num_rows:
                deletes.append(dels.select(list(self.spec.primary_key)))
            ups = newest.filter(pc.invert(is_delete))
            if ups.num_rows:
                upserts.append(self.spec.to_table_batch(ups))
        delete_table = pa.Table.from_batches(deletes) if deletes else None
        return upserts, delete_table


def key_values(batch: pa.RecordBatch, key: tuple[str, ...]) -> list[Any]:
    """Python key values of every row: scalars for one key column, tuples for several."""
    if len(key) == 1:
        return batch.column(key[0]).to_pylist()  # type: ignore[no-any-return]
    return list(zip(*(batch.column(k).to_pylist() for k in key), strict=True))


def _key_object_bytes(batch: pa.RecordBatch, key: tuple[str, ...]) -> float:
    """Mean CPython size of one key object of this batch (estimated from Arrow, vectorised)."""
    total = 0.0
    n = max(batch.num_rows, 1)
    for name in key:
        column = batch.column(name)
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            lengths = pc.binary_length(column)
            total += _STR_HEADER_BYTES + (pc.sum(lengths).as_py() or 0) / n
        elif pa.types.is_binary(column.type):
            lengths = pc.binary_length(column)
            total += _BYTES_HEADER_BYTES + (pc.sum(lengths).as_py() or 0) / n
        else:
            total += _INT_BYTES + 4  # ints above 2**30 take 32 bytes
    if len(key) > 1:
        total += _TUPLE_HEADER_BYTES + 8 * len(key)
    return total


def own_copy(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The batch with buffers of its own: copies only when it is a slice of a larger parent
    (a slice would keep the whole parent resident while only its rows are counted)."""
    if batch.get_total_buffer_size() <= batch.nbytes * 1.05 + 4096:
        return batch
    return pa.concat_batches([batch])


#: Puts smaller than this (rows, on average) are coalesced into one batch per WAL entry:
#: per-batch overhead (Python objects, faiss calls at query time) dominates tiny batches,
#: while copying large ones would cost more than it saves.
COALESCE_BELOW_ROWS = 4_096


def entry_batches(batches: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
    """The batches a WAL entry and the memtable keep for a group of puts: own buffers,
    small batches coalesced, large ones as they are (no copy)."""
    batches = [b for b in batches if b.num_rows]
    if len(batches) > 1 and sum(b.num_rows for b in batches) < COALESCE_BELOW_ROWS * len(batches):
        return [pa.concat_batches(batches)]
    return [own_copy(b) for b in batches]
