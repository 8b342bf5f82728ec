"""Vector kNN over a snapshot: memtables exact with faiss, the base with Lance.

Memtables are searched exactly with faiss on each batch's zero-copy vector matrix (l2 and
dot via `faiss.knn`; cosine as inner product with the normalised query divided by row
norms, which are computed vectorised once per batch and cached). The base is searched with
Lance's ANN index (`nprobes`, `refine_factor`) or, without an index, Lance's exact search.
The base fragments an index does not cover yet are held in memory and searched exactly
with faiss like memtables, pruned by their int8 codes where they have them
(`engine.unindexed`, `engine.prune`; Lance then searches only the indexed fragments), or,
over the cache's bound, by Lance's own flat scan. Distances follow Lance's definitions so
they compare across tiers: l2 = squared Euclidean distance, cosine = 1 - cos, dot = 1 -
inner product (what Lance returns, checked on this machine). When the base has an index and
no `refine_factor` is given (per request or in `query.refine_factor`),
`DEFAULT_REFINE_FACTOR` is used: the base's distances are then exact re-ranked distances
rather than PQ approximations (so merging by distance is sound), and recall is far better
(benchmark at 1M x 384: recall@10 0.63 with refine 1, 0.997 with 10).

faiss is limited to one OpenMP thread per call (`engine.reader.Reader` sets it): on a
2-core machine shared with ingestion a multi-threaded flat search over one 100k x 384
memtable was 8x slower (60 ms vs 7.7 ms) than a single-threaded one; concurrency comes from
concurrent queries instead.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np
import pyarrow as pa

from engine.filters import Predicate, QueryError
from engine.memtable import Memtable
from engine.reads.context import ReadContext
from engine.reads.merge import DISTANCE, Candidates, materialise, top
from engine.reads.remote import Asked, FanoutReport, Started
from engine.reads.snapshot import SCAN_BATCH_READAHEAD, SCAN_IO_BUFFER_BYTES, Snapshot
from engine.reads.tiers import MemtableTier
from engine.reads.trace import stage
from engine.schema import TableSpec, vector_matrix
from engine.unindexed import CachedFragment, Covering, UnindexedFragments, covered_fragments

#: Fast path of a memtable batch's kNN: when at most this many rows of the batch are
#: excluded (dead, filtered out), ask faiss for k + excluded neighbours and drop the
#: excluded ones; above it, copy the eligible rows and search those. 4096 extra heap slots
#: cost ~1 ms on a 100k-row batch, about what copying 5% of it costs.
FAST_EXCLUDED_MAX = 4096
#: Cosine kNN with a filter: below this share of eligible rows, copy them and score the copy;
#: from it on, score every row in place and keep the eligible ones' scores. Copying 80% of
#: 55k x 384 rows took 20 ms, scoring them all 4.4 ms (copying 5% took 0.8 ms).
GATHER_SHARE_MAX = 0.25
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


@dataclass(frozen=True, slots=True)
class BaseKnn:
    """A vector query's base search in two parts that run in parallel: Lance's top `limit`
    rows of the indexed fragments (of every fragment with the unindexed cache off; none
    before the first index), and the top `limit` of each unindexed fragment, held in
    memory or read by the query (faiss)."""

    lance: Callable[[int], pa.Table]
    fresh: Callable[[int], list[pa.Table]]

    def fetch(self, limit: int) -> pa.Table:
        return top([self.lance(limit), *self.fresh(limit)], DISTANCE, limit, ascending=True)


class VectorSearch:
    """The vector query kind: `search` over one snapshot per call.

    `unindexed` is the reader's cache of base fragments the vector index does not cover yet
    (None: off). Row norms of memtable batches (cosine) are cached per memtable here.
    """

    def __init__(self, ctx: ReadContext, unindexed: UnindexedFragments | None) -> None:
        self.ctx = ctx
        self.unindexed = unindexed
        self._norms: weakref.WeakKeyDictionary[Memtable, list[np.ndarray]] = (
            weakref.WeakKeyDictionary()
        )
        self._norms_lock = threading.Lock()

    @property
    def spec(self) -> TableSpec:
        """The context's spec, as widened to follow the table (`ReadContext`)."""
        return self.ctx.spec

    def search(
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
        """See `engine.reader.Reader.search_vector`."""
        started = time.monotonic()
        begin, out_cols = self.prepare(
            vector,
            k=k,
            filter=filter,
            columns=columns,
            nprobes=nprobes,
            refine_factor=refine_factor,
        )
        merged = self.ctx.run(lambda snap: begin(snap).alone(snap.remote), report)
        return self.ctx.finish("vector", started, [merged], out_cols, DISTANCE)

    def prepare(
        self,
        vector: Sequence[float] | np.ndarray,
        *,
        k: int,
        filter: str | Predicate | None,  # noqa: A002 - the query language's word
        columns: Sequence[str] | None,
        nprobes: int | None,
        refine_factor: int | None,
    ) -> tuple[Callable[[Snapshot], Started], list[str]]:
        """The request validated: how to begin it on a snapshot (its owner request and
        the rest, `Started`), and its output columns (the merged top k holds `fetch`
        columns and `_distance`).

        Raises:
            QueryError: see `engine.reader.Reader.search_vector`.
        """
        ctx = self.ctx
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
        query = _well_scaled(query, spec_vec.metric)
        ctx.check_k(k)
        predicate = ctx.predicate(filter)
        out_cols = ctx.columns(columns)
        fetch = ctx.fetch_columns(out_cols)

        def begin(snap: Snapshot) -> Started:
            # Lance searches the base on a base worker meanwhile, the owner pods their
            # memtables; faiss the memtables and the base's unindexed fragments here.
            base = self._knn_base(snap, query, predicate, fetch, nprobes, refine_factor)
            limit = snap.base_limit(k)
            lance_first = ctx.meanwhile(base.lance, limit)
            request = None
            if snap.remote is not None:
                request = {
                    "kind": "vector",
                    "vector": query.tolist(),
                    "k": k,
                    "filter": None if predicate is None else predicate.text,
                    "fetch": fetch,
                }

            def finish(remote: Asked | None) -> pa.Table:
                with stage("memtables"):
                    parts = self.memtable_part(snap, query, k, predicate, fetch)
                fresh_first = base.fresh(limit)
                with stage("base_wait"):
                    lance_part = lance_first.result()
                first = top([lance_part, *fresh_first], DISTANCE, limit, ascending=True)
                if remote is not None:
                    parts.extend(snap.remote_rows(remote.result()))
                parts.append(snap.base_overfetch(k, base.fetch, first))
                return top(parts, DISTANCE, k, ascending=True)

            return Started(request, finish)

        return begin, out_cols

    def memtable_part(
        self,
        snap: Snapshot,
        query: np.ndarray,
        k: int,
        predicate: Predicate | None,
        fetch: list[str],
    ) -> list[pa.Table]:
        """The k nearest visible rows of the snapshot's memtable tiers (`fetch` columns and
        `_distance`), one table per batch they come from. The owner pod of a fan-out read
        answers with this too (`engine.reads.fresh`)."""
        candidates: list[Candidates] = []
        for tier in snap.tiers:
            candidates.extend(self._knn_tier(tier, query, k, predicate))
        return materialise(candidates, k, fetch, DISTANCE, ascending=True)

    def _batch_norms(self, tier: MemtableTier, i: int, matrix: np.ndarray) -> np.ndarray:
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
        tier: MemtableTier,
        query: np.ndarray,
        k: int,
        predicate: Predicate | None,
    ) -> list[Candidates]:
        out = []
        for i, batch in enumerate(tier.view.batches):
            if not batch.num_rows:
                continue
            eligible = tier.eligible(i, predicate)
            want = k
            while True:
                rows, dist = self._knn_batch(tier, i, query, want, eligible)
                visible = tier.visible(i, rows)
                available = batch.num_rows if eligible is None else int(eligible.sum())
                if len(visible) >= min(k, len(rows)) or len(rows) >= available:
                    break
                want *= 4
            if len(visible) < len(rows):
                keep = np.isin(rows, visible)
                rows, dist = rows[keep], dist[keep]
            if len(rows):
                out.append(Candidates(tier, i, rows, dist))
        return out

    def _knn_batch(
        self,
        tier: MemtableTier,
        i: int,
        query: np.ndarray,
        k: int,
        eligible: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k among the eligible rows of one batch: (row indices, distances)."""
        assert self.spec.vector is not None
        matrix = self._matrix(tier.view.batches[i])
        return exact_knn(
            matrix,
            lambda: self._batch_norms(tier, i, matrix),
            query,
            k,
            eligible,
            self.spec.vector.metric,
        )

    def _knn_fragments(
        self,
        fragments: Iterable[CachedFragment],
        query: np.ndarray,
        k: int,
        predicate: Predicate | None,
        fetch: list[str],
    ) -> list[pa.Table]:
        """Exact top-k of unindexed base fragments as `engine.unindexed` holds them (or
        reads them, batch by batch), one table of candidates (`fetch` columns and
        `_distance`) per fragment or batch that has any."""
        assert self.spec.vector is not None
        out = []
        for fragment in fragments:
            if not fragment.num_rows:
                continue
            eligible = None if predicate is None else predicate.mask(fragment.rows)
            rows, dist = fragment_knn(fragment, query, k, eligible, self.spec.vector.metric)
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
    ) -> BaseKnn:
        """How to search the base: Lance's part and the cached unindexed fragments' part."""
        assert self.spec.vector is not None
        base = snap.base
        vector_name = self.spec.vector.name
        if base.count_rows() == 0:
            return BaseKnn(lambda limit: pa.table({}), lambda limit: [])
        settings = self.ctx.settings
        refine = refine_factor if refine_factor is not None else settings.refine_factor
        indexed = self.ctx.stats.cached(
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
            # At least this many IVF partitions, more while a filter leaves fewer than k
            # matching rows in them (`nprobes` alone is also the most: a selective filter
            # then answered with fewer than k rows, or none, though k rows matched).
            "minimum_nprobes": nprobes or settings.nprobes,
            "search_effort": 0.0,  # start at the minimum (Lance's default starts higher)
        }
        if refine is not None:
            nearest["refine_factor"] = refine
        # The fragments the index does not cover yet (all of them before it exists): Lance
        # searches only the indexed ones (fast_search), if any, and faiss the rest, held in
        # memory or, beyond the bound, read here (see engine.unindexed).
        # Which they are is asked when the fresh part runs (`fresh_rows`, on the query's
        # thread after its fan-out requests went out): a fragment just flushed may have to
        # be loaded first, and the owner pods search their memtables meanwhile.
        unindexed = self.unindexed
        cover: Covering | None = None

        def lance_rows(limit: int) -> pa.Table:
            if unindexed is not None and not indexed:
                return pa.table({})  # no fragment is indexed
            found: pa.Table = base.to_table(
                nearest={**nearest, "k": limit},
                filter=None if predicate is None else predicate.sql,
                prefilter=True,
                columns=[*fetch, DISTANCE],
                fast_search=unindexed is not None,
                io_buffer_size=SCAN_IO_BUFFER_BYTES,
                batch_readahead=SCAN_BATCH_READAHEAD,
            )
            return found

        def fresh_rows(limit: int) -> list[pa.Table]:
            nonlocal cover
            if unindexed is None:
                return []
            if cover is None:  # the first round; an over-fetch's rounds use the same fragments
                with stage("vector_unindexed_load"):
                    cover = unindexed.covering(base)
            held, unheld = cover.held, cover.unheld
            with stage("vector_unindexed_search"):
                found = self._knn_fragments(held, query, limit, predicate, fetch)
            if unheld:
                wanted = {vector_name, *fetch, *(predicate.columns if predicate else ())}
                columns = [c for c in self.spec.table_schema.names if c in wanted]
                for fragment in unheld:
                    batches = unindexed.scan(
                        base,
                        fragment,
                        columns,
                        None if predicate is None else predicate.sql,
                        io_buffer_size=SCAN_IO_BUFFER_BYTES,
                        batch_readahead=SCAN_BATCH_READAHEAD,
                    )
                    with stage("vector_unindexed_read"):
                        found.append(
                            top(
                                self._knn_fragments(batches, query, limit, predicate, fetch),
                                DISTANCE,
                                limit,
                                ascending=True,
                            )
                        )
            return found

        return BaseKnn(lance_rows, fresh_rows)


def _well_scaled(query: np.ndarray, metric: str) -> np.ndarray:
    """The query vector as it is searched: for cosine, scaled to length 1 (cosine ignores
    length, and float32 products of a vector scaled by 1e-25 or 1e30 underflow or
    overflow: rows came back in arbitrary order, with distances such as -77,200).

    Raises:
        QueryError: a zero vector for cosine (no direction), or one whose squared length
            does not fit float32 for the other metrics (every distance would overflow).
    """
    norm = float(np.linalg.norm(query.astype(np.float64)))
    if metric == "cosine":
        if norm == 0.0:
            raise QueryError("vector is all zeros: it has no direction for cosine distance")
        return (query.astype(np.float64) / norm).astype(np.float32)
    if norm * norm > float(np.finfo(np.float32).max):
        raise QueryError(
            f"vector is too long for {metric} distance: its squared length ({norm * norm:.3g}) "
            "overflows float32"
        )
    return query


def exact_knn(
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
            rows, dist = faiss_knn(q, matrix, kk, metric)
            keep = eligible[rows]
            if int(keep.sum()) >= k:
                return rows[keep][:k], dist[keep][:k]
    if metric != "cosine" and excluded <= FAST_EXCLUDED_MAX:
        kk = min(n, k + excluded)
        rows, dist = faiss_knn(q, matrix, kk, metric)
        if eligible is not None:
            keep = eligible[rows]
            rows, dist = rows[keep], dist[keep]
        return rows[:k], dist[:k]
    index = np.flatnonzero(eligible) if eligible is not None else None
    if metric == "cosine":
        all_norms = norms()
        sub_norms = all_norms if index is None else all_norms[index]
        qn = query / max(float(np.linalg.norm(query)), 1e-30)
        if index is None:
            dots = matrix @ qn
        elif len(index) < n * GATHER_SHARE_MAX:
            dots = matrix[index] @ qn
        else:
            dots = (matrix @ qn)[index]
        with np.errstate(invalid="ignore", divide="ignore"):
            dist_all = (1.0 - dots / sub_norms).astype(np.float32)
        # A zero row has no direction: no cosine neighbour of any query (its distance is
        # NaN, which Lance leaves out of every answer too; docs/reads.md).
        directed = np.flatnonzero(sub_norms > 0.0)
        if len(directed) < len(dist_all):
            index = directed if index is None else index[directed]
            dist_all = dist_all[directed]
        kk = min(k, len(dist_all))
        top = np.argpartition(dist_all, kk - 1)[:kk] if kk < len(dist_all) else np.arange(kk)
        top = top[np.argsort(dist_all[top], kind="stable")]
        rows_sub, dist = top, dist_all[top]
    else:
        sub = matrix if index is None else matrix[index]
        rows_sub, dist = faiss_knn(q, np.ascontiguousarray(sub), min(k, sub.shape[0]), metric)
    rows = rows_sub if index is None else index[rows_sub]
    return rows.astype(np.int64), dist.astype(np.float32)


def fragment_knn(
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
        top, dist = exact_knn(
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
    return exact_knn(fragment.matrix, fragment.row_norms, query, k, eligible, metric)


def _given(value: np.ndarray) -> Callable[[], np.ndarray]:
    return lambda: value


def faiss_knn(
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
