"""Reads over the base Lance table plus every memtable of the shards this process owns.

One `Reader` per process serves vector kNN, full-text (BM25), filter/scan and primary-key
lookup. Each query works on one consistent snapshot taken in this order (the order
`ShardView.fresh` requires):

1. the views of every shard writer (active and frozen memtables, newest first) -- these
   hold only durable rows (I2: rows enter a memtable only after their WAL entry is durable);
2. then the base table at its latest version;
3. then `ShardView.fresh(base)`: memtables that base version already holds are skipped, so
   a row is never seen in both tiers and never in neither while it is being flushed.

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

Vector kNN: memtables are searched exactly with faiss on each batch's zero-copy vector
matrix (l2 and dot via `faiss.knn`; cosine as inner product with the normalised query
divided by row norms, which are computed vectorised once per batch and cached). The base is
searched with Lance's ANN index (`nprobes`, `refine_factor`) or, without an index, Lance's
exact search. The base fragments an index does not cover yet are held in memory and
searched exactly with faiss like memtables, pruned by their int8 codes where they have them
(`engine.unindexed`, `engine.prune`; Lance then searches only the indexed fragments), or,
over the cache's bound, by Lance's own flat scan. Distances follow
Lance's definitions so they compare across tiers: l2 = squared Euclidean distance,
cosine = 1 - cos, dot = 1 - inner product (what Lance returns, checked on this machine).
When the base has an index and no `refine_factor` is given (per request or in
`query.refine_factor`), `DEFAULT_REFINE_FACTOR` is used: the base's distances are then exact
re-ranked distances rather than PQ approximations (so merging by distance is sound), and
recall is far better (benchmark at 1M x 384: recall@10 0.63 with refine 1, 0.997 with 10).

Full-text: see `engine.fts` for the memtable BM25 and how IDF is combined across tiers.
Base fragments the text index does not cover yet are scored from the memtables this process
flushed into them (`engine.unindexed.FlushedText`), while Lance searches the indexed
fragments only; otherwise Lance searches the whole base (flat where unindexed).

Errors: `QueryError` (and subclasses) for a bad request. A poisoned or fenced shard is
skipped (its rows are served by its next owner after replay) and reported through
`ReaderEvents.shard_skipped`.

Threading: a `Reader` is shared by concurrent queries (the HTTP layer's worker threads).
Within a vector or text query, Lance's part of the base search runs on a base worker
(`ReaderSettings.base_workers`) while the calling thread searches the memtables.
faiss is limited to one OpenMP thread per call: on a 2-core machine shared with ingestion
a multi-threaded flat search over one 100k x 384 memtable was 8x slower (60 ms vs 7.7 ms)
than a single-threaded one; concurrency comes from concurrent queries instead.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import faiss
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import structlog
from lance.lance import _Session as LanceSession  # what lance.Session is
from lance.query import MatchQuery, PhraseQuery

from config.settings import QuerySettings
from engine import fts
from engine.errors import LanceSinkError
from engine.filters import Predicate, QueryError, UnknownColumn, parse_filter
from engine.memtable import Memtable, MemtableView, key_values
from engine.periodic import PeriodicThread
from engine.schema import TableSpec, vector_matrix
from engine.shard import ShardWriter
from engine.table import BaseTable
from engine.unindexed import (
    CachedFragment,
    FlushedText,
    HeldText,
    UnindexedFragments,
    covered_fragments,
)

log = structlog.get_logger("lance_sink.reader")

DISTANCE = "_distance"
SCORE = "_score"
T = TypeVar("T")
#: The shard name of the tiers `FlushedText` holds: flushed memtables searched for text.
FLUSHED_TIER = "(flushed)"

#: Fast path of a memtable batch's kNN: when at most this many rows of the batch are
#: excluded (dead, filtered out), ask faiss for k + excluded neighbours and drop the
#: excluded ones; above it, copy the eligible rows and search those. 4096 extra heap slots
#: cost ~1 ms on a 100k-row batch, about what copying 5% of it costs.
FAST_EXCLUDED_MAX = 4096
#: Filtered batch search: ask faiss for up to this many nearest rows of the whole batch
#: (enough to hold k eligible rows twice over at the batch's selectivity; the heap stays
#: small: as fast as k = 10 on a 100k-row batch) and keep the eligible ones. Tried before
#: the fast path whenever its heap is the smaller one: on 500-row batches (one put each) with
#: a 50% filter, k + excluded = 260 heap slots made the memtable part 1.5x slower (15.9 vs
#: 10.9 ms per 100k rows). A selectivity under ~2%, where that many would not hold k
#: eligible rows, copies the eligible rows and searches those instead (on a 50% filter the
#: copy made the memtable part 2x slower).
FILTER_OVERFETCH_MAX = 1024
#: A cached fragment's pruned search (`engine.prune`) re-ranks this many int8 candidates
#: first (on random 384-dim rows, the worst case, 256 of 100k proved the top 10), then
#: `PRUNE_GROWTH` times more per round while the bound does not prove the top k, as long
#: as that is at most `PRUNE_MAX_SHARE` of the eligible rows (then it scans them exactly).
PRUNE_FETCH = 256
PRUNE_GROWTH = 4
PRUNE_MAX_SHARE = 1 / 8
#: Re-ranking factor on an indexed base when none is configured: 10x k candidates re-scored
#: exactly cost ~4 ms more than 1x on a 1M x 384 IVF_PQ base and lift recall@10 from ~0.6
#: to ~1.0 (bench/query.py).
DEFAULT_REFINE_FACTOR = 10
#: Base over-fetch when rows are hidden by newer memtable versions: start with k plus this
#: many, then grow 4x per round (bounded by `MAX_FETCH_ROUNDS`).
BASE_OVERFETCH = 16
MAX_FETCH_ROUNDS = 6
#: avgdl of the base for BM25 is estimated from this many of its documents (per version).
AVGDL_SAMPLE_ROWS = 2_000
#: A term found in at least this many sampled base documents has its document frequency
#: estimated from the sample (relative error ~1/sqrt(20) ~ 22%, a few percent of IDF).
DF_SAMPLE_MIN_HITS = 20
#: A rare term's base document frequency is counted on the text-indexed fragments and
#: scaled to the whole base while the index covers at least this share of its rows (a flush
#: or two behind); below it, or with no index, Lance counts every row.
MIN_TEXT_INDEX_COVERAGE = 0.5
#: A query waits this long for a rare term's first count (Lance's FTS count: a few ms idle,
#: ~0.5 s while maintenance and flushes keep the CPUs busy: the text p99 under ingestion);
#: past it the query uses the sample's estimate, and the count, which goes on on the stats
#: thread, serves the next queries.
DF_WAIT_S = 0.05
#: What a failed background statistic run returns (its old value, if any, stays in use).
_FAILED = object()
#: Cached base statistics (df per term, documents, avgdl) for this many columns x terms.
STATS_CACHE_ENTRIES = 16_384
#: Base statistics computed at an older base version are reused while they are younger than
#: this and the base's row count moved by less than `STATS_MAX_DRIFT`: counting a common
#: term's documents in a 1M-row base takes tens of ms, and flushes make a new version every
#: few seconds, while IDF barely moves with a few percent more documents.
STATS_MAX_AGE_S = 30.0
STATS_MAX_DRIFT = 0.1
#: The background tokenizer looks for new memtable batches this often. Under ingestion at
#: ~30k rows/s a query then finds at most ~750 rows (~6 ms of tokenising) not tokenised
#: yet; a look costs one view per shard, microseconds for an append table.
TOKENIZE_INTERVAL_S = 0.025


class ReaderEvents(Protocol):
    """What the reader reports (the sink's metrics facade implements this)."""

    def query(self, kind: str, seconds: float, rows: int) -> None: ...
    def shard_skipped(self, shard: str, error: BaseException) -> None: ...


class NoReaderEvents:
    """ReaderEvents that records nothing."""

    def query(self, kind: str, seconds: float, rows: int) -> None:
        return None

    def shard_skipped(self, shard: str, error: BaseException) -> None:
        return None


@dataclass(frozen=True, slots=True)
class ReaderSettings:
    """Search tuning of the base tier (from `QuerySettings`)."""

    nprobes: int = 20
    refine_factor: int | None = None
    max_k: int = 1_000
    #: Bound of the unindexed-fragment cache (`engine.unindexed`); 0 turns it off.
    unindexed_cache_bytes: int = 1 << 30
    #: Threads that search the base while the querying thread searches the memtables (one
    #: per concurrent query: `query.max_concurrent_queries`).
    base_workers: int = 4
    #: Bounds of the Lance session's caches that every query on the base shares.
    lance_index_cache_bytes: int = 256 << 20
    lance_metadata_cache_bytes: int = 64 << 20

    @classmethod
    def from_settings(cls, query: QuerySettings) -> ReaderSettings:
        return cls(
            nprobes=query.nprobes,
            refine_factor=query.refine_factor,
            max_k=query.max_k,
            unindexed_cache_bytes=int(query.unindexed_cache_bytes),
            base_workers=query.max_concurrent_queries,
            lance_index_cache_bytes=int(query.lance_index_cache_bytes),
            lance_metadata_cache_bytes=int(query.lance_metadata_cache_bytes),
        )


# --------------------------------------------------------------------------- snapshot


class _Tier:
    """One fresh memtable of a snapshot, with the keys dicts of the tiers newer than it."""

    def __init__(
        self, shard: str, view: MemtableView, newer: tuple[_Tier, ...], spec: TableSpec
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

    def take(self, batch_idx: int, rows: np.ndarray, columns: list[str]) -> pa.Table:
        """`columns` of the given rows of batch `batch_idx`."""
        batch = self.view.batches[batch_idx]
        taken = batch.select(columns).take(pa.array(rows, pa.int64()))
        schema = pa.schema([self.spec.table_schema.field(c) for c in columns])
        return pa.Table.from_batches([pa.RecordBatch.from_arrays(taken.columns, schema=schema)])


class _FlushedTier(_Tier):
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


@dataclass(frozen=True, slots=True)
class _BaseKnn:
    """A vector query's base search in two parts that run in parallel: Lance's top `limit`
    rows (only the indexed fragments when the unindexed ones are cached), and the top
    `limit` of each cached unindexed fragment (faiss)."""

    lance: Callable[[int], pa.Table]
    fresh: Callable[[int], list[pa.Table]]

    def fetch(self, limit: int) -> pa.Table:
        return _top([self.lance(limit), *self.fresh(limit)], DISTANCE, limit, ascending=True)


@dataclass(frozen=True, slots=True)
class _Candidates:
    """Rows of one memtable batch that may make a query's top k, with their distance or
    score (`values`); materialised only if they do (`Reader._materialise`)."""

    tier: _Tier
    batch: int
    rows: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class Snapshot:
    """What one query reads: the fresh memtables (newest first) and one base version."""

    base: lance.LanceDataset
    tiers: tuple[_Tier, ...]

    def base_hidden(self, keys: list[Any]) -> np.ndarray:
        """For each key: does a fresh memtable decide it (so the base row is not shown)?"""
        upsert = [t for t in self.tiers if t.view.keys is not None]
        if not upsert:
            return np.zeros(len(keys), dtype=bool)
        return np.fromiter(
            (any(t.holds(k) for t in upsert) for k in keys), dtype=bool, count=len(keys)
        )


# --------------------------------------------------------------------------- reader


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
    ) -> None:
        self.spec = spec
        self.table = table
        self.shards = shards
        self.settings = settings or ReaderSettings()
        self.events: ReaderEvents = events or NoReaderEvents()
        self.terms = fts.MemtableTermCache()
        self._norms: weakref.WeakKeyDictionary[Memtable, list[np.ndarray]] = (
            weakref.WeakKeyDictionary()
        )
        self._norms_lock = threading.Lock()
        self._stats: dict[tuple[Any, ...], Any] = {}
        self._stats_lock = threading.Lock()
        self._refreshing: dict[tuple[Any, ...], Future[Any]] = {}
        self._stats_pool: ThreadPoolExecutor | None = None
        self._base_pool = ThreadPoolExecutor(
            self.settings.base_workers, thread_name_prefix="reader-base"
        )
        self._closed = threading.Event()
        self._key_types = [spec.table_schema.field(k).type for k in spec.primary_key]
        # One Lance session for every query, its caches bounded (Lance's defaults are 6 GiB
        # of index and 1 GiB of metadata cache: under queries the sink outgrew its pod).
        self._session: Any = LanceSession(
            index_cache_size_bytes=self.settings.lance_index_cache_bytes,
            metadata_cache_size_bytes=self.settings.lance_metadata_cache_bytes,
        )
        self._tokenizer = PeriodicThread(
            "reader-tokenizer", TOKENIZE_INTERVAL_S, self._tokenize_once, "reader_tokenize_failed"
        )
        # Base rows the indexes do not cover yet, held in memory (engine.unindexed): one
        # bound for both; this process's append flushes hand their rows over.
        bound = self.settings.unindexed_cache_bytes
        self.unindexed: UnindexedFragments | None = None
        self.flushed_text: FlushedText | None = None
        if spec.vector is not None and bound > 0:
            self.unindexed = UnindexedFragments(
                spec, bound, self._open_base, lambda: self._held_bytes(vector=False)
            )
            table.watch_appends(self.unindexed)
        if spec.fts_columns and bound > 0:
            vectors = self.unindexed
            self.flushed_text = FlushedText(
                spec.fts_columns,
                lambda: self._tokenizer.thread is not None and not self._closed.is_set(),
                (lambda n: n <= bound) if vectors is None else vectors.room_beside,
                self.terms,
                None if spec.vector is None else spec.vector.name,
            )
            table.watch_appends(self.flushed_text)
        faiss.omp_set_num_threads(1)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background tokenizer, the unindexed-fragment loader (waiting up to
        `timeout` seconds for each) and the stats thread (idempotent). Queries still work
        afterwards, doing that work inline."""
        self._closed.set()
        self._tokenizer.close(timeout)
        if self.unindexed is not None:
            self.table.unwatch_appends(self.unindexed)
            self.unindexed.close(timeout)
        if self.flushed_text is not None:
            self.table.unwatch_appends(self.flushed_text)
            self.flushed_text.clear()
        with self._stats_lock:
            pool = self._stats_pool
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self._base_pool.shutdown(wait=False)

    def _meanwhile(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on a base worker while the calling thread searches the memtables:
        Lance (base) and faiss/numpy (memtables) release the GIL, so a query takes about the
        longer of the two instead of their sum (vector + filter on a 1M-row base with a
        100k-row memtable: 37 + 18 ms). After `close`, inline."""
        try:
            return self._base_pool.submit(fn, *args)
        except RuntimeError:  # closed
            done: Future[T] = Future()
            try:
                done.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - re-raised by result()
                done.set_exception(exc)
            return done

    @property
    def unindexed_bytes(self) -> int:
        """Bytes held under `unindexed_cache_bytes`: the vector cache and the flushed
        memtables kept for text search."""
        return self._held_bytes(vector=True) + self._held_bytes(vector=False)

    def _held_bytes(self, *, vector: bool) -> int:
        """Bytes held for unindexed base rows by the vector cache or by the text holder."""
        held = self.unindexed if vector else self.flushed_text
        return 0 if held is None else held.nbytes

    def _tokenize_once(self) -> None:
        """Tokenise the new batches of every memtable of every shard (durable, visible rows
        only: a view holds nothing else); run every `TOKENIZE_INTERVAL_S` by the background
        tokenizer. Queries tokenise what it has not reached yet themselves."""
        for writer in self.shards():
            try:
                view = writer.view()
            except LanceSinkError:
                continue  # poisoned or fenced: queries skip it too
            for m in view.memtables:
                for column in self.spec.fts_columns:
                    self.terms.terms(m.memtable, column, m.batches)

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> Snapshot:
        """Views first, then the base, then `fresh` (see the module docstring)."""
        views = []
        for writer in self.shards():
            try:
                views.append(writer.view())
            except LanceSinkError as exc:
                self.events.shard_skipped(writer.shard, exc)
                log.warning("reader_shard_skipped", shard=writer.shard, error=str(exc))
        base = self._open_base()
        tiers: list[_Tier] = []
        for view in views:
            shard_tiers: list[_Tier] = []
            for m in view.fresh(base):
                # Newer = every tier already listed (earlier shards, then newer memtables).
                tier = _Tier(view.shard, m, (*tiers, *shard_tiers), self.spec)
                shard_tiers.append(tier)
            tiers.extend(shard_tiers)
        return Snapshot(base, tuple(tiers))

    @property
    def lance_cache_bytes(self) -> int:
        """Bytes the shared Lance session's index and metadata caches hold now."""
        return int(self._session.size_bytes())

    def _open_base(self) -> lance.LanceDataset:
        """The latest base version, opened with one Lance session shared by every query, so
        index and metadata caches stay warm (a fresh session per query made a 100-key lookup
        on a 1M-row base 4x slower: 32 ms vs 7 ms)."""
        return lance.dataset(
            self.table.uri, storage_options=self.table.options, session=self._session
        )

    # ------------------------------------------------------------------ helpers

    def parse_filter(self, text: str | None) -> Predicate | None:
        """Parse a filter against the table schema (None/blank = no filter).

        Raises:
            QueryError: see `engine.filters.parse_filter`.
        """
        if text is None or not text.strip():
            return None
        return parse_filter(text, self.spec.table_schema)

    def columns(self, columns: Sequence[str] | None) -> list[str]:
        """The output columns (default: every table column), validated.

        Raises:
            UnknownColumn: a name is not a column of the table.
        """
        names = self.spec.table_schema.names
        if columns is None:
            return list(names)
        out = []
        for c in columns:
            if c not in names:
                raise UnknownColumn(f"unknown column {c!r} (columns: {', '.join(names)})", column=c)
            if c not in out:
                out.append(c)
        return out

    def _check_k(self, k: int) -> None:
        if not 1 <= k <= self.settings.max_k:
            raise QueryError(f"k must be between 1 and {self.settings.max_k}, got {k}")

    def _fetch_columns(self, columns: list[str]) -> list[str]:
        """Output columns plus the key columns (needed to merge upsert tiers)."""
        extra = [k for k in self.spec.primary_key if k not in columns] if self.spec.upsert else []
        return [*columns, *extra]

    def keys_of(self, table: pa.Table | pa.RecordBatch) -> list[Any]:
        """The primary-key value of every row (scalars, or tuples for a composite key)."""
        return key_values(table, self.spec.primary_key)

    def _visible_in_tier(self, tier: _Tier, batch_idx: int, rows: np.ndarray) -> np.ndarray:
        """Subset of `rows` (of batch `batch_idx`) not decided by a newer tier."""
        if not tier.newer or not len(rows) or tier.view.keys is None:
            return rows
        batch = tier.view.batches[batch_idx]
        keys = self.keys_of(batch.select(list(self.spec.primary_key)).take(pa.array(rows)))
        visible: np.ndarray = rows[~tier.hidden(keys)]
        return visible

    def _finish(
        self, kind: str, started: float, parts: list[pa.Table], columns: list[str], extra: str
    ) -> pa.Table:
        schema = pa.schema(
            [self.spec.table_schema.field(c) for c in columns] + [pa.field(extra, pa.float32())]
        )
        tables = [p.select([*columns, extra]).cast(schema) for p in parts if p.num_rows]
        out = pa.concat_tables(tables) if tables else schema.empty_table()
        self.events.query(kind, time.monotonic() - started, out.num_rows)
        return out

    # ------------------------------------------------------------------ vector kNN

    def search_vector(
        self,
        vector: Sequence[float] | np.ndarray,
        *,
        k: int = 10,
        filter: str | Predicate | None = None,  # noqa: A002 - the query language's word
        columns: Sequence[str] | None = None,
        nprobes: int | None = None,
        refine_factor: int | None = None,
    ) -> pa.Table:
        """The k nearest visible rows to `vector` (metric of the table spec), nearest first.

        Returns the requested columns plus `_distance` (float32; see the module docstring for
        its definition per metric).

        Raises:
            QueryError: no vector column, wrong dimension, non-finite values, k out of range,
                bad filter or unknown column.
        """
        started = time.monotonic()
        spec_vec = self.spec.vector
        if spec_vec is None:
            raise QueryError("the table has no vector column")
        query = np.asarray(vector, dtype=np.float32).reshape(-1)
        if query.shape[0] != spec_vec.dim:
            raise QueryError(
                f"vector has dimension {query.shape[0]}, the table's is {spec_vec.dim}"
            )
        if not np.isfinite(query).all():
            raise QueryError("vector contains NaN or infinite values")
        self._check_k(k)
        predicate = filter if isinstance(filter, Predicate) else self.parse_filter(filter)
        out_cols = self.columns(columns)
        fetch = self._fetch_columns(out_cols)
        snap = self.snapshot()

        # Lance searches the base on a base worker meanwhile; faiss the memtables and the
        # base's unindexed fragments here.
        base = self._knn_base(snap, query, predicate, fetch, nprobes, refine_factor)
        limit = self._base_limit(snap, k)
        lance_first = self._meanwhile(base.lance, limit)
        candidates: list[_Candidates] = []
        for tier in snap.tiers:
            candidates.extend(self._knn_tier(tier, query, k, predicate))
        parts = self._materialise(candidates, k, fetch, DISTANCE, ascending=True)
        fresh_first = base.fresh(limit)
        first = _top([lance_first.result(), *fresh_first], DISTANCE, limit, ascending=True)
        parts.append(self._base_overfetch(snap, k, base.fetch, first))
        merged = _top(parts, DISTANCE, k, ascending=True)
        return self._finish("vector", started, [merged], out_cols, DISTANCE)

    def _materialise(
        self,
        candidates: list[_Candidates],
        k: int,
        fetch: list[str],
        column: str,
        *,
        ascending: bool,
    ) -> list[pa.Table]:
        """The rows of the k best memtable candidates (by `column` value), one table per
        batch they come from. Only winners are taken from their batches: with hundreds of
        small batches in a memtable, building a table per batch dominated a query."""
        if not candidates:
            return []
        values = np.concatenate([c.values for c in candidates])
        owner = np.repeat(np.arange(len(candidates)), [len(c.rows) for c in candidates])
        positions = np.concatenate([np.arange(len(c.rows)) for c in candidates])
        key = values if ascending else -values.astype(np.float64)
        best = np.argpartition(key, k - 1)[:k] if len(key) > k else np.arange(len(key))
        out = []
        for c in np.unique(owner[best]):
            mine = positions[best[owner[best] == c]]
            cand = candidates[int(c)]
            table = cand.tier.take(cand.batch, cand.rows[mine], fetch)
            out.append(table.append_column(column, pa.array(cand.values[mine], pa.float32())))
        return out

    def _batch_norms(self, tier: _Tier, i: int, matrix: np.ndarray) -> np.ndarray:
        memtable = tier.view.memtable
        with self._norms_lock:
            norms = self._norms.setdefault(memtable, [])
            if i < len(norms):
                return norms[i]
        computed = np.sqrt(np.einsum("ij,ij->i", matrix, matrix))
        with self._norms_lock:
            norms = self._norms.setdefault(memtable, [])
            while len(norms) < i:  # earlier batches not computed yet: fill in order
                j = len(norms)
                m = self._matrix(tier.view.batches[j])
                norms.append(np.sqrt(np.einsum("ij,ij->i", m, m)))
                memtable.account_cache(norms[-1].nbytes)
            if len(norms) == i:
                norms.append(computed)
                memtable.account_cache(computed.nbytes)
            return norms[i]

    def _matrix(self, batch: pa.RecordBatch) -> np.ndarray:
        assert self.spec.vector is not None
        column = batch.column(self.spec.vector.name)
        matrix = vector_matrix(column, self.spec.vector.dim)
        return np.ascontiguousarray(matrix, dtype=np.float32)

    def _knn_tier(
        self,
        tier: _Tier,
        query: np.ndarray,
        k: int,
        predicate: Predicate | None,
    ) -> list[_Candidates]:
        out = []
        for i, batch in enumerate(tier.view.batches):
            if not batch.num_rows:
                continue
            eligible = tier.eligible(i, predicate)
            want = k
            while True:
                rows, dist = self._knn_batch(tier, i, query, want, eligible)
                visible = self._visible_in_tier(tier, i, rows)
                available = batch.num_rows if eligible is None else int(eligible.sum())
                if len(visible) >= min(k, len(rows)) or len(rows) >= available:
                    break
                want *= 4
            if len(visible) < len(rows):
                keep = np.isin(rows, visible)
                rows, dist = rows[keep], dist[keep]
            if len(rows):
                out.append(_Candidates(tier, i, rows, dist))
        return out

    def _knn_batch(
        self,
        tier: _Tier,
        i: int,
        query: np.ndarray,
        k: int,
        eligible: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k among the eligible rows of one batch: (row indices, distances)."""
        assert self.spec.vector is not None
        matrix = self._matrix(tier.view.batches[i])
        return _exact_knn(
            matrix,
            lambda: self._batch_norms(tier, i, matrix),
            query,
            k,
            eligible,
            self.spec.vector.metric,
        )

    def _knn_fragments(
        self,
        fragments: list[CachedFragment],
        query: np.ndarray,
        k: int,
        predicate: Predicate | None,
        fetch: list[str],
    ) -> list[pa.Table]:
        """Exact top-k of the cached unindexed base fragments (`engine.unindexed`), one table
        of candidates (`fetch` columns and `_distance`) per fragment that has any."""
        assert self.spec.vector is not None
        out = []
        for fragment in fragments:
            if not fragment.num_rows:
                continue
            eligible = None if predicate is None else predicate.mask(fragment.rows)
            rows, dist = _fragment_knn(fragment, query, k, eligible, self.spec.vector.metric)
            if len(rows):
                table = fragment.take(fetch, rows)
                out.append(table.append_column(DISTANCE, pa.array(dist, pa.float32())))
        return out

    def _knn_base(
        self,
        snap: Snapshot,
        query: np.ndarray,
        predicate: Predicate | None,
        fetch: list[str],
        nprobes: int | None,
        refine_factor: int | None,
    ) -> _BaseKnn:
        """How to search the base: Lance's part and the cached unindexed fragments' part."""
        assert self.spec.vector is not None
        base = snap.base
        vector_name = self.spec.vector.name
        if base.count_rows() == 0:
            return _BaseKnn(lambda limit: pa.table({}), lambda limit: [])
        refine = refine_factor if refine_factor is not None else self.settings.refine_factor
        indexed = self._cached(
            base,
            ("vector_index",),
            lambda: covered_fragments(base, vector_name, text=False) is not None,
            reuse=False,
        )
        if refine is None and indexed:
            refine = DEFAULT_REFINE_FACTOR
        nearest: dict[str, Any] = {
            "column": self.spec.vector.name,
            "q": query,
            "metric": self.spec.vector.metric,
            "nprobes": nprobes or self.settings.nprobes,
        }
        if refine is not None:
            nearest["refine_factor"] = refine
        # The fragments the index does not cover yet, in memory: Lance searches only the
        # indexed ones (fast_search) and faiss the rest (see engine.unindexed).
        cached = self.unindexed.covering(base) if indexed and self.unindexed is not None else None

        def lance_rows(limit: int) -> pa.Table:
            found: pa.Table = base.to_table(
                nearest={**nearest, "k": limit},
                filter=None if predicate is None else predicate.sql,
                prefilter=True,
                columns=[*fetch, DISTANCE],
                fast_search=cached is not None,
            )
            return found

        def fresh_rows(limit: int) -> list[pa.Table]:
            return self._knn_fragments(cached, query, limit, predicate, fetch) if cached else []

        return _BaseKnn(lance_rows, fresh_rows)

    def _any_keys(self, snap: Snapshot) -> bool:
        """May a fresh memtable decide some base rows' keys (upserts or deletes)?"""
        return self.spec.upsert and any(t.view.keys for t in snap.tiers)

    def _base_limit(self, snap: Snapshot, k: int) -> int:
        """Base rows fetched first: k, plus `BASE_OVERFETCH` when fresh memtables may
        decide some base rows' keys."""
        return k + (BASE_OVERFETCH if self._any_keys(snap) else 0)

    def _base_overfetch(
        self,
        snap: Snapshot,
        k: int,
        fetch_rows: Callable[[int], pa.Table],
        first: pa.Table | None = None,
    ) -> pa.Table:
        """Fetch the base's top rows, dropping those decided by a fresh memtable, asking for
        more (4x per round) while hidden rows leave fewer than k. `first` is the first
        round's result when the caller fetched it already."""
        any_keys = self._any_keys(snap)
        limit = self._base_limit(snap, k)
        for _ in range(MAX_FETCH_ROUNDS):
            table = first if first is not None else fetch_rows(limit)
            first = None
            if not any_keys or not table.num_rows:
                return table
            hidden = snap.base_hidden(self.keys_of(table))
            visible = table.filter(pa.array(~hidden))
            if visible.num_rows >= k or table.num_rows < limit:
                return visible
            limit *= 4
        return visible

    # ------------------------------------------------------------------ full text

    def search_text(
        self,
        text: str,
        *,
        k: int = 10,
        column: str | None = None,
        phrase: bool = False,
        filter: str | Predicate | None = None,  # noqa: A002 - the query language's word
        columns: Sequence[str] | None = None,
    ) -> pa.Table:
        """BM25 full-text search of `text` in an FTS column; best first, with `_score`.

        Matches rows containing any query term (or, with `phrase`, the terms in order).
        See `engine.fts` and the module docstring for how scores combine across tiers.

        Raises:
            QueryError: no FTS column, unknown column, empty query, k out of range, bad filter.
        """
        started = time.monotonic()
        if not self.spec.fts_columns:
            raise QueryError("the table has no full-text (fts_columns) column")
        column = column or self.spec.fts_columns[0]
        if column not in self.spec.fts_columns:
            raise UnknownColumn(
                f"{column!r} is not a full-text column (fts_columns: "
                f"{', '.join(self.spec.fts_columns)})",
                column=column,
            )
        self._check_k(k)
        self._tokenizer.start()
        words = fts.tokenize(text)
        if not words:
            raise QueryError("the text query has no searchable terms (only stop words?)")
        predicate = filter if isinstance(filter, Predicate) else self.parse_filter(filter)
        out_cols = self.columns(columns)
        fetch = self._fetch_columns(out_cols)
        snap = self.snapshot()

        # Memtable statistics (eligible rows) and term frequencies, per tier and batch.
        terms = list(dict.fromkeys(t for t, _ in words))
        # Term frequencies are computed once per batch and term, for the document frequency
        # and the scores; a batch without any query term is only counted, never scored.
        per_batch: list[
            tuple[_Tier, int, np.ndarray, fts.BatchTerms, dict[str, int], dict[str, np.ndarray]]
        ] = []
        n_mem = 0
        len_mem = 0
        df_mem = dict.fromkeys(terms, 0)
        # Flushed memtables standing for base fragments the text index lacks: scored here,
        # counted in the base's statistics already, and Lance searches only indexed rows.
        held = None if self.flushed_text is None else self.flushed_text.views(snap.base, column)
        flushed = [_FlushedTier(h, snap.base, self.spec) for h in held or ()]
        base = self._meanwhile(
            self._text_base, snap, text, column, phrase, predicate, k, fetch, held is not None
        )
        for tier in (*snap.tiers, *flushed):
            counted = tier.shard != FLUSHED_TIER
            vocab, batches = self.terms.terms(tier.view.memtable, column, tier.view.batches)
            for i, bt in enumerate(batches):
                eligible = tier.view.live[i]
                live = bt.valid if eligible is None else eligible & bt.valid
                if counted:
                    n_mem += int(live.sum())
                    len_mem += int(bt.doc_len[live].sum())
                tfs: dict[str, np.ndarray] = {}
                for t in terms:
                    tid = vocab.get(t)
                    if tid is None:
                        continue
                    tf = fts.term_frequencies(bt, tid)
                    df = int((tf[live] > 0).sum())
                    if df:
                        df_mem[t] += df if counted else 0
                        tfs[t] = tf
                if tfs:
                    per_batch.append((tier, i, live, bt, vocab, tfs))

        n_base, avgdl_base, _, _ = self._base_text_stats(snap.base, column)
        n_total = n_base + n_mem
        avgdl = (avgdl_base * n_base + len_mem) / n_total if n_total else 1.0
        term_idf = {
            t: fts.idf(n_total, self._base_df(snap.base, column, t) + df_mem[t]) for t in terms
        }

        candidates: list[_Candidates] = []
        for tier, i, live, bt, vocab, tfs in per_batch:
            found = self._bm25_batch(
                tier, i, live, bt, vocab, tfs, words, phrase, term_idf, avgdl, predicate, k
            )
            if found is not None:
                candidates.append(found)
        parts = self._materialise(candidates, k, fetch, SCORE, ascending=False)
        parts.append(base.result())
        merged = _top(parts, SCORE, k, ascending=False)
        return self._finish("text", started, [merged], out_cols, SCORE)

    def _bm25_batch(
        self,
        tier: _Tier,
        i: int,
        live: np.ndarray,
        bt: fts.BatchTerms,
        vocab: dict[str, int],
        tfs: dict[str, np.ndarray],
        words: list[tuple[str, int]],
        phrase: bool,
        term_idf: dict[str, float],
        avgdl: float,
        predicate: Predicate | None,
        k: int,
    ) -> _Candidates | None:
        ids = [vocab.get(t) for t, _ in words]
        if phrase and any(t is None for t in ids):
            return None
        score = np.zeros(len(bt.doc_len), dtype=np.float64)
        for term, tf in tfs.items():  # the query terms some live row of the batch holds
            score += fts.bm25(tf, bt.doc_len, term_idf[term], avgdl)
        mask = live & (score > 0)
        if phrase and mask.any():
            known = [t for t in ids if t is not None]
            mask &= fts.phrase_rows(bt, known, [p - words[0][1] for _, p in words])
        if predicate is not None and mask.any():
            mask &= tier.matched(predicate, i)
        rows = np.flatnonzero(mask)
        if not len(rows):
            return None
        want = k
        while True:
            top = rows[np.argsort(-score[rows], kind="stable")[:want]]
            visible = self._visible_in_tier(tier, i, top)
            if len(visible) >= min(k, len(top)) or len(top) == len(rows):
                break
            want *= 4
        if not len(visible):
            return None
        return _Candidates(tier, i, visible, score[visible].astype(np.float32))

    def _text_base(
        self,
        snap: Snapshot,
        text: str,
        column: str,
        phrase: bool,
        predicate: Predicate | None,
        k: int,
        fetch: list[str],
        indexed_only: bool,
    ) -> pa.Table:
        if snap.base.count_rows() == 0:
            return pa.table({})
        query = PhraseQuery(text, column) if phrase else MatchQuery(text, column)

        def fetch_rows(limit: int) -> pa.Table:
            return snap.base.to_table(
                full_text_query=query,
                filter=None if predicate is None else predicate.sql,
                prefilter=True,
                columns=[*fetch, SCORE],
                limit=limit,
                fast_search=indexed_only,
            )

        return self._base_overfetch(snap, k, fetch_rows)

    def _cached(
        self,
        base: lance.LanceDataset,
        key: tuple[Any, ...],
        compute: Callable[[], Any],
        *,
        reuse: bool = True,
        wait_s: float | None = None,
        estimate: Any = None,
    ) -> Any:
        """`compute()` for this base version, or (with `reuse`) a recent value computed at a
        similar version (see `STATS_MAX_AGE_S`). With `reuse`, an older value is returned
        as it is while `compute()` runs again on the background stats thread (one run per
        key at a time): recounting a 1M-row base's documents took hundreds of ms, which a
        query then waited for every 30 s (the text p99 under ingestion).

        With `wait_s`, a value not cached yet is computed on the stats thread too, and
        waited for at most `wait_s` seconds; past that (or if it fails) the query gets
        `estimate`, and the value, once computed, serves the next queries."""
        version, rows, now = int(base.version), base.count_rows(), time.monotonic()
        with self._stats_lock:
            hit = self._stats.get(key)
        if hit is not None:
            value, at_version, at_rows, at_time = hit
            drift = abs(rows - at_rows) / max(at_rows, 1)
            if at_version == version:
                return value
            if reuse and at_rows > 0:
                if now - at_time >= STATS_MAX_AGE_S or drift >= STATS_MAX_DRIFT:
                    self._stats_in_background(key, compute, version, rows)
                return value
        if wait_s is not None:
            future = self._stats_in_background(key, compute, version, rows)
            if future is not None:  # None: the reader is closed, compute inline
                try:
                    value = future.result(timeout=wait_s)
                except TimeoutError:
                    return estimate
                return estimate if value is _FAILED else value
        value = compute()
        self._store_stats(key, value, version, rows, now)
        return value

    def _store_stats(
        self, key: tuple[Any, ...], value: Any, version: int, rows: int, at: float
    ) -> None:
        with self._stats_lock:
            if len(self._stats) >= STATS_CACHE_ENTRIES:
                self._stats.clear()
            self._stats[key] = (value, version, rows, at)

    def _stats_in_background(
        self, key: tuple[Any, ...], compute: Callable[[], Any], version: int, rows: int
    ) -> Future[Any] | None:
        """Compute a statistic on the background stats thread: a stale value's refresh, or
        a first value a query waits for at most `wait_s` (at most one run per key queued or
        running: returns that run's future, whose result is the value or `_FAILED`; a
        failure keeps the old value, logged). None once the reader is closed."""
        with self._stats_lock:
            running = self._refreshing.get(key)
            if running is not None or self._closed.is_set():
                return running
            if self._stats_pool is None:
                self._stats_pool = ThreadPoolExecutor(1, thread_name_prefix="reader-stats")
            pool = self._stats_pool

            def run() -> Any:
                try:
                    value = compute()
                except Exception as exc:  # noqa: BLE001 - the old value stays in use
                    log.warning("reader_stats_refresh_failed", key=str(key), error=str(exc))
                    value = _FAILED
                else:
                    self._store_stats(key, value, version, rows, time.monotonic())
                finally:
                    with self._stats_lock:
                        self._refreshing.pop(key, None)
                return value

            future = pool.submit(run)
            self._refreshing[key] = future
            return future

    def _base_text_stats(
        self, base: lance.LanceDataset, column: str
    ) -> tuple[int, float, int, dict[str, int]]:
        """(documents, average tokens per document, sample size, documents per term in the
        sample) of the base. The sample is its first `AVGDL_SAMPLE_ROWS` documents."""

        def compute() -> tuple[int, float, int, dict[str, int]]:
            # Lance counts documents with a non-null text only (checked on this machine).
            has_text = pc.field(column).is_valid()
            n = base.count_rows(filter=has_text)
            if not n:
                return 0, 0.0, 0, {}
            sample = base.to_table(columns=[column], filter=has_text, limit=AVGDL_SAMPLE_ROWS)
            terms, _ = fts.tokenize_batch(sample.column(column).to_pylist())
            per_term: dict[str, int] = {}
            for doc in terms:
                for t in set(doc):
                    per_term[t] = per_term.get(t, 0) + 1
            avgdl = sum(len(t) for t in terms) / max(len(terms), 1)
            return n, avgdl, len(terms), per_term

        result: tuple[int, float, int, dict[str, int]] = self._cached(
            base, ("text", column), compute
        )
        return result

    def _base_df(self, base: lance.LanceDataset, column: str, term: str) -> int:
        """Base documents containing `term`: exact from the sample when it covers the whole
        base; estimated from the sample for a common term (>= `DF_SAMPLE_MIN_HITS` sample
        documents, so within ~25%); otherwise counted with Lance's FTS (cheap for a rare
        term, whose posting list is short). Cached, see `_cached`."""
        n, _, sample_n, sample_df = self._base_text_stats(base, column)
        if not n:
            return 0
        hits = sample_df.get(term, 0)
        if sample_n >= n:
            return hits
        if hits >= DF_SAMPLE_MIN_HITS:
            return round(hits / sample_n * n)
        # While a first count takes longer than DF_WAIT_S: the sample's estimate (half a
        # document for a term the sample lacks).
        estimate = round(max(hits, 0.5) / sample_n * n)

        def compute() -> int:
            query = MatchQuery(term, column)
            covered = self._text_index_coverage(base, column)
            if covered is None or covered >= 1.0 or covered < MIN_TEXT_INDEX_COVERAGE:
                return int(base.scanner(full_text_query=query).count_rows())
            # The index lags a flush or two: count on the indexed fragments only and scale
            # to the whole base (Lance's full count scans the unindexed rows flat, once per
            # new term: the text p99 under ingestion).
            indexed = int(base.scanner(full_text_query=query, fast_search=True).count_rows())
            return round(indexed / covered)

        result: int = self._cached(
            base, ("df", column, term), compute, wait_s=DF_WAIT_S, estimate=estimate
        )
        return result

    def _text_index_coverage(self, base: lance.LanceDataset, column: str) -> float | None:
        """Share of the base's rows the INVERTED index on `column` covers (None: no index)."""

        def compute() -> float | None:
            covered = covered_fragments(base, column, text=True)
            if covered is None:
                return None
            rows = indexed = 0
            for fragment in base.get_fragments():
                n = int(fragment.count_rows())
                rows += n
                if int(fragment.fragment_id) in covered:
                    indexed += n
            return indexed / rows if rows else 1.0

        result: float | None = self._cached(
            base, ("text_index_coverage", column), compute, reuse=False
        )
        return result

    # ------------------------------------------------------------------ filter / scan

    def scan(
        self,
        *,
        filter: str | Predicate | None = None,  # noqa: A002 - the query language's word
        columns: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> pa.Table:
        """Visible rows matching `filter` (all rows without one), at most `limit` rows
        (default `max_k`). Order: memtable rows (newest tier first), then base rows.

        Raises:
            QueryError: bad filter, unknown column, limit out of range.
        """
        started = time.monotonic()
        limit = self.settings.max_k if limit is None else limit
        self._check_k(limit)
        predicate = filter if isinstance(filter, Predicate) else self.parse_filter(filter)
        out_cols = self.columns(columns)
        fetch = self._fetch_columns(out_cols)
        snap = self.snapshot()
        parts: list[pa.Table] = []
        remaining = limit
        for tier in snap.tiers:
            for i, batch in enumerate(tier.view.batches):
                if remaining <= 0:
                    break
                if not batch.num_rows:
                    continue
                eligible = tier.eligible(i, predicate)
                rows = np.arange(batch.num_rows) if eligible is None else np.flatnonzero(eligible)
                rows = self._visible_in_tier(tier, i, rows)[:remaining]
                if len(rows):
                    parts.append(tier.take(i, rows, fetch))
                    remaining -= len(rows)
        if remaining > 0 and snap.base.count_rows():

            def fetch_rows(n: int) -> pa.Table:
                return snap.base.to_table(
                    filter=None if predicate is None else predicate.sql,
                    columns=fetch,
                    limit=n,
                )

            parts.append(self._base_overfetch(snap, remaining, fetch_rows).slice(0, remaining))
        tables = [p.select(out_cols) for p in parts if p.num_rows]
        schema = pa.schema([self.spec.table_schema.field(c) for c in out_cols])
        out = pa.concat_tables([t.cast(schema) for t in tables]) if tables else schema.empty_table()
        self.events.query("scan", time.monotonic() - started, out.num_rows)
        return out

    # ------------------------------------------------------------------ lookup

    def lookup(self, keys: Sequence[Any], *, columns: Sequence[str] | None = None) -> pa.Table:
        """The visible rows of many primary keys in one call.

        `keys` holds one value per key for a single-column primary key, or one sequence
        (in `primary_key` order) per key for a composite one. Upsert tables return at most
        one row per key (its newest version; nothing for a deleted or unknown key). Append
        tables return every row with the key. Order is unspecified.

        Raises:
            QueryError: a key does not fit the key columns' types; unknown column.
        """
        started = time.monotonic()
        wanted = self._normalise_keys(keys)
        out_cols = self.columns(columns)
        fetch = list(dict.fromkeys([*out_cols, *self.spec.primary_key]))
        snap = self.snapshot()
        parts: list[pa.Table] = []
        if self.spec.upsert:
            pending = dict.fromkeys(wanted)
            for tier in snap.tiers:
                if not pending:
                    break
                parts.extend(self._lookup_upsert_tier(tier, pending, fetch))
            remaining = list(pending)
        else:
            for tier in snap.tiers:
                parts.extend(self._lookup_append_tier(tier, wanted, fetch))
            remaining = wanted
        if remaining and snap.base.count_rows():
            base = snap.base.to_table(filter=self._key_expression(remaining), columns=fetch)
            base = base.filter(pa.array(self._key_match(base, set(remaining))))
            parts.append(base)
        tables = [p.select(out_cols) for p in parts if p.num_rows]
        schema = pa.schema([self.spec.table_schema.field(c) for c in out_cols])
        out = pa.concat_tables([t.cast(schema) for t in tables]) if tables else schema.empty_table()
        self.events.query("lookup", time.monotonic() - started, out.num_rows)
        return out

    def _normalise_keys(self, keys: Sequence[Any]) -> list[Any]:
        names = self.spec.primary_key
        columns: list[list[Any]] = [[] for _ in names]
        for key in keys:
            parts = list(key) if len(names) > 1 and isinstance(key, list | tuple) else [key]
            if len(parts) != len(names):
                raise QueryError(
                    f"a key needs {len(names)} values ({', '.join(names)}), got {key!r}"
                )
            for col, part in zip(columns, parts, strict=True):
                col.append(part)
        arrays = []
        for name, values, ktype in zip(names, columns, self._key_types, strict=True):
            for value in values:
                if not _fits_key_type(value, ktype):
                    raise QueryError(
                        f"key value {value!r} ({type(value).__name__}) is not a {ktype} value "
                        f"of key column {name!r}"
                    )
            try:
                arrays.append(pa.array(values, type=ktype))
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
                raise QueryError(f"key values do not fit column {name!r} ({ktype}): {exc}") from exc
            if arrays[-1].null_count:
                raise QueryError(f"null in key column {name!r}")
        if len(names) == 1:
            return list(dict.fromkeys(arrays[0].to_pylist()))
        return list(dict.fromkeys(zip(*(a.to_pylist() for a in arrays), strict=True)))

    def _lookup_upsert_tier(
        self, tier: _Tier, pending: dict[Any, None], fetch: list[str]
    ) -> list[pa.Table]:
        keys = tier.view.keys
        assert keys is not None
        found: list[int] = []
        for key in list(pending):
            rid = keys.get(key)
            if rid is None:
                continue
            if rid >= tier.rows:  # updated after the snapshot: find its row in the view
                rid = tier.find_in_view(key)
                if rid is None:
                    continue
            del pending[key]  # this tier decides the key (upsert or delete)
            found.append(rid)
        if not found:
            return []
        rids = np.asarray(sorted(found), dtype=np.int64)
        batch_of = np.searchsorted(tier.starts, rids, side="right") - 1
        out = []
        for b in np.unique(batch_of):
            rows = rids[batch_of == b] - tier.starts[b]
            live = tier.view.live[b]
            if live is not None:
                rows = rows[live[rows]]
            if len(rows):
                out.append(tier.take(int(b), rows, fetch))
        return out

    def _lookup_append_tier(
        self, tier: _Tier, wanted: list[Any], fetch: list[str]
    ) -> list[pa.Table]:
        wanted_set = set(wanted)
        value_sets = self._key_value_sets(wanted)
        out = []
        for i, batch in enumerate(tier.view.batches):
            if not batch.num_rows:
                continue
            mask = self._key_match(batch, wanted_set, value_sets)
            live = tier.view.live[i]
            if live is not None:
                mask &= live
            rows = np.flatnonzero(mask)
            if len(rows):
                out.append(tier.take(i, rows, fetch))
        return out

    def _key_value_sets(self, keys: list[Any]) -> list[pa.Array]:
        """The distinct values of each key column among `keys` (Arrow arrays for `is_in`)."""
        names = self.spec.primary_key
        return [
            pa.array(list({k[j] if len(names) > 1 else k for k in keys}), type=ktype)
            for j, ktype in enumerate(self._key_types)
        ]

    def _key_match(
        self,
        table: pa.Table | pa.RecordBatch,
        wanted: set[Any],
        value_sets: list[pa.Array] | None = None,
    ) -> np.ndarray:
        """Rows whose key is in `wanted` (vectorised `is_in` per key column, then an exact
        tuple check of the few candidates for composite keys)."""
        names = self.spec.primary_key
        sets = value_sets if value_sets is not None else self._key_value_sets(list(wanted))
        mask = np.ones(table.num_rows, dtype=bool)
        for name, values in zip(names, sets, strict=True):
            hit = pc.fill_null(pc.is_in(table.column(name), value_set=values), False)
            mask &= hit.to_numpy(zero_copy_only=False)
        if len(names) > 1 and mask.any():
            rows = np.flatnonzero(mask)
            sub = table.take(pa.array(rows))
            exact = np.fromiter(
                (k in wanted for k in self.keys_of(sub)), dtype=bool, count=len(rows)
            )
            mask[rows[~exact]] = False
        return mask

    def _key_expression(self, keys: list[Any]) -> pc.Expression:
        expr: pc.Expression | None = None
        for name, values in zip(self.spec.primary_key, self._key_value_sets(keys), strict=True):
            part = pc.field(name).isin(values)
            expr = part if expr is None else expr & part
        assert expr is not None
        return expr


# --------------------------------------------------------------------------- helpers


def _fits_key_type(value: Any, ktype: pa.DataType) -> bool:
    """Whether a lookup key value is of its column's type as it is, with no conversion:
    Arrow would truncate 1.5 to 1 for an int64 key, or read True as 1, and return the row
    of another key. (A null is refused on its own, after the conversion.)"""
    if value is None:
        return True
    if pa.types.is_integer(ktype):
        return isinstance(value, int) and not isinstance(value, bool)
    if pa.types.is_floating(ktype):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if pa.types.is_string(ktype) or pa.types.is_large_string(ktype):
        return isinstance(value, str)
    if pa.types.is_boolean(ktype):
        return isinstance(value, bool)
    return True  # other types: Arrow's own conversion decides


def _exact_knn(
    matrix: np.ndarray,
    norms: Callable[[], np.ndarray],
    query: np.ndarray,
    k: int,
    eligible: np.ndarray | None,
    metric: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k among the eligible rows of a contiguous float32 matrix: (row indices,
    distances in Lance's terms). `norms()` gives the row norms (used for cosine only)."""
    n = matrix.shape[0]
    excluded = 0 if eligible is None else n - int(eligible.sum())
    if excluded == n:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    q = query.reshape(1, -1)
    if metric != "cosine" and eligible is not None and excluded:
        # The nearest kk rows of the whole matrix, of which the eligible ones are the exact
        # top of the eligible rows if there are k of them (an eligible row outside is
        # farther than all kk). kk expects k eligible rows twice over at the matrix's
        # selectivity; otherwise the fast path or the copy below.
        kk = math.ceil(2 * k * n / (n - excluded)) + 16
        if kk <= FILTER_OVERFETCH_MAX and kk < min(n, k + excluded):
            rows, dist = _faiss_knn(q, matrix, kk, metric)
            keep = eligible[rows]
            if int(keep.sum()) >= k:
                return rows[keep][:k], dist[keep][:k]
    if metric != "cosine" and excluded <= FAST_EXCLUDED_MAX:
        kk = min(n, k + excluded)
        rows, dist = _faiss_knn(q, matrix, kk, metric)
        if eligible is not None:
            keep = eligible[rows]
            rows, dist = rows[keep], dist[keep]
        return rows[:k], dist[:k]
    index = np.flatnonzero(eligible) if eligible is not None else None
    sub = matrix if index is None else matrix[index]
    if metric == "cosine":
        all_norms = norms()
        sub_norms = all_norms if index is None else all_norms[index]
        qn = query / max(float(np.linalg.norm(query)), 1e-30)
        with np.errstate(invalid="ignore", divide="ignore"):
            dist_all = 1.0 - (sub @ qn) / sub_norms
        dist_all = np.where(np.isfinite(dist_all), dist_all, 1.0).astype(np.float32)
        kk = min(k, len(dist_all))
        top = np.argpartition(dist_all, kk - 1)[:kk] if kk < len(dist_all) else np.arange(kk)
        top = top[np.argsort(dist_all[top], kind="stable")]
        rows_sub, dist = top, dist_all[top]
    else:
        rows_sub, dist = _faiss_knn(q, np.ascontiguousarray(sub), min(k, sub.shape[0]), metric)
    rows = rows_sub if index is None else index[rows_sub]
    return rows.astype(np.int64), dist.astype(np.float32)


def _fragment_knn(
    fragment: CachedFragment,
    query: np.ndarray,
    k: int,
    eligible: np.ndarray | None,
    metric: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k among the eligible rows of a cached fragment: its int8 pruner's
    candidates re-ranked exactly, when the pruner's bound proves them the top k
    (`engine.prune`), else the exact scan of the whole matrix."""
    pruner = fragment.pruner
    count = fragment.num_rows if eligible is None else int(eligible.sum())
    fetch = max(PRUNE_FETCH, PRUNE_GROWTH * k)
    while pruner is not None and fetch <= count * PRUNE_MAX_SHARE:
        rows, floor = pruner.search(query, fetch, eligible)
        norms = fragment.row_norms()
        top, dist = _exact_knn(
            np.ascontiguousarray(fragment.matrix[rows]),
            _given(norms[rows] if len(norms) else norms),
            query,
            k,
            None,
            metric,
        )
        if math.isinf(floor) or (len(dist) == k and float(dist[-1]) < floor):
            return rows[top], dist
        fetch *= PRUNE_GROWTH
    return _exact_knn(fragment.matrix, fragment.row_norms, query, k, eligible, metric)


def _given(value: np.ndarray) -> Callable[[], np.ndarray]:
    return lambda: value


def _faiss_knn(
    q: np.ndarray, matrix: np.ndarray, k: int, metric: str
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by faiss in Lance's distance terms (l2: squared; dot: 1 - ip)."""
    if k <= 0 or matrix.shape[0] == 0:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    if metric == "l2":
        dist, idx = faiss.knn(q, matrix, k)
        dist_row = dist[0]
    else:
        ip, idx = faiss.knn(q, matrix, k, metric=faiss.METRIC_INNER_PRODUCT)
        dist_row = 1.0 - ip[0]
    rows = idx[0]
    valid = rows >= 0
    return rows[valid].astype(np.int64), dist_row[valid].astype(np.float32)


def _top(parts: list[pa.Table], column: str, k: int, *, ascending: bool) -> pa.Table:
    tables = [p for p in parts if p.num_rows]
    if not tables:
        return parts[0] if parts else pa.table({})
    merged = pa.concat_tables(tables, promote_options="permissive")
    order = "ascending" if ascending else "descending"
    idx = pc.sort_indices(merged, sort_keys=[(column, order)])
    return merged.take(idx.slice(0, k))


def recall(found: Sequence[Any], truth: Sequence[Any]) -> float:
    """|found ∩ truth| / |truth| (1.0 for an empty truth)."""
    if not truth:
        return 1.0
    return len(set(found) & set(truth)) / len(truth)


__all__ = [
    "DISTANCE",
    "SCORE",
    "NoReaderEvents",
    "Reader",
    "ReaderEvents",
    "ReaderSettings",
    "Snapshot",
    "recall",
]
