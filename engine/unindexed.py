"""The base fragments the vector index does not cover yet, held in memory for exact search.

Why: a flush appends a fragment that the vector index covers only after maintenance's next
`optimize_indices` pass. Lance searches such fragments with a flat scan that reads and
decodes them on every query: on this machine 474 ms per query for 300k x 384 unindexed rows,
against 12 ms for the indexed part (``fast_search``) and 54 ms for faiss over the same 300k
rows in memory. Under ingestion that flat scan took most of the CPU, which slowed the index
optimisation, which grew the unindexed part: base queries went from 18 ms to 500 ms.

What: `UnindexedFragments` holds, per fragment the vector index does not cover, that
fragment's rows (deletions applied) as one Arrow batch plus its contiguous float32 vector
matrix. A vector query on an indexed base then runs Lance's ANN on the indexed fragments only
(``fast_search``) and faiss over these matrices (`Reader._knn_base`), and merges by distance.

Consistency: a Lance fragment's rows never change; only its deletion file does (an upsert
flush's merge-insert deletes old versions of its keys). An entry is keyed by the fragment id
and its deletion file, so a query on a base version uses exactly that version's rows: a
fragment whose deletion file changed is loaded again, and one that compaction removed or the
index now covers is dropped at the next refresh.

Bounds: at most `max_bytes` of fragments (the vector matrix plus the Arrow batch). When the
unindexed part of the base is larger, queries fall back to Lance's own search of the whole
base (correct, as slow as before) until maintenance catches up. A fragment missing at query
time is loaded by that query (one loader per fragment; concurrent queries wait for it); a
background thread (started by the first use, stopped by `close`) loads new fragments as soon
as a base version with them appears, so queries rarely pay for a load.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import structlog

from engine.periodic import PeriodicThread
from engine.schema import TableSpec, vector_matrix
from engine.table import index_on

log = structlog.get_logger("lance_sink.reader")

#: The background loader looks for a new base version this often while queries use it.
REFRESH_INTERVAL_S = 0.2
#: Unindexed-fragment lists kept per base version (queries use recent versions only).
VERSIONS_KEPT = 8

#: (fragment id, deletion file identity or None)
FragmentKey = tuple[int, Any]


@dataclass(frozen=True, slots=True)
class CachedFragment:
    """The visible rows of one unindexed base fragment."""

    key: FragmentKey
    batch: pa.RecordBatch
    matrix: np.ndarray
    norms: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes held: the batch, the norms and the matrix if it is not a view of the batch."""
        matrix = self.matrix.nbytes if self.matrix.flags.owndata else 0
        return int(self.batch.nbytes + matrix + self.norms.nbytes)

    def row_norms(self) -> np.ndarray:
        """The Euclidean norm of every row's vector (cosine search)."""
        return self.norms


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


def unindexed_fragments(
    ds: lance.LanceDataset, column: str
) -> list[tuple[FragmentKey, lance.LanceFragment, int]] | None:
    """(key, fragment, rows) of every fragment of `ds` the vector index on `column` does not
    cover, or None when `ds` has no vector index on it."""
    covered = covered_fragments(ds, column, text=False)
    if covered is None:
        return None
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
    ) -> None:
        assert spec.vector is not None
        self.spec = spec
        self.column = spec.vector.name
        self.max_bytes = max_bytes
        self._open_base = open_base
        self._entries: dict[FragmentKey, CachedFragment] = {}
        self._loading: dict[FragmentKey, threading.Event] = {}
        self._versions: dict[int, list[tuple[FragmentKey, lance.LanceFragment, int]] | None] = {}
        self._lock = threading.Lock()
        self._loader = PeriodicThread(
            "reader-unindexed", REFRESH_INTERVAL_S, self.refresh, "reader_unindexed_refresh_failed"
        )
        self.loads = 0
        self.fallbacks = 0

    # ------------------------------------------------------------------ queries

    def covering(self, base: lance.LanceDataset) -> list[CachedFragment] | None:
        """The cached rows of every unindexed fragment of `base` (loading missing ones), or
        None: `base` has no vector index, or its unindexed part exceeds `max_bytes`."""
        self._loader.start()
        wanted = self._unindexed(base)
        if wanted is None:
            return None
        estimate = sum(self._estimate(rows) for _, _, rows in wanted)
        if estimate > self.max_bytes:
            self.fallbacks += 1
            return None
        out = []
        for key, fragment, _ in wanted:
            entry = self._get_or_load(key, fragment)
            if entry is None:  # could not be loaded within the bound
                self.fallbacks += 1
                return None
            out.append(entry)
        return out

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def _estimate(self, rows: int) -> int:
        """Bytes a fragment of `rows` rows takes at least (its vectors and norms)."""
        assert self.spec.vector is not None
        return rows * (4 * self.spec.vector.dim + 4)

    def _unindexed(
        self, base: lance.LanceDataset
    ) -> list[tuple[FragmentKey, lance.LanceFragment, int]] | None:
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
        table = fragment.to_table(columns=names).combine_chunks()
        batches = table.to_batches()
        record = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)
        matrix = np.ascontiguousarray(
            vector_matrix(record.column(self.column), self.spec.vector.dim), dtype=np.float32
        )
        norms = np.sqrt(np.einsum("ij,ij->i", matrix, matrix)).astype(np.float32)
        entry = CachedFragment(key, record, matrix, norms)
        with self._lock:
            used = sum(e.nbytes for e in self._entries.values())
            if used + entry.nbytes > self.max_bytes:
                return None
            self._entries[key] = entry
            self.loads += 1
        return entry

    # ------------------------------------------------------------------ background

    def refresh(self) -> None:
        """Drop entries the latest base no longer needs; load its missing fragments."""
        base = self._open_base()
        wanted = self._unindexed(base)
        keep = {key for key, _, _ in wanted or []}
        with self._lock:
            for key in [k for k in self._entries if k not in keep]:
                del self._entries[key]
        if wanted is None:
            return
        if sum(self._estimate(rows) for _, _, rows in wanted) > self.max_bytes:
            return
        for key, fragment, _ in wanted:
            if self._loader.closed:
                return
            self._get_or_load(key, fragment)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background loader (idempotent) and free the cached fragments."""
        self._loader.close(timeout)
        with self._lock:
            self._entries.clear()
