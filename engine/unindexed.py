"""The base fragments the vector index does not cover yet, held in memory for exact search.

Why: a flush appends a fragment that the vector index covers only after maintenance's next
`optimize_indices` pass. Lance searches such fragments with a flat scan that reads and
decodes them on every query: on this machine 474 ms per query for 300k x 384 unindexed rows,
against 12 ms for the indexed part (``fast_search``) and 54 ms for faiss over the same 300k
rows in memory. Under ingestion that flat scan took most of the CPU, which slowed the index
optimisation, which grew the unindexed part: base queries went from 18 ms to 500 ms.

What: `UnindexedFragments` holds, per fragment the vector index does not cover, that
fragment's rows (deletions applied): its vectors as one contiguous float32 matrix, its other
columns as Arrow arrays. A vector query on an indexed base then runs Lance's ANN on the
indexed fragments only (``fast_search``) and faiss over these matrices
(`engine.reads.vector.VectorSearch`), and merges by distance. Before the table has a vector
index, every fragment is unindexed: the whole base is searched here and Lance not at all.
During a catch-up the first index lands only after tens of seconds (42 s at 600k rows in
bench/catchup.py), and until then each vector query made Lance scan the whole base (2 s a
query at 600k rows on serve's one CPU); a table below `vector_index_min_rows` never gets one.

Consistency: a Lance fragment's rows never change; only its deletion file does (an upsert
flush's merge-insert deletes old versions of its keys). An entry is keyed by the fragment id
and its deletion file, so a query on a base version uses exactly that version's rows: a
fragment whose deletion file changed is loaded again, and one that compaction removed or the
index now covers is dropped at the next refresh.

Pruners: the background loader also builds each fragment's int8 `engine.prune.Pruner`
(fragments of `PRUNE_MIN_ROWS` or more), so a query scans codes and re-ranks candidates
exactly instead of scanning the whole matrix, with the same answer.

Bounds: at most `max_bytes` of fragments (the vector matrix, the other columns and the
pruner's codes), shared with `FlushedText`. Codes are built only where they fit and are
the first thing given up when a fragment needs room. When the unindexed part of the base
is larger, the fragments that fit are held (lowest ids first: those held stay held until
the index covers them) and a query reads the others itself, batch by batch
(`UnindexedFragments.scan`, `SCAN_BATCH_ROWS` rows at a time, nothing kept): its cost is
the excess, not the whole base. Before, it fell back to Lance's search of every
unindexed fragment: in bench/catchup.py's catch-up of 600k rows, once the base outgrew a
1 GiB bound, a vector query on the query-only process took 2.0-2.3 s instead of ~0.2 s.
A fragment missing at query time is loaded by that query (one loader per fragment;
concurrent queries wait for it); a background thread (started by the first use, stopped by
`close`) loads new fragments as soon as a base version with them appears, so queries
rarely pay for a load.

Handoff: the fragments this process's own append flushes write are not read back. The
reader watches the base table's appends (`engine.table.AppendWatcher`): before a flush
commits, the cache takes the flushed rows (the memtable's batches: their columns are kept
zero-copy, the vectors copied into one matrix); once the commit succeeded, it files them
under the new fragments' keys. A query that meets a fragment missing from the cache while
such an append is in flight, and whose id is above the highest fragment id when the append
began (it may be the append's), waits for it (at most `HANDOFF_WAIT_S`) instead of loading
it: loading 100k x 384 rows back took ~200 ms, the slowest part of a query under
ingestion. Upsert flushes (merge-insert: rows reordered, deletions elsewhere) and other
processes' flushes are loaded as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import lance
import numpy as np
import pyarrow as pa
import structlog

from engine.fts import MemtableTermCache
from engine.memtable import Memtable, MemtableView
from engine.periodic import PeriodicThread
from engine.prune import PRUNE_MIN_ROWS, Pruner, build_pruner
from engine.schema import TableSpec, vector_matrix
from engine.table import index_on

log = structlog.get_logger("lance_sink.reader")

#: The background loader looks for a new base version this often while queries use it.
REFRESH_INTERVAL_S = 0.2
#: Unindexed-fragment lists kept per base version (queries use recent versions only).
VERSIONS_KEPT = 8
#: A query missing a fragment waits this long at most for in-flight appends to be handed
#: over before it loads the fragment itself (a flush commit takes well under a second).
HANDOFF_WAIT_S = 2.0

#: `FlushedText.refresh` tokenises a read-back fragment in batches of this many rows: one
#: tokenizer call holds the interpreter lock for its whole batch (~7.5-30 us a row), and the
#: queries of the process wait for it meanwhile.
READ_BACK_BATCH_ROWS = 512
#: A fragment beyond the bound is read by the query in batches of this many rows (bounds
#: the query's memory: 16k x 384-dim rows are 25 MB).
SCAN_BATCH_ROWS = 16_384
#: (fragment id, deletion file identity or None)
FragmentKey = tuple[int, Any]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CachedFragment:
    """The visible rows of one unindexed base fragment: every column but the vector one
    (`rows`), the vectors as one contiguous float32 matrix, (cosine tables) their norms, and
    once the background loader built it, the matrix's int8 `engine.prune.Pruner`."""

    key: FragmentKey
    rows: pa.Table
    matrix: np.ndarray
    norms: np.ndarray
    vector: pa.Field
    pruner: Pruner | None = None

    @property
    def num_rows(self) -> int:
        return int(self.matrix.shape[0])

    @property
    def nbytes(self) -> int:
        pruned = 0 if self.pruner is None else self.pruner.nbytes
        return int(self.rows.nbytes + self.matrix.nbytes + self.norms.nbytes + pruned)

    def row_norms(self) -> np.ndarray:
        """The Euclidean norm of every row's vector (cosine search)."""
        return self.norms

    def take(self, columns: list[str], rows: np.ndarray) -> pa.Table:
        """`columns` of the given rows (the vector column rebuilt from the matrix)."""
        index = pa.array(rows, pa.int64())
        arrays = []
        for name in columns:
            if name == self.vector.name:
                values = pa.array(self.matrix[rows].reshape(-1), pa.float32())
                vectors = pa.FixedSizeListArray.from_arrays(values, self.matrix.shape[1])
                arrays.append(vectors.cast(self.vector.type))
            else:
                arrays.append(self.rows.column(name).take(index))
        fields = [
            self.vector if c == self.vector.name else self.rows.schema.field(c) for c in columns
        ]
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


@dataclass(frozen=True, slots=True)
class Covering:
    """A base's fragments that its vector index does not cover: those held in memory, and
    those beyond the bound, which the query reads itself (`UnindexedFragments.scan`)."""

    held: list[CachedFragment]
    unheld: list[lance.LanceFragment]


def fragment_key(fragment: lance.LanceFragment) -> FragmentKey:
    """A fragment's identity for its rows: its id and its deletion file (id, version)."""
    meta = fragment.metadata
    deletion = meta.deletion_file
    if deletion is None:
        return (int(meta.id), None)
    info = meta.to_json().get("deletion_file") or {}
    return (int(meta.id), (info.get("id"), info.get("read_version"), deletion.num_deleted_rows))


def covered_fragments(ds: lance.LanceDataset, column: str, *, text: bool) -> set[int] | None:
    """Ids of the fragments of `ds` that the index on `column` covers: its INVERTED index
    (`text`) or its vector index (`engine.table.index_on`); None when it has none."""
    index = index_on(ds, column, "Inverted" if text else None)
    if index is None:
        return None
    return {int(f) for segment in index.segments for f in segment.fragment_ids}


def newest_fragments(fragments: list[tuple[int, T, int]], rows: int) -> list[tuple[T, int]] | None:
    """What an append of `rows` rows became: of (fragment id, item, row count) triples, the
    items with the highest ids whose counts add up to `rows`, in id order (an append's new
    fragments get ids above every existing one); None if the counts do not add up."""
    mine: list[tuple[T, int]] = []
    total = 0
    for _, item, count in sorted(fragments, key=lambda f: f[0], reverse=True):
        if total >= rows:
            break
        mine.append((item, count))
        total += count
    return mine[::-1] if total == rows and rows else None


def unindexed_fragments(
    ds: lance.LanceDataset, column: str
) -> list[tuple[FragmentKey, lance.LanceFragment, int]]:
    """(key, fragment, rows) of every fragment of `ds` the vector index on `column` does not
    cover: all of them while `ds` has no vector index on it."""
    covered = covered_fragments(ds, column, text=False) or set()
    return [
        (fragment_key(fragment), fragment, int(fragment.count_rows()))
        for fragment in ds.get_fragments()
        if int(fragment.fragment_id) not in covered
    ]


class UnindexedFragments:
    """Cache of the unindexed base fragments (see the module docstring). Thread-safe."""

    def __init__(
        self,
        spec: TableSpec,
        max_bytes: int,
        open_base: Callable[[], lance.LanceDataset],
        held_elsewhere: Callable[[], int] = lambda: 0,
    ) -> None:
        assert spec.vector is not None
        self.spec = spec
        self.column = spec.vector.name
        self.max_bytes = max_bytes
        self._open_base = open_base
        self._held_elsewhere = held_elsewhere  # bytes of the same bound held by `FlushedText`
        self._entries: dict[FragmentKey, CachedFragment] = {}
        self._loading: dict[FragmentKey, threading.Event] = {}
        self._versions: dict[int, list[tuple[FragmentKey, lance.LanceFragment, int]]] = {}
        #: In-flight appends of this process: (their fragment-id floor, set when handed over).
        self._appending: list[tuple[int, threading.Event]] = []
        #: Entries whose pruner was built, found impossible, or shed for room (not retried).
        self._prune_tried: set[FragmentKey] = set()
        self._lock = threading.Lock()
        self._loader = PeriodicThread(
            "reader-unindexed", REFRESH_INTERVAL_S, self.refresh, "reader_unindexed_refresh_failed"
        )
        self.loads = 0
        self.handoffs = 0
        self.fallbacks = 0
        self.pruners = 0
        self.shed = 0  # fragments let go to make room for `FlushedText`

    # ------------------------------------------------------------------ queries

    def covering(self, base: lance.LanceDataset) -> Covering:
        """The fragments of `base` its vector index does not cover (every fragment while it
        has none): the cached rows of those that fit in `max_bytes` (missing ones are
        loaded), and the others (counted in `fallbacks`)."""
        self._loader.start()
        held: list[CachedFragment] = []
        unheld: list[lance.LanceFragment] = []
        for key, fragment, hold in self._plan(self._unindexed(base)):
            entry = self._get_or_load(key, fragment) if hold else None
            if entry is None:  # beyond the bound, or it could not be loaded within it
                unheld.append(fragment)
            else:
                held.append(entry)
        if unheld:
            self.fallbacks += 1
        return Covering(held, unheld)

    def scan(
        self,
        base: lance.LanceDataset,
        fragment: lance.LanceFragment,
        columns: list[str],
        filter_sql: str | None,
        **options: Any,
    ) -> Iterator[CachedFragment]:
        """A fragment of `base` that is not held, read as transient entries of at most
        `SCAN_BATCH_ROWS` rows with `columns` (the vector column among them) that pass
        `filter_sql` (None: all, else Lance filters the rows before they are decoded
        here), nothing kept; `options` go to Lance's scanner."""
        key = fragment_key(fragment)
        scanner = base.scanner(
            fragments=[fragment],
            columns=columns,
            filter=filter_sql,
            batch_size=SCAN_BATCH_ROWS,
            **options,
        )
        for batch in scanner.to_batches():
            if batch.num_rows:
                yield self._entry(key, pa.Table.from_batches([batch]))

    def _plan(
        self, wanted: list[tuple[FragmentKey, lance.LanceFragment, int]]
    ) -> list[tuple[FragmentKey, lance.LanceFragment, bool]]:
        """Which of the `wanted` fragments to hold: the held ones, then the others in id
        order while their estimate fits in the bound beside them."""
        # Bytes of each held entry without its codes (given up when a fragment needs room,
        # `_make_room`).
        with self._lock:
            held = {
                key: e.nbytes - (0 if e.pruner is None else e.pruner.nbytes)
                for key, e in self._entries.items()
            }
        room = self.max_bytes - self._held_elsewhere()
        used = sum(held.get(key, 0) for key, _, _ in wanted)
        plan = []
        for key, fragment, rows in wanted:
            hold = key in held
            if not hold and used + self._estimate(rows) <= room:
                used += self._estimate(rows)
                hold = True
            plan.append((key, fragment, hold))
        return plan

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._used_bytes()

    @property
    def pruner_bytes(self) -> int:
        """The part of `nbytes` that the fragments' int8 pruners take."""
        with self._lock:
            return self._codes_bytes()

    def _used_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def _codes_bytes(self) -> int:
        return sum(e.pruner.nbytes for e in self._entries.values() if e.pruner is not None)

    def _estimate(self, rows: int) -> int:
        """Bytes a fragment of `rows` rows takes at least (its vectors and norms)."""
        assert self.spec.vector is not None
        return rows * (4 * self.spec.vector.dim + 4)

    def _unindexed(
        self, base: lance.LanceDataset
    ) -> list[tuple[FragmentKey, lance.LanceFragment, int]]:
        version = int(base.version)
        with self._lock:
            if version in self._versions:
                return self._versions[version]
        found = unindexed_fragments(base, self.column)
        with self._lock:
            self._versions[version] = found
            while len(self._versions) > VERSIONS_KEPT:
                del self._versions[min(self._versions)]
        return found

    def _get_or_load(
        self, key: FragmentKey, fragment: lance.LanceFragment
    ) -> CachedFragment | None:
        with self._lock:
            entry = self._entries.get(key)
            # An append's fragments get ids above every fragment that existed before it.
            appending = [event for floor, event in self._appending if key[0] > floor]
        if entry is not None:
            return entry
        deadline = time.monotonic() + HANDOFF_WAIT_S
        for event in appending:  # the missing fragment may be one being handed over
            event.wait(max(deadline - time.monotonic(), 0))
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    return entry
                pending = self._loading.get(key)
                if pending is None:
                    pending = threading.Event()
                    self._loading[key] = pending
                    mine = True
                else:
                    mine = False
            if not mine:
                pending.wait()
                with self._lock:
                    if key in self._entries:
                        continue
                return None  # the loader failed or hit the bound: let this query fall back
            try:
                return self._load(key, fragment)
            except Exception as exc:  # noqa: BLE001 - the query falls back to Lance's search
                log.warning("reader_unindexed_load_failed", fragment=key[0], error=str(exc))
                return None
            finally:
                with self._lock:
                    self._loading.pop(key, None)
                pending.set()

    def _load(self, key: FragmentKey, fragment: lance.LanceFragment) -> CachedFragment | None:
        assert self.spec.vector is not None
        names = self.spec.table_schema.names
        # One batch: its vectors are one chunk, which the entry's matrix views. In Lance's
        # batches (8,192 rows) they were copied into a new matrix, and fresh memory is
        # what a load costs here: a 60k x 384 fragment took 0.14-0.30 s that way against
        # 0.075 s, and 0.6-0.9 s during bench/catchup.py's catch-up, while queries waited.
        rows = max(int(fragment.metadata.physical_rows or 0), 1)
        entry = self._entry(key, fragment.scanner(columns=names, batch_size=rows).to_table())
        elsewhere = self._held_elsewhere()
        with self._lock:
            if not self._make_room(entry.nbytes + elsewhere):
                return None
            self._entries[key] = entry
            self.loads += 1
        return entry

    def room_beside(self, nbytes: int) -> bool:
        """Whether `nbytes` held elsewhere under the same bound (`FlushedText`, all of it)
        fit beside this cache, which sheds pruners, then fragments (oldest first), to make
        room for them. Text comes first: a row's text takes a tenth of what its vector does,
        and a text query re-tokenises what is not held (~7.5 us a row) while a vector query
        lets Lance scan it (~1.6 us a row): before, with the bound full of vectors, a
        fragment's text was refused, and every text query re-tokenised every unindexed row
        (5.6 s a query once during bench/catchup.py's catch-up)."""
        with self._lock:
            if self._make_room(nbytes):
                return True
            if nbytes > self.max_bytes:
                return False
            for key in list(self._entries):
                if self._used_bytes() + nbytes <= self.max_bytes:
                    break
                del self._entries[key]
                self._prune_tried.discard(key)
                self.shed += 1
            return self._used_bytes() + nbytes <= self.max_bytes

    def _make_room(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit in the bound, shedding pruners (an optional speed-up)
        until they do; none is shed when even that would not make room. Holds the lock."""
        used = self._used_bytes()
        if used - self._codes_bytes() + nbytes > self.max_bytes:
            return False
        for key, entry in list(self._entries.items()):
            if used + nbytes <= self.max_bytes:
                break
            if entry.pruner is not None:
                used -= entry.pruner.nbytes
                self._entries[key] = replace(entry, pruner=None)
        return used + nbytes <= self.max_bytes

    def _entry(self, key: FragmentKey, table: pa.Table) -> CachedFragment:
        """An entry for `table` (a fragment's rows in order): its vectors are copied into one
        contiguous matrix (a view when they are one float32 chunk already), the other
        columns are kept as they are (zero-copy)."""
        assert self.spec.vector is not None
        dim = self.spec.vector.dim
        chunks = table.column(self.column).chunks
        if len(chunks) == 1:
            matrix = np.ascontiguousarray(vector_matrix(chunks[0], dim), dtype=np.float32)
        else:
            matrix = pool_matrix(table.num_rows, dim)
            start = 0
            for chunk in chunks:
                matrix[start : start + len(chunk)] = vector_matrix(chunk, dim)
                start += len(chunk)
        if self.spec.vector.metric == "cosine":
            norms = np.sqrt(np.einsum("ij,ij->i", matrix, matrix)).astype(np.float32)
        else:
            norms = np.empty(0, dtype=np.float32)
        rows = table.drop_columns([self.column])
        return CachedFragment(key, rows, matrix, norms, table.schema.field(self.column))

    # ------------------------------------------------------------------ handoff

    @contextmanager
    def appending(
        self, rows: pa.Table, memtable: Memtable | None = None
    ) -> Iterator[Callable[[lance.LanceDataset], None]]:
        """`engine.table.AppendWatcher`: a flush of this process appends `rows`.

        Nothing is taken before the first vector query used the cache, after `close`, or when
        the rows do not fit in the bound."""
        if (
            self._loader.thread is None
            or self._loader.closed
            or self._estimate(rows.num_rows) > self.max_bytes - self._held_elsewhere()
        ):
            yield _ignore_commit
            return
        try:
            floor = _max_fragment_id(self._open_base())
            whole = self._entry((-1, None), rows)
        except Exception as exc:  # noqa: BLE001 - a cache miss later, never a failed flush
            log.warning("reader_unindexed_handoff_failed", error=str(exc))
            yield _ignore_commit
            return
        pending = (floor, threading.Event())
        with self._lock:
            self._appending.append(pending)
        try:
            yield lambda ds: self._adopt(ds, whole)
        finally:
            with self._lock:
                self._appending.remove(pending)
            pending[1].set()

    def _adopt(self, ds: lance.LanceDataset, whole: CachedFragment) -> None:
        """File the appended rows (`whole`) under the fragments the commit `ds` made of them:
        the unindexed fragments with the highest ids (an append's new fragments get ids
        above every existing one), in id order, whose row counts add up to the rows written."""
        wanted = self._unindexed(ds)
        counted = [(key[0], key, count) for key, _, count in wanted]
        mine = newest_fragments(counted, whole.num_rows)
        if mine is None or any(key[1] is not None for key, _ in mine):
            return  # not the fragments as written (rows deleted already)
        entries = []
        start = 0
        for key, count in mine:
            end = start + count
            entries.append(
                CachedFragment(
                    key,
                    whole.rows.slice(start, count),
                    whole.matrix[start:end],
                    whole.norms[start:end],
                    whole.vector,
                )
            )
            start = end
        elsewhere = self._held_elsewhere()
        with self._lock:
            if not self._make_room(sum(e.nbytes for e in entries) + elsewhere):
                return
            for entry in entries:
                self._entries.setdefault(entry.key, entry)
            self.handoffs += len(entries)

    # ------------------------------------------------------------------ background

    def refresh(self) -> None:
        """Drop entries the latest base no longer needs; load its missing fragments."""
        base = self._open_base()
        wanted = self._unindexed(base)
        keep = {key for key, _, _ in wanted}
        with self._lock:
            for key in [k for k in self._entries if k not in keep]:
                del self._entries[key]
            self._prune_tried &= keep
        for key, fragment, hold in self._plan(wanted):
            if self._loader.closed:
                return
            if hold:
                self._get_or_load(key, fragment)
        self._build_pruners(int(base.version))

    def _build_pruners(self, version: int) -> None:
        """Build the int8 pruner (`engine.prune`) of every cached fragment that has none
        yet, as far as the bound has room: queries then scan codes instead of vectors.

        Stops, between pruners and within one (between its chunks), as soon as a base
        version newer than `version` met by a query has fragments not held yet: they are
        loaded first (the next refresh), pruners after (a stopped one from the start). A
        catch-up flushes a fragment every few seconds, and building the pruners of the
        fragments before took most of the loader's time (a third of the query-only
        process's CPU in bench/catchup.py), so the queries met the new fragments unloaded
        and loaded them themselves (0.35-0.77 s a query); a pruner being built beside
        such a load took half the CPU the query waited for."""
        assert self.spec.vector is not None
        metric = self.spec.vector.metric
        with self._lock:
            todo = [e for k, e in self._entries.items() if k not in self._prune_tried]

        def stop() -> bool:
            return self._loader.closed or self._loads_waiting(version)

        for entry in todo:
            if stop():
                return
            with self._lock:
                self._prune_tried.add(entry.key)
            if entry.num_rows < PRUNE_MIN_ROWS:
                continue
            codes = entry.num_rows * int(entry.matrix.shape[1])
            elsewhere = self._held_elsewhere()
            with self._lock:
                used = self._used_bytes() + elsewhere
            if used + codes > self.max_bytes:
                continue
            norms = entry.norms if metric == "cosine" else None
            pruner = build_pruner(entry.matrix, metric, PRUNE_MIN_ROWS, norms, stop)
            if pruner is None:
                if stop():  # not impossible, only stopped: built again later
                    with self._lock:
                        self._prune_tried.discard(entry.key)
                    return
                continue
            with self._lock:
                used = self._used_bytes() + elsewhere
                if self._entries.get(entry.key) is entry and used + codes <= self.max_bytes:
                    self._entries[entry.key] = replace(entry, pruner=pruner)
                    self.pruners += 1

    def _loads_waiting(self, version: int) -> bool:
        """Whether a base version newer than `version` (met by a query, or the loader) has
        unindexed fragments this cache does not hold (beyond the bound too: then there is
        no room for codes either)."""
        with self._lock:
            return any(
                key not in self._entries
                for met, found in self._versions.items()
                if met > version
                for key, _, _ in found
            )

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background loader (idempotent) and free the cached fragments."""
        self._loader.close(timeout)
        with self._lock:
            self._entries.clear()


def pool_matrix(rows: int, dim: int) -> np.ndarray:
    """An uninitialised (rows, dim) float32 matrix in Arrow's memory pool, not malloc's.

    Why: malloc maps an allocation this large fresh and unmaps it when freed, so each
    flush's handoff wrote 150 MB (100k x 384) into pages never touched before. On the
    development VM that took 0.3-1.2 s instead of the copy's ~25 ms. Arrow's pool keeps
    freed memory for reuse: 10-12 ms per 150 MB allocation and copy, every time."""
    buffer = pa.allocate_buffer(rows * dim * 4)
    return np.frombuffer(buffer, dtype=np.float32).reshape(rows, dim)


def _max_fragment_id(ds: lance.LanceDataset) -> int:
    """The highest fragment id of `ds` (-1 when it has none)."""
    return max((int(f.fragment_id) for f in ds.get_fragments()), default=-1)


def _ignore_commit(ds: lance.LanceDataset) -> None:
    """The commit callback of an append the cache does not take."""


@dataclass(frozen=True, slots=True)
class HeldText:
    """A flushed memtable `FlushedText` keeps: its rows without the vector column (`view`,
    a `Memtable.without_column` copy), and the base fragments they were written to, in
    order, as (fragment id, row count)."""

    view: MemtableView
    fragments: tuple[tuple[int, int], ...]

    @property
    def ids(self) -> frozenset[int]:
        return frozenset(i for i, _ in self.fragments)

    @property
    def nbytes(self) -> int:
        """Its rows and its term cache (which queries may still extend)."""
        return self.view.memtable.memory_size

    def locate(self, rows: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Where rows of the view (its row numbers, in view order) are in the base: per
        fragment holding some, (fragment id, their offsets in it, their indices in
        `rows`)."""
        ends = np.cumsum([count for _, count in self.fragments])
        which = np.searchsorted(ends, rows, side="right")
        out = []
        for f in np.unique(which):
            picked = np.flatnonzero(which == f)
            start = int(ends[f - 1]) if f else 0
            out.append((self.fragments[int(f)][0], rows[picked] - start, picked))
        return out


class FlushedText:
    """The memtables this process flushed whose fragments the text (INVERTED) index does not
    cover yet, kept for full-text search. Thread-safe.

    Why: Lance's full-text search scans unindexed fragments flat, re-tokenising every row of
    them on every query: after a 100k-row flush, text queries took 200-450 ms until the next
    index optimisation (~1-2 s later). A flushed memtable's rows are tokenised already (the
    reader's term cache), so the reader keeps its view and scores it with its own BM25, while
    Lance searches the indexed fragments only (``fast_search``).

    Without vectors, as one batch: a memtable is kept as `Memtable.without_column` of its
    vector column, its tokens handed over as that batch's (`fts.MemtableTermCache.hand_over`).
    100k rows of 384-dim vectors held 167 MiB, most of it vectors the vector cache holds as
    well, and under ingestion the two together outgrew the bound they share, so a flushed
    memtable was not kept and the text queries of the next seconds scanned its rows flat
    (p99 0.5 s). One batch instead of one per put (hundreds) makes a query score it in one
    pass. A text result asking for the vector column takes the winners' vectors from their
    base fragment (`HeldText.locate`).

    `appending` (`engine.table.AppendWatcher`) takes the memtable of an append flush (not
    before the first text query, nor when it does not fit in the bound it shares with the
    vector cache, `fits`) and files it under the new fragments' ids once committed. The
    vector cache gives up its int8 codes for it (`UnindexedFragments.room_beside`): a
    memtable's text takes a tenth of what its vectors do, and without it text queries scan
    its rows flat, while without the codes vector queries only scan vectors instead.
    `views(base, column)` returns the memtables that stand for `base`'s fragments the index
    on `column` lacks (every fragment before the column's first index), or None when some
    such fragment is not held and cannot be read back (then Lance searches them all, as
    before; counted in `fallbacks`). Memtables whose fragments are all covered, or gone
    (compacted), are dropped.

    Fragments nobody handed over (another pod's flushes: all of them in `lance-sink serve`;
    this process's flushes refused for room, or written before the first text query) are
    read back by a background loader (`refresh`, started by the first `views`; `open_base`
    given): each such fragment of the latest base, oldest first, is read without its vector
    column, tokenised once on the loader's thread and held as a one-fragment memtable
    (`Memtable.of_rows`) within the same bound. Without it a text query searched those rows
    flat, tokenising them again each time: ~7.5 us a row, 0.76 s a query for 100k rows while
    the text index lagged a catch-up. A query that finds such a fragment not held yet reads
    it back itself (`_read_back_now`; one load per fragment, other queries wait for it).
    Append tables only, fragments without deletions (a fragment's rows never change then).
    """

    def __init__(
        self,
        columns: tuple[str, ...],
        enabled: Callable[[], bool],
        fits: Callable[[int], bool],
        terms: MemtableTermCache,
        vector: str | None = None,
        read_back: tuple[TableSpec, Callable[[], lance.LanceDataset]] | None = None,
    ) -> None:
        self.columns = columns  # the full-text columns, each with its own index
        self._enabled = enabled
        self._fits = fits  # would this holder's bytes fit in the bound (beside the vector cache)?
        self._terms = terms
        self._vector = vector
        #: The table and its latest base, for `refresh` (None: no loader; upsert tables).
        self._read_back = None if read_back is None or read_back[0].upsert else read_back
        self._unfit: set[int] = set()  # fragments a read-back found no room for
        self._pending: set[int] = set()  # lacking and not held at the last `refresh`
        self._loading: dict[int, threading.Event] = {}  # fragments being read back
        self._held: list[HeldText] = []
        self._found: dict[tuple[int, str], list[HeldText]] = {}
        self._lock = threading.Lock()
        self._loader = PeriodicThread(
            "reader-text-tail", REFRESH_INTERVAL_S, self.refresh, "reader_text_tail_failed"
        )
        self.handoffs = 0
        self.loads = 0  # fragments read back and tokenised by `refresh`
        self.refused = 0  # flushed memtables not kept: no room in the bound
        self.fallbacks = 0  # `views` found an indexed column's unindexed rows not all held

    @property
    def nbytes(self) -> int:
        with self._lock:
            held = list(self._held)
        return sum(h.nbytes for h in held)

    @contextmanager
    def appending(
        self, rows: pa.Table, memtable: Memtable | None = None
    ) -> Iterator[Callable[[lance.LanceDataset], None]]:
        """`engine.table.AppendWatcher`: keep `memtable`'s rows once they are committed."""
        if memtable is None or not self._enabled():
            yield _ignore_commit
            return
        if memtable.rows != rows.num_rows:
            yield _ignore_commit  # partly flushed before
            return
        yield lambda ds: self._adopt(ds, memtable, rows.num_rows)

    def _adopt(self, ds: lance.LanceDataset, memtable: Memtable, rows: int) -> None:
        fragments = [
            (int(f.fragment_id), int(f.fragment_id), int(f.metadata.physical_rows))
            for f in ds.get_fragments()
        ]
        mine = newest_fragments(fragments, rows)
        if mine is None:
            return
        kept = memtable.without_column(self._vector)
        self._terms.hand_over(memtable, kept, self.columns)
        held = HeldText(kept.view(), tuple(mine))
        if not self._fits(self.nbytes + held.nbytes):
            with self._lock:
                self.refused += 1
            return
        with self._lock:
            if any(held.ids & h.ids for h in self._held):
                return  # read back by `refresh` already
            self._held.append(held)
            self.handoffs += 1

    def views(self, base: lance.LanceDataset, column: str) -> list[HeldText] | None:
        """The held memtables standing for the fragments of `base` the index on `column`
        lacks, or None (see the class docstring). Found lists are kept per base version."""
        if self._read_back is not None:
            self._loader.start()
        key = (int(base.version), column)
        with self._lock:
            if key in self._found:
                return self._found[key]
        found, missing = self._views(base, column)
        if found is None and missing and self._read_back_now(base, missing):
            found, missing = self._views(base, column)
        with self._lock:
            if found is not None:  # None may change within a version: an adoption pending
                self._found[key] = found
                while len(self._found) > VERSIONS_KEPT:
                    del self._found[min(self._found)]
            else:
                self.fallbacks += 1
        return found

    def _views(
        self, base: lance.LanceDataset, column: str
    ) -> tuple[list[HeldText] | None, set[int]]:
        """`views`, and the fragments it lacks that nothing holds (a read-back would complete
        it)."""
        present, lacking = self._lacking(base)
        unindexed = lacking[column]
        needed = set().union(*lacking.values())
        newest = max(present, default=-1)
        with self._lock:
            # Held rows every index now covers, or compaction rewrote, are not needed any
            # more; rows flushed after `base` (ids above its newest) may be for later queries.
            kept = [h for h in self._held if h.ids & needed or min(h.ids) > newest]
            if len(kept) < len(self._held):  # older versions' lists would pin dropped views
                version = int(base.version)
                self._found = {k: v for k, v in self._found.items() if k[0] > version}
                self._unfit.clear()  # room freed: `refresh` may try them again
            self._held = kept
            held = [h for h in self._held if min(h.ids) <= newest]
        out = []
        found: set[int] = set()
        for h in held:
            if not h.ids & unindexed:
                continue  # this column's index covers it (another column's does not)
            if not h.ids <= unindexed:
                return None, set()  # partly indexed: its rows cannot be split between tiers
            out.append(h)
            found |= h.ids
        if found == unindexed:
            return out, set()
        return None, unindexed - found

    def _lacking(self, base: lance.LanceDataset) -> tuple[set[int], dict[str, set[int]]]:
        """The fragments of `base`, and per full-text column those its index lacks (all of
        them before the column's first index)."""
        present = {int(f.fragment_id) for f in base.get_fragments()}
        lacking = {}
        for name in self.columns:
            covered = covered_fragments(base, name, text=True)
            lacking[name] = present - (covered or set())
        return present, lacking

    def _read_back_now(self, base: lance.LanceDataset, missing: set[int]) -> bool:
        """Read back the fragments of `base` a query lacks (`missing`), on the query's
        thread; whether all are held now. A query that met a fragment the loader had not
        read back yet (it reads one from its second pass, and tokenising one takes a while)
        otherwise let Lance search every unindexed fragment flat, and before the column's
        first index re-tokenised the whole base."""
        if self._read_back is None or self._loader.closed:
            return False
        fragments = [f for f in base.get_fragments() if int(f.fragment_id) in missing]
        if any(f.metadata.deletion_file is not None for f in fragments):
            return False
        try:
            return all(self._load(f) for f in sorted(fragments, key=lambda f: f.fragment_id))
        except Exception as exc:  # noqa: BLE001 - the query falls back to Lance's search
            log.warning("reader_text_tail_load_failed", error=str(exc))
            return False

    def refresh(self) -> None:
        """Read back and tokenise the fragments of the latest base that some text index
        lacks and nothing holds (see the class docstring), oldest first, while they fit."""
        if self._read_back is None:
            return
        _, open_base = self._read_back
        base = open_base()
        lacking = set().union(*self._lacking(base)[1].values())
        with self._lock:
            self._unfit &= lacking  # indexed since: never needed again
            skip = set().union(self._unfit, *(h.ids for h in self._held))
        wanted = lacking - skip
        # A fragment is read back from the second pass that finds it on: this process's own
        # flush hands its memtable over right after its commit, before that.
        ready, self._pending = wanted & self._pending, wanted
        todo = [
            f
            for f in base.get_fragments()
            if int(f.fragment_id) in ready and f.metadata.deletion_file is None
        ]
        for fragment in sorted(todo, key=lambda f: int(f.fragment_id)):
            if self._loader.closed or not self._load(fragment):
                return

    def _load(self, fragment: lance.LanceFragment) -> bool:
        """Read back and tokenise `fragment` and hold it, once however many threads ask (the
        others wait for it); whether it is held (False: no room for it)."""
        fragment_id = int(fragment.fragment_id)
        while True:
            with self._lock:
                if any(fragment_id in h.ids for h in self._held):
                    return True
                if fragment_id in self._unfit:
                    return False
                pending = self._loading.get(fragment_id)
                mine = pending is None
                if pending is None:
                    pending = self._loading[fragment_id] = threading.Event()
            if not mine:
                pending.wait()
                continue  # held, unfit, or failed (then this thread tries itself)
            try:
                return self._read_back_fragment(fragment)
            finally:
                with self._lock:
                    self._loading.pop(fragment_id, None)
                pending.set()

    def _read_back_fragment(self, fragment: lance.LanceFragment) -> bool:
        assert self._read_back is not None
        spec, _ = self._read_back
        fragment_id = int(fragment.fragment_id)
        columns = [n for n in fragment.schema.names if n != self._vector]
        rows = fragment.to_table(columns=columns)
        if not self._fits(self.nbytes + rows.nbytes):  # its tokens would add more
            with self._lock:
                self._unfit.add(fragment_id)
                self.refused += 1
            return False
        memtable = Memtable.of_rows(spec, rows, READ_BACK_BATCH_ROWS)
        for name in self.columns:
            self._terms.terms(memtable, name, tuple(memtable.batches))
        loaded = HeldText(memtable.view(), ((fragment_id, memtable.rows),))
        with self._lock:
            if any(loaded.ids & h.ids for h in self._held):
                return True  # handed over meanwhile
            if not self._fits(sum(h.nbytes for h in self._held) + loaded.nbytes):
                self._unfit.add(fragment_id)  # not read again until indexed
                self.refused += 1
                return False
            self._held.append(loaded)
            self.loads += 1
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background loader (idempotent) and drop what is held."""
        self._loader.close(timeout)
        self.clear()

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._found.clear()
