"""The memtable tiers of a snapshot: what a query reads of one fresh memtable.

A `MemtableTier` is one fresh memtable of a `Snapshot` (`engine.reads.snapshot`) with the
tiers newer than it, so it can tell which of its rows a newer tier decides (upsert tables:
the newest tier holding a key decides it). A `FlushedTier` is a flushed memtable that
`engine.unindexed.FlushedText` keeps for text search in place of the base fragments it was
written to (those fragments' rows are counted in the base's statistics already).

Both answer the same small interface the query kinds use: `view` (batches and live masks),
`eligible`/`matched` (live and filter masks), `visible` (rows no newer tier decides) and
`take` (materialise rows).
"""

from __future__ import annotations

from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.filters import Predicate
from engine.memtable import MemtableView, key_values
from engine.schema import TableSpec
from engine.unindexed import HeldText

#: The shard name of the tiers `FlushedText` holds: flushed memtables searched for text.
FLUSHED_TIER = "(flushed)"


class MemtableTier:
    """One fresh memtable of a snapshot, with the keys dicts of the tiers newer than it."""

    def __init__(
        self, shard: str, view: MemtableView, newer: tuple[MemtableTier, ...], spec: TableSpec
    ) -> None:
        self.shard = shard
        self.view = view
        self.newer = newer
        self.spec = spec
        sizes = [b.num_rows for b in view.batches]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.rows = int(self.starts[-1])
        self._matched: tuple[Predicate, np.ndarray] | None = None

    def eligible(self, i: int, predicate: Predicate | None) -> np.ndarray | None:
        """Rows of batch i that are live and match the predicate (None = every row)."""
        live = self.view.live[i]
        mask = None if live is None else live.copy()
        if predicate is not None:
            matched = self.matched(predicate, i)
            mask = matched.copy() if mask is None else mask & matched
        return mask

    def matched(self, predicate: Predicate, i: int) -> np.ndarray:
        """Rows of batch i that match the predicate (a read-only view).

        The predicate is evaluated once over all of the view's batches (a zero-copy table
        of the columns it reads) and sliced per batch: a memtable holds hundreds of small
        batches (one per put), and evaluating batch by batch cost ~0.1 ms each, about 20 ms
        per 100k rows put 500 at a time."""
        batches = self.view.batches
        if not predicate.columns:  # nothing to concatenate: evaluate on the batch
            return predicate.mask(batches[i])
        cached = self._matched
        if cached is None or cached[0] is not predicate:
            table = pa.table(
                {c: pa.chunked_array([b.column(c) for b in batches]) for c in predicate.columns}
            )
            cached = (predicate, predicate.mask(table))
            self._matched = cached
        whole: np.ndarray = cached[1]
        return whole[self.starts[i] : self.starts[i + 1]]

    def holds(self, key: Any) -> bool:
        """Does this tier's view hold a row (upsert or delete) of `key`?

        The keys dict is the live memtable's: a key whose newest row id lies beyond the view
        was inserted after the snapshot, so the view's batches are searched for it instead.
        """
        keys = self.view.keys
        if keys is None:
            return False
        rid = keys.get(key)
        if rid is None:
            return False
        if rid < self.rows:
            return True
        return self.find_in_view(key) is not None

    def find_in_view(self, key: Any) -> int | None:
        """The newest row id of `key` within the view's batches (vectorised scan), if any."""
        names = self.spec.primary_key
        parts = key if len(names) > 1 else (key,)
        for i in range(len(self.view.batches) - 1, -1, -1):
            batch = self.view.batches[i]
            match = None
            for name, part in zip(names, parts, strict=True):
                eq = pc.fill_null(pc.equal(batch.column(name), pa.scalar(part)), False)
                match = eq if match is None else pc.and_(match, eq)
            assert match is not None
            hits = np.flatnonzero(match.to_numpy(zero_copy_only=False))
            if len(hits):
                return int(self.starts[i] + hits[-1])
        return None

    def hidden(self, keys: list[Any]) -> np.ndarray:
        """For each key: does a newer tier of the snapshot decide it?"""
        if not self.newer:
            return np.zeros(len(keys), dtype=bool)
        return np.fromiter(
            (any(t.holds(k) for t in self.newer) for k in keys), dtype=bool, count=len(keys)
        )

    def visible(self, batch_idx: int, rows: np.ndarray) -> np.ndarray:
        """Subset of `rows` (of batch `batch_idx`) not decided by a newer tier."""
        if not self.newer or not len(rows) or self.view.keys is None:
            return rows
        batch = self.view.batches[batch_idx]
        names = list(self.spec.primary_key)
        keys = key_values(batch.select(names).take(pa.array(rows)), self.spec.primary_key)
        visible: np.ndarray = rows[~self.hidden(keys)]
        return visible

    def take(self, batch_idx: int, rows: np.ndarray, columns: list[str]) -> pa.Table:
        """`columns` of the given rows of batch `batch_idx`."""
        batch = self.view.batches[batch_idx]
        taken = batch.select(columns).take(pa.array(rows, pa.int64()))
        schema = pa.schema([self.spec.table_schema.field(c) for c in columns])
        return pa.Table.from_batches([pa.RecordBatch.from_arrays(taken.columns, schema=schema)])


class FlushedTier(MemtableTier):
    """A flushed memtable `FlushedText` keeps (for text search), in place of the base
    fragments it was written to. Its batches lack the vector column: rows asked for with it
    take it from those fragments, in the query's base version (a fragment's rows never
    change; an append table's have no deletions)."""

    def __init__(self, held: HeldText, base: lance.LanceDataset, spec: TableSpec) -> None:
        super().__init__(FLUSHED_TIER, held.view, (), spec)
        self.held = held
        self.base = base

    def take(self, batch_idx: int, rows: np.ndarray, columns: list[str]) -> pa.Table:
        names = self.view.batches[batch_idx].schema.names
        missing = [c for c in columns if c not in names]
        if not missing:
            return super().take(batch_idx, rows, columns)
        kept = super().take(batch_idx, rows, [c for c in columns if c in names])
        pieces, order = [], []
        for fragment_id, offsets, picked in self.held.locate(self.starts[batch_idx] + rows):
            fragment = self.base.get_fragment(fragment_id)
            assert fragment is not None, "FlushedText.views holds fragments of this base only"
            ascending = np.argsort(offsets)  # Lance takes rows in increasing order only
            pieces.append(fragment.take(offsets[ascending].tolist(), columns=missing))
            order.append(picked[ascending])
        found = pa.concat_tables(pieces)
        found = found.take(pa.array(np.argsort(np.concatenate(order)), pa.int64()))
        for column in missing:
            field = self.spec.table_schema.field(column)
            kept = kept.append_column(field, found.column(column).cast(field.type))
        return kept.select(columns)
