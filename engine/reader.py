"""Reads over the base Lance table plus every memtable of the shards this process owns.

One `Reader` per process serves vector kNN, full-text (BM25), filter/scan and primary-key
lookup. It is the face of `engine.reads`, which holds one module per concern: the snapshot
a query reads (`snapshot`: the fresh memtable tiers, newest first, and one base version,
taken in the order `ShardView.fresh` requires), the memtable tiers (`tiers`), merging
ranked parts (`merge`), cached base statistics (`stats`), what the query kinds share
(`context`), and the query kinds (`vector`, `text`, `scan`, `lookup`).

Merging tiers ("tier" = one fresh memtable, or the base):

- Tiers are ordered newest first: per shard, the active memtable, then frozen ones newest
  first; the base is last. For upsert tables the newest tier holding a key decides it: its
  newest row for the key is returned if it is an upsert, and nothing is returned if it is a
  delete (`_op` = 1) -- older tiers and the base never show that key. Within a memtable the
  view's `live` masks already hide superseded rows and deletes.
- Across shards there is no order (a key is expected in one topic-partition, which is what
  Kafka's key partitioning gives); if a key does occur in two shards, the first shard in
  `shards()` order wins, so a key still appears once.
- Append tables have no keys to merge: `fresh` already makes the tiers disjoint.
- Filters are pre-filters in every tier: rows are filtered first, then ranked, so a filtered
  query returns the top k among matching rows (Lance `prefilter=True` on the base; a mask
  before ranking on memtables).

Vector kNN: see `engine.reads.vector`. Full text: see `engine.reads.text` and `engine.fts`.

Fan-out (`fanout`, `engine.reads.remote`): with several pods, the shards this process does
not hold are read from their owner pods' memtables within `query.fanout_timeout_ms`, and a
pod answers theirs (`serve_fresh`). Every query method takes a `FanoutReport`: with
`allow_partial`, shards whose owner did not answer are listed in it; without a report (or
without `allow_partial`) the query fails with `FreshRowsUnavailable` instead. A process
that holds every shard (or has no `fanout`) reads as before, with no network hop.

Errors: `QueryError` (and subclasses) for a bad request. A poisoned or fenced shard is
skipped (its rows are served by its next owner after replay) and reported through
`ReaderEvents.shard_skipped`.

Threading: a `Reader` is shared by concurrent queries (the HTTP layer's worker threads).
Within a vector or text query, Lance's part of the base search runs on a base worker
(`ReaderSettings.base_workers`) while the calling thread searches the memtables; a hybrid
query (`search_hybrid`) runs its text half on a thread the caller gives.
faiss is limited to one OpenMP thread per call (see `engine.reads.vector`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import faiss
import numpy as np
import pyarrow as pa

from engine import fts
from engine.filters import Predicate
from engine.reads.context import NoReaderEvents, ReadContext, ReaderEvents, ReaderSettings
from engine.reads.fresh import FreshServer
from engine.reads.hybrid import HybridSearch
from engine.reads.lookup import Lookup
from engine.reads.merge import DISTANCE, SCORE
from engine.reads.remote import Fanout, FanoutReport, MissingShard
from engine.reads.scan import scan
from engine.reads.snapshot import Snapshot
from engine.reads.text import TextSearch
from engine.reads.vector import VectorSearch
from engine.schema import TableSpec
from engine.shard import ShardWriter
from engine.table import BaseTable
from engine.unindexed import FlushedText, UnindexedFragments


class Reader:
    """Queries over base + memtables; see the module docstring for the semantics.

    Lifecycle: built once per process by the service (after the engine), shared by every
    query thread. `shards` is called per query (and by the background tokenizer) and returns
    the writers this process currently owns (`Engine.writers`). The first text query starts
    a daemon thread, the background tokenizer (see `engine.fts`); `close` stops it and may
    be called any number of times (a process that exits without it loses nothing: the
    thread only fills a cache). After `close`, queries still work and tokenise inline.
    """

    def __init__(
        self,
        spec: TableSpec,
        table: BaseTable,
        shards: Callable[[], list[ShardWriter]],
        settings: ReaderSettings | None = None,
        events: ReaderEvents | None = None,
        fanout: Fanout | None = None,
    ) -> None:
        self.spec = spec
        self.table = table
        self.shards = shards
        self.settings = settings or ReaderSettings()
        self.events: ReaderEvents = events or NoReaderEvents()
        self.ctx = ReadContext(spec, table, shards, self.settings, self.events)
        self.ctx.fanout = fanout
        self.terms = fts.MemtableTermCache()
        # Base rows the indexes do not cover yet, held in memory (engine.unindexed): one
        # bound for both; this process's append flushes hand their rows over.
        bound = self.settings.unindexed_cache_bytes
        self.unindexed: UnindexedFragments | None = None
        if spec.vector is not None and bound > 0:
            self.unindexed = UnindexedFragments(
                spec, bound, self.ctx.open_base, lambda: self._held_bytes(vector=False)
            )
            table.watch_appends(self.unindexed)
        vectors = self.unindexed
        room: Callable[[int], bool] | None = None
        if bound > 0:
            room = (lambda n: n <= bound) if vectors is None else vectors.room_beside
        self.vector = VectorSearch(self.ctx, self.unindexed)
        self.text = TextSearch(self.ctx, self.terms, room)
        self.flushed_text: FlushedText | None = self.text.flushed_text
        if self.flushed_text is not None:
            table.watch_appends(self.flushed_text)
        self.lookups = Lookup(self.ctx)
        self.hybrid = HybridSearch(self.ctx, self.vector, self.text)
        self.fresh = FreshServer(self.ctx, self.vector, self.text, self.lookups)
        faiss.omp_set_num_threads(1)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background tokenizer, the unindexed-fragment loader (waiting up to
        `timeout` seconds for each) and the stats thread (idempotent). Queries still work
        afterwards, doing that work inline."""
        self.ctx.closed.set()
        self.text.close(timeout)
        if self.unindexed is not None:
            self.table.unwatch_appends(self.unindexed)
            self.unindexed.close(timeout)
        if self.flushed_text is not None:
            self.table.unwatch_appends(self.flushed_text)
            self.flushed_text.close(timeout)
        self.ctx.close()

    @property
    def unindexed_bytes(self) -> int:
        """Bytes held under `unindexed_cache_bytes`: the vector cache and the flushed
        memtables kept for text search."""
        return self._held_bytes(vector=True) + self._held_bytes(vector=False)

    def _held_bytes(self, *, vector: bool) -> int:
        """Bytes held for unindexed base rows by the vector cache or by the text holder."""
        held = self.unindexed if vector else self.flushed_text
        return 0 if held is None else held.nbytes

    @property
    def lance_cache_bytes(self) -> int:
        """Bytes the shared Lance session's index and metadata caches hold now."""
        return self.ctx.lance_cache_bytes

    def snapshot(self) -> Snapshot:
        """Views first, then the base, then `fresh` (see `engine.reads.snapshot`)."""
        return self.ctx.snapshot()

    # ------------------------------------------------------------------ requests

    def parse_filter(self, text: str | None) -> Predicate | None:
        """Parse a filter against the table schema (None/blank = no filter).

        Raises:
            QueryError: see `engine.filters.parse_filter`.
        """
        return self.ctx.parse_filter(text)

    def columns(self, columns: Sequence[str] | None) -> list[str]:
        """The output columns (default: every table column), validated.

        Raises:
            UnknownColumn: a name is not a column of the table.
        """
        return self.ctx.columns(columns)

    def keys_of(self, table: pa.Table | pa.RecordBatch) -> list[Any]:
        """The primary-key value of every row (scalars, or tuples for a composite key)."""
        return self.ctx.keys_of(table)

    # ------------------------------------------------------------------ queries

    def search_vector(
        self,
        vector: Sequence[float] | np.ndarray,
        *,
        k: int = 10,
        filter: str | Predicate | None = None,  # noqa: A002 - the query language's word
        columns: Sequence[str] | None = None,
        nprobes: int | None = None,
        refine_factor: int | None = None,
        report: FanoutReport | None = None,
    ) -> pa.Table:
        """The k nearest visible rows to `vector` (metric of the table spec), nearest first.

        Returns the requested columns plus `_distance` (float32; see `engine.reads.vector`
        for its definition per metric).

        Raises:
            QueryError: no vector column, wrong dimension, non-finite values, k out of range,
                bad filter or unknown column.
            FreshRowsUnavailable: other pods' fresh rows are missing and `report` does not
                allow a partial answer (every query method; see the module docstring).
        """
        return self.vector.search(
            vector,
            k=k,
            filter=filter,
            columns=columns,
            nprobes=nprobes,
            refine_factor=refine_factor,
            report=report,
        )

    def search_text(
        self,
        text: str,
        *,
        k: int = 10,
        column: str | None = None,
        phrase: bool = False,
        filter: str | Predicate | None = None,  # noqa: A002 - the query language's word
        columns: Sequence[str] | None = None,
        report: FanoutReport | None = None,
    ) -> pa.Table:
        """BM25 full-text search of `text` in an FTS column; best first, with `_score`.

        Matches rows containing any query term (or, with `phrase`, the terms in order).
        See `engine.reads.text` and `engine.fts` for how scores combine across tiers.

        Raises:
            QueryError: no FTS column, unknown column, empty query, k out of range, bad filter.
        """
        return self.text.search(
            text,
            k=k,
            column=column,
            phrase=phrase,
            filter=filter,
            columns=columns,
            report=report,
        )

    def search_hybrid(
        self,
        vector: Sequence[float] | np.ndarray,
        text: str,
        *,
        k: int = 10,
        column: str | None = None,
        phrase: bool = False,
        filter: str | Predicate | None = None,  # noqa: A002 - the query language's word
        columns: Sequence[str] | None = None,
        nprobes: int | None = None,
        refine_factor: int | None = None,
        report: FanoutReport | None = None,
        beside: Executor | None = None,
    ) -> tuple[pa.Table, pa.Table]:
        """`search_vector` and `search_text` with the same k and filter, on ONE snapshot:
        (the vector result, the text result), each exactly what that search gives on this
        snapshot. With fan-out, each owner pod is asked once for both (see
        `engine.reads.hybrid`). The text half runs on `beside` meanwhile (None: after the
        vector half, on this thread).

        Raises:
            QueryError: see `search_vector` and `search_text`.
        """
        return self.hybrid.search(
            vector,
            text,
            k=k,
            column=column,
            phrase=phrase,
            filter=filter,
            columns=columns,
            nprobes=nprobes,
            refine_factor=refine_factor,
            report=report,
            beside=beside,
        )

    def scan(
        self,
        *,
        filter: str | Predicate | None = None,  # noqa: A002 - the query language's word
        columns: Sequence[str] | None = None,
        limit: int | None = None,
        report: FanoutReport | None = None,
    ) -> pa.Table:
        """Visible rows matching `filter` (all rows without one), at most `limit` rows
        (default `max_k`). Order: memtable rows (newest tier first), then base rows.

        Raises:
            QueryError: bad filter, unknown column, limit out of range.
        """
        return scan(self.ctx, filter=filter, columns=columns, limit=limit, report=report)

    def lookup(
        self,
        keys: Sequence[Any],
        *,
        columns: Sequence[str] | None = None,
        report: FanoutReport | None = None,
    ) -> pa.Table:
        """The visible rows of many primary keys in one call.

        `keys` holds one value per key for a single-column primary key, or one sequence
        (in `primary_key` order) per key for a composite one. Upsert tables return at most
        one row per key (its newest version; nothing for a deleted or unknown key). Append
        tables return every row with the key. Order is unspecified.

        Raises:
            QueryError: a key does not fit the key columns' types; unknown column.
        """
        return self.lookups.lookup(keys, columns=columns, report=report)

    def serve_fresh(self, body: bytes) -> bytes:
        """Answer another pod's fan-out request from this process's memtables (see
        `engine.reads.fresh`).

        Raises:
            QueryError: a malformed request.
        """
        return self.fresh.answer(body)


def recall(found: Sequence[Any], truth: Sequence[Any]) -> float:
    """|found ∩ truth| / |truth| (1.0 for an empty truth)."""
    if not truth:
        return 1.0
    return len(set(found) & set(truth)) / len(truth)


__all__ = [
    "DISTANCE",
    "SCORE",
    "Fanout",
    "FanoutReport",
    "MissingShard",
    "NoReaderEvents",
    "Reader",
    "ReaderEvents",
    "ReaderSettings",
    "Snapshot",
    "recall",
]
