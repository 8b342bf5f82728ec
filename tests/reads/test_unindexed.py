"""Base fragments the vector index does not cover yet are searched in memory (faiss) instead
of by Lance's flat scan (`engine.unindexed`): same rows as Lance's own search, deletions of
later upserts respected, bounded memory with a fallback, dropped once indexed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest

from engine import prune
from engine import unindexed as unindexed_module
from engine.memtable import Memtable
from engine.reader import ReaderSettings
from engine.reads import text as text_module
from engine.unindexed import FlushedText, HeldText, UnindexedFragments
from tests.reads.conftest import ReadHarness, read_spec, rows_batch, vectors, wait_for

pytestmark = pytest.mark.timeout(180)

MakeHarness = Callable[..., ReadHarness]
DIM = 16


def indexed_then_fresh(h: ReadHarness, metric: str = "l2") -> None:
    """Offsets 0..1999 in indexed base fragments, 2000..2999 in one unindexed fragment."""
    w = h.open()
    h.put(w, range(2000))
    h.flush(w)
    h.table.dataset().create_index(
        "vec", "IVF_PQ", metric=metric, num_partitions=4, num_sub_vectors=4
    )
    h.put(w, range(2000, 3000))
    h.flush(w)


#: Every IVF partition probed, every candidate re-ranked exactly (k x refine > rows): two
#: harnesses train their own index, and their approximations must not decide a comparison.
EXACT: dict[str, Any] = {"nprobes": 4, "refine_factor": 1000}


def search(h: ReadHarness, q: np.ndarray, **kw: object) -> tuple[list[int], np.ndarray]:
    got = h.reader.search_vector(q, k=10, columns=["_offset"], **EXACT, **kw)
    return got.column("_offset").to_pylist(), got.column("_distance").to_numpy()


def cache_in_use(make_harness: MakeHarness) -> tuple[ReadHarness, UnindexedFragments]:
    """`indexed_then_fresh`, then a first vector query: the cache holds the unindexed
    fragment and its background loader runs."""
    h = make_harness(dim=DIM)
    indexed_then_fresh(h)
    cache = h.reader.unindexed
    assert cache is not None
    search(h, vectors(np.array([1]), DIM)[0])
    return h, cache


@pytest.mark.parametrize("metric", ["l2", "cosine", "dot"])
def test_unindexed_fragment_is_searched_in_memory_with_lances_results(
    make_harness: MakeHarness, metric: str
) -> None:
    cached = make_harness("cached", metric=metric, dim=DIM)
    lance_only = make_harness(
        "lance", metric=metric, dim=DIM, settings=ReaderSettings(unindexed_cache_bytes=0)
    )
    indexed_then_fresh(cached, metric)
    indexed_then_fresh(lance_only, metric)
    assert lance_only.reader.unindexed is None
    queries = np.random.default_rng(5).standard_normal((15, DIM)).astype(np.float32)
    # Queries near fresh rows, so the unindexed fragment decides the top k.
    queries[:5] = vectors(np.arange(2100, 2105), DIM) + 0.01
    fresh_hits = 0
    for q in queries:
        got, dist = search(cached, q)
        want, want_dist = search(lance_only, q)
        assert got == want
        np.testing.assert_allclose(dist, want_dist, rtol=1e-4, atol=1e-4)
        fresh_hits += sum(o >= 2000 for o in got)
    assert fresh_hits >= 5
    cache = cached.reader.unindexed
    assert cache is not None
    assert cache.loads == 1
    assert cache.fallbacks == 0
    assert cache.nbytes >= 1000 * DIM * 4


def test_filter_applies_to_the_cached_fragment(make_harness: MakeHarness) -> None:
    cached = make_harness("cached", dim=DIM)
    lance_only = make_harness("lance", dim=DIM, settings=ReaderSettings(unindexed_cache_bytes=0))
    indexed_then_fresh(cached)
    indexed_then_fresh(lance_only)
    q = vectors(np.array([2500]), DIM)[0]
    for where in ["n >= 2400 AND n < 2600", "f < 550 OR n IS NULL", "flag", "n < 100"]:
        got, _ = search(cached, q, filter=where)
        want, _ = search(lance_only, q, filter=where)
        assert got == want, where
    got, _ = search(cached, q, filter="n >= 2400 AND n < 2600")
    assert got
    assert all(2400 <= o < 2600 for o in got)


def test_upserts_that_delete_cached_rows_are_seen(make_harness: MakeHarness) -> None:
    """A later flush deletes old versions of its keys from the cached fragment (a new
    deletion file): the cache reloads that fragment and never returns the old version."""
    h = make_harness(mode="upsert", dim=DIM)
    indexed_then_fresh(h)
    old = vectors(np.array([2500]), DIM)[0]
    got, _ = search(h, old)
    assert got[0] == 2500
    cache = h.reader.unindexed
    assert cache is not None
    assert cache.loads == 1
    # New versions of keys k2500..k2509 (offsets 2500..2509 keep their keys): the merge-insert
    # deletes the old rows from the cached fragment.
    w = h.writers[0]
    h.put(w, range(3000, 3010), key_of=lambda o: f"k{o - 500}", version=1)
    h.flush(w)
    ids = h.reader.search_vector(old, k=10, columns=["id", "_offset"])
    assert 2500 not in ids.column("_offset").to_pylist()
    assert ids.column("id").to_pylist().count("k2500") <= 1
    rows = h.reader.lookup(["k2500"], columns=["id", "_offset"])
    assert rows.column("_offset").to_pylist() == [3000]
    assert cache.loads >= 2  # the fragment with the new deletion file, and the new one
    assert cache.handoffs == 0  # merge-insert commits are read back, never handed over


def lance_knn_calls(monkeypatch: pytest.MonkeyPatch, h: ReadHarness) -> list[bool]:
    """From now on, the `fast_search` flag of every Lance kNN search of `h`'s table."""
    calls: list[bool] = []
    original = lance.LanceDataset.to_table

    def counted(self: lance.LanceDataset, *args: Any, **kwargs: Any) -> pa.Table:
        if kwargs.get("nearest") is not None and self.uri == h.spec.uri:
            calls.append(bool(kwargs.get("fast_search")))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "to_table", counted)
    return calls


def queries_near(seed: int, offsets: list[int], random: int = 4) -> np.ndarray:
    """`random` random query vectors, then one next to the row of each offset."""
    rng = np.random.default_rng(seed)
    near = vectors(np.array(offsets), DIM) + 0.01
    return np.vstack([rng.standard_normal((random, DIM)), near]).astype(np.float32)


def answers_as_lance_does(
    h: ReadHarness, lance_only: ReadHarness, queries: np.ndarray, filters: tuple[str | None, ...]
) -> None:
    """Every query, with every filter, returns the rows and distances Lance's own search
    returns on `lance_only` (the same rows without the unindexed cache)."""
    for q in queries:
        for where in filters:
            got, dist = search(h, q, filter=where)
            want, want_dist = search(lance_only, q, filter=where)
            assert got == want, where
            np.testing.assert_allclose(dist, want_dist, rtol=1e-4, atol=1e-4)


def unindexed_base(h: ReadHarness, metric: str = "l2") -> None:
    """Offsets 0..2999 in two base fragments and no vector index (the table's first rows,
    a catch-up before maintenance built the index, a table below `vector_index_min_rows`)."""
    w = h.open()
    h.put(w, range(2000))
    h.flush(w)
    append_elsewhere(h, range(2000, 3000))  # read back, not handed over


@pytest.mark.parametrize("metric", ["l2", "cosine", "dot"])
def test_before_the_vector_index_exists_the_base_is_searched_in_memory(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch, metric: str
) -> None:
    """No vector index yet: every base fragment is held and searched in memory, Lance's flat
    scan not at all (it read the whole base on every query), with Lance's answers."""
    cached = make_harness("cached", metric=metric, dim=DIM)
    lance_only = make_harness(
        "lance", metric=metric, dim=DIM, settings=ReaderSettings(unindexed_cache_bytes=0)
    )
    unindexed_base(cached, metric)
    unindexed_base(lance_only, metric)
    cache = cached.reader.unindexed
    assert cache is not None
    scans = lance_knn_calls(monkeypatch, cached)
    queries = queries_near(3, [10, 1999, 2000, 2999])
    answers_as_lance_does(cached, lance_only, queries, (None, "n >= 1500 AND n < 2500", "n < 0"))
    assert scans == []
    assert (cache.loads + cache.handoffs, cache.fallbacks) == (2, 0)
    assert cache.nbytes >= 3000 * DIM * 4


def test_a_fragment_read_by_the_query_has_its_deleted_rows_left_out(
    make_harness: MakeHarness,
) -> None:
    """Beyond the bound, an unindexed fragment whose rows a later upsert deleted is read
    without them (Lance applies the deletion file)."""
    h = make_harness(mode="upsert", dim=DIM, settings=ReaderSettings(unindexed_cache_bytes=4096))
    indexed_then_fresh(h)
    old = vectors(np.array([2500]), DIM)[0]
    assert search(h, old)[0][0] == 2500
    w = h.writers[0]
    h.put(w, range(3000, 3010), key_of=lambda o: f"k{o - 500}", version=1)
    h.flush(w)
    got = h.reader.search_vector(old, k=10, columns=["id", "_offset"], **EXACT)
    assert 2500 not in got.column("_offset").to_pylist()
    assert got.column("id").to_pylist().count("k2500") <= 1
    cache = h.reader.unindexed
    assert cache is not None
    assert cache.nbytes <= 4096  # at most the upsert's own 10 rows
    assert cache.fallbacks >= 2


def two_unindexed_fragments(h: ReadHarness, indexed: bool) -> None:
    """Two fragments the vector index does not cover, the second appended elsewhere: offsets
    2000..2999 and 3000..3499 beside an indexed 0..1999 (`indexed`), or 0..1999 and
    2000..2999 with no vector index."""
    if indexed:
        indexed_then_fresh(h)
        append_elsewhere(h, range(3000, 3500))
    else:
        unindexed_base(h)


@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.parametrize("held", [0, 1])
def test_beyond_the_bound_a_query_reads_the_fragments_not_held_itself(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch, indexed: bool, held: int
) -> None:
    """The unindexed fragments that fit in the bound are held (lowest ids first), the others
    are read by each query in batches and kept nowhere: Lance's answers, and Lance searches
    only the indexed fragments (before, the whole unindexed part fell back to Lance's flat
    search of every fragment)."""
    monkeypatch.setattr(unindexed_module, "SCAN_BATCH_ROWS", 300)
    lance_only = make_harness("lance", dim=DIM, settings=ReaderSettings(unindexed_cache_bytes=0))
    two_unindexed_fragments(lance_only, indexed)
    bound = 4096
    if held:  # room for the first fragment, not for both
        probe = make_harness("probe", dim=DIM)
        two_unindexed_fragments(probe, indexed)
        search(probe, vectors(np.array([1]), DIM)[0])
        assert probe.reader.unindexed is not None
        bound = probe.reader.unindexed.nbytes - 1
    small = make_harness("small", dim=DIM, settings=ReaderSettings(unindexed_cache_bytes=bound))
    two_unindexed_fragments(small, indexed)
    scans = lance_knn_calls(monkeypatch, small)
    queries = queries_near(4, [100, 2100, 2999, 3400])
    answers_as_lance_does(small, lance_only, queries, (None, "n >= 1500 AND n < 3200", "n < 0"))
    cache = small.reader.unindexed
    assert cache is not None
    assert (cache.loads, cache.nbytes > 0) == (held, held > 0)
    assert cache.nbytes <= bound
    assert cache.fallbacks >= len(queries) * 3
    assert scans == ([True] * len(queries) * 3 if indexed else [])


def pruned_harness(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch, name: str, **kw: Any
) -> ReadHarness:
    """Offsets 0..1999 indexed, 2000..6999 in one unindexed fragment, pruners built for
    fragments from 1000 rows."""
    monkeypatch.setattr(unindexed_module, "PRUNE_MIN_ROWS", 1000)
    h = make_harness(name, dim=DIM, **kw)
    indexed_then_fresh(h)
    h.put(h.writers[0], range(3000, 7000))
    h.flush(h.writers[0])
    return h


def test_cached_fragments_get_int8_pruners_and_answer_as_lance_does(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background loader gives each cached fragment its int8 codes (`engine.prune`);
    queries then re-rank the codes' candidates exactly and return Lance's rows."""
    cached = pruned_harness(make_harness, monkeypatch, "cached")
    lance_only = pruned_harness(
        make_harness, monkeypatch, "lance", settings=ReaderSettings(unindexed_cache_bytes=0)
    )
    cache = cached.reader.unindexed
    assert cache is not None
    search(cached, vectors(np.array([1]), DIM)[0])  # first use: loads, then codes built
    wait_for(lambda: cache.pruners == 2, "no pruners were built")
    assert cache.pruner_bytes == 5000 * DIM
    searches: list[int] = []
    original = prune.Pruner.search

    def counted(self: prune.Pruner, *args: Any) -> Any:
        searches.append(self.num_rows)
        return original(self, *args)

    monkeypatch.setattr(prune.Pruner, "search", counted)
    rng = np.random.default_rng(9)
    queries = np.vstack(
        [rng.standard_normal((5, DIM)), vectors(np.array([2100, 3500, 5000, 6999]), DIM) + 0.01]
    ).astype(np.float32)
    for q in queries:
        for where in (None, "n >= 2400 AND n < 6500"):
            got, dist = search(cached, q, filter=where)
            want, want_dist = search(lance_only, q, filter=where)
            assert got == want, where
            np.testing.assert_allclose(dist, want_dist, rtol=1e-4, atol=1e-4)
    assert searches, "no query used a pruner"
    assert cache.fallbacks == 0


def test_pruners_give_way_to_fragments_within_the_bound(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Codes are an optional speed-up: a fragment that needs their room gets it, and the
    cache never falls back to Lance for want of it."""
    h = pruned_harness(make_harness, monkeypatch, "shed")
    cache = h.reader.unindexed
    assert cache is not None
    search(h, vectors(np.array([1]), DIM)[0])
    wait_for(lambda: cache.pruners == 2, "no pruners were built")
    codes = cache.pruner_bytes
    # Room for the fragments held and another 4000 rows of the same kind, but not for the
    # codes on top.
    per_row = (cache.nbytes - codes) / 6000
    cache.max_bytes = int(cache.nbytes + 4000 * per_row + 4000 * DIM - codes / 2)
    append_elsewhere(h, range(7000, 11000))
    wait_for(lambda: cache.loads == 3, "the new fragment was not loaded")
    assert cache.nbytes <= cache.max_bytes
    assert cache.pruner_bytes < codes
    for offset in (3000, 9000):
        got, _ = search(h, vectors(np.array([offset]), DIM)[0])
        assert got[0] == offset
    assert cache.fallbacks == 0


def test_new_fragments_are_loaded_before_the_pruners_of_older_ones(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader stops building pruners, the one being built included (between its
    chunks), once a query met a newer base version with fragments it does not hold: it
    loads them first, so queries do not load them themselves, then builds the stopped
    pruner again."""
    h = pruned_harness(make_harness, monkeypatch, "order")
    monkeypatch.setattr(prune, "BUILD_CHUNK_ROWS", 256)
    cache = h.reader.unindexed
    assert cache is not None
    events: list[str] = []
    build, load = unindexed_module.build_pruner, cache._load

    def building(*args: Any) -> Any:
        matrix, metric, min_rows, norms, stop = args
        chunks = 0

        def stopping() -> bool:
            nonlocal chunks
            chunks += 1
            if chunks == 3 and not events.count("prune stopped"):
                # Within the first pruner: a flush elsewhere, met by a query.
                append_elsewhere(h, range(7000, 9000))
                cache._unindexed(h.table.dataset())
            return bool(stop())

        pruner = build(matrix, metric, min_rows, norms, stopping)
        events.append("prune" if pruner is not None else "prune stopped")
        return pruner

    def loading(key: Any, fragment: lance.LanceFragment) -> Any:
        events.append(f"load {fragment.count_rows()}")
        return load(key, fragment)

    monkeypatch.setattr(unindexed_module, "build_pruner", building)
    monkeypatch.setattr(cache, "_load", loading)
    search(h, vectors(np.array([1]), DIM)[0])  # loads both fragments, starts the loader
    wait_for(lambda: cache.pruners == 3, "the pruners were not all built")
    assert events[:4] == ["load 1000", "load 4000", "prune stopped", "load 2000"]
    assert events.count("prune") == 3


def append_elsewhere(h: ReadHarness, offsets: range) -> None:
    """Append rows the way another sink process would: not through this process's table."""
    rows = pa.Table.from_batches([rows_batch(h.spec, list(offsets))])
    table = rows.select(h.spec.table_schema.names).cast(h.spec.table_schema)
    lance.write_dataset(table, h.spec.uri, mode="append")


def test_a_loaded_fragments_vectors_are_viewed_not_copied(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fragment larger than Lance's batches (8,192 rows) is read as one batch, and the
    entry's matrix views its vectors: nothing is copied into a new matrix (fresh memory
    made a load 2-4x slower, and queries waited for it)."""
    h, cache = cache_in_use(make_harness)
    copies: list[tuple[int, int]] = []
    pool_matrix = unindexed_module.pool_matrix

    def copying(rows: int, dim: int) -> np.ndarray:
        copies.append((rows, dim))
        return pool_matrix(rows, dim)

    monkeypatch.setattr(unindexed_module, "pool_matrix", copying)
    append_elsewhere(h, range(3000, 13000))  # one 10,000-row fragment
    wait_for(lambda: cache.loads == 2, "the new fragment was not loaded")
    assert copies == []
    got, dist = search(h, vectors(np.array([12345]), DIM)[0])
    assert got[0] == 12345
    assert dist[0] == pytest.approx(0, abs=1e-4)


def test_other_fragments_load_in_the_background_and_leave_once_indexed(
    make_harness: MakeHarness,
) -> None:
    h, cache = cache_in_use(make_harness)
    assert cache.loads == 1
    append_elsewhere(h, range(3000, 3500))
    deadline = time.monotonic() + 10
    while cache.loads < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache.loads == 2, "the new fragment was not loaded without a query"
    assert cache.handoffs == 0
    # Once the index covers every fragment, the loader frees them.
    h.table.dataset().optimize.optimize_indices()
    deadline = time.monotonic() + 10
    while cache.nbytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache.nbytes == 0
    got, _ = search(h, vectors(np.array([3100]), DIM)[0])
    assert got[0] == 3100
    assert cache.loads == 2


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_own_flushes_hand_their_rows_over_without_a_load(
    make_harness: MakeHarness, metric: str
) -> None:
    """This process's flush gives the cache the rows it commits: nothing is read back, and
    queries return what Lance's own search returns."""
    cached = make_harness("cached", dim=DIM, metric=metric)
    lance_only = make_harness(
        "lance", dim=DIM, metric=metric, settings=ReaderSettings(unindexed_cache_bytes=0)
    )
    for h in (cached, lance_only):
        indexed_then_fresh(h, metric)
    cache = cached.reader.unindexed
    assert cache is not None
    search(cached, vectors(np.array([1]), DIM)[0])  # first use: loads the one fragment
    assert (cache.loads, cache.handoffs) == (1, 0)
    for h in (cached, lance_only):
        # Two flushes: the second fragment's rows follow the first's in the cache's keys.
        h.put(h.writers[0], range(3000, 3400))
        h.flush(h.writers[0])
        h.put(h.writers[0], range(3400, 3700))
        h.flush(h.writers[0])
    assert (cache.loads, cache.handoffs) == (1, 2)
    queries = vectors(np.array([3001, 3399, 3400, 3650, 2500, 7]), DIM) + 0.01
    for q in queries:
        got, dist = search(cached, q)
        want, want_dist = search(lance_only, q)
        assert got == want
        np.testing.assert_allclose(dist, want_dist, rtol=1e-4, atol=1e-4)
    for offset in (3001, 3399, 3400, 3650):
        got, dist = search(cached, vectors(np.array([offset]), DIM)[0])
        assert got[0] == offset
    # Every column comes back as Lance stores it, the vector rebuilt from the matrix.
    q = vectors(np.array([3650]), DIM)[0]
    columns = ["_offset", "vec", "text", "ts"]
    got_rows = cached.reader.search_vector(q, k=5, columns=columns, **EXACT)
    want_rows = lance_only.reader.search_vector(
        q,
        k=5,
        columns=columns,
        **EXACT,
    )
    assert got_rows.schema == want_rows.schema
    assert got_rows.select(columns).to_pylist() == want_rows.select(columns).to_pylist()
    assert (cache.loads, cache.handoffs, cache.fallbacks) == (1, 2, 0)


def test_a_query_waits_for_an_append_being_handed_over(make_harness: MakeHarness) -> None:
    """While an append is between its commit and its handoff, a query that meets the new
    fragment waits for the handoff instead of loading the fragment itself."""
    h, cache = cache_in_use(make_harness)
    rows = rows_batch(h.spec, list(range(5000, 5300)))
    table = pa.Table.from_batches([rows]).select(h.spec.table_schema.names)
    record = table.cast(h.spec.table_schema).combine_chunks().to_batches()[0]
    results: list[list[int]] = []
    with cache.appending(pa.Table.from_batches([record])) as committed:
        ds = lance.write_dataset(pa.Table.from_batches([record]), h.spec.uri, mode="append")
        query = threading.Thread(
            target=lambda: results.append(search(h, vectors(np.array([5100]), DIM)[0])[0])
        )
        query.start()
        query.join(0.5)
        assert query.is_alive(), "the query did not wait for the handoff"
        committed(ds)
    query.join(10)
    assert results
    assert results[0][0] == 5100
    assert (cache.loads, cache.handoffs) == (1, 1)


def test_a_query_does_not_wait_for_an_append_that_cannot_hold_its_fragment(
    make_harness: MakeHarness,
) -> None:
    """A fragment older than an in-flight append (here another process's) cannot be that
    append's: a query that needs it loads it at once."""
    h, cache = cache_in_use(make_harness)
    append_elsewhere(h, range(6000, 6100))
    record = pa.Table.from_batches([rows_batch(h.spec, list(range(7000, 7010)))])
    pending = record.select(h.spec.table_schema.names).cast(h.spec.table_schema)
    results: list[list[int]] = []
    with cache.appending(pending):
        query = threading.Thread(
            target=lambda: results.append(search(h, vectors(np.array([6050]), DIM)[0])[0])
        )
        query.start()
        query.join(1.5)  # HANDOFF_WAIT_S is 2 s
        assert not query.is_alive(), "the query waited for an unrelated append"
    assert results
    assert results[0][0] == 6050


def test_a_failed_handoff_never_fails_the_flush(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h, cache = cache_in_use(make_harness)

    def unreachable() -> None:
        raise OSError("storage unreachable")

    monkeypatch.setattr(cache, "_open_base", unreachable)
    h.put(h.writers[0], range(8000, 8100))
    h.flush(h.writers[0])  # asserts the flush completed
    monkeypatch.undo()
    assert cache.handoffs == 0
    got, _ = search(h, vectors(np.array([8042]), DIM)[0])
    assert got[0] == 8042
    assert cache.loads == 2  # read back instead


def test_a_fragment_that_fails_to_load_falls_back_to_lance(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = make_harness(dim=DIM)
    indexed_then_fresh(h)
    cache = h.reader.unindexed
    assert cache is not None

    def broken(*args: object) -> None:
        raise OSError("fragment file went away")

    monkeypatch.setattr(cache, "_load", broken)
    got, dist = search(h, vectors(np.array([2700]), DIM)[0])
    assert got[0] == 2700
    assert dist[0] < 1e-6
    assert cache.fallbacks >= 1
    assert cache.loads == 0


def text_indexed_then_flushed(h: ReadHarness) -> None:
    """Offsets 0..999 in the text index, 1000..1599 flushed after it in three puts (first
    text query in between, so this process's reader holds the flushed memtable, its three
    batches as one)."""
    w = h.open()
    h.put(w, range(1000))
    h.flush(w)
    h.index_text()
    h.reader.search_text("alpha", k=1)  # the first text query: flushed memtables are held
    for start in (1000, 1200, 1400):
        h.put(w, range(start, start + 200))
    h.flush(w)


def offsets_found(h: ReadHarness, text: str, **kw: object) -> list[int]:
    got = h.reader.search_text(text, k=1000, columns=["_offset"], **kw)
    return sorted(got.column("_offset").to_pylist())


def answers_as_lance(held: ReadHarness, lance_only: ReadHarness) -> None:
    """Text queries (plain, filtered, phrase) find the same rows through `held`'s held
    memtables as Lance finds in `lance_only`'s base, rows past offset 1,000 among them."""
    for text, kw in [
        ("row1234", {}),
        ("alpha", {}),
        ("bravo delta", {"filter": "n >= 1100 AND n < 1500"}),
        ("delta golf", {"phrase": True}),
    ]:
        got = offsets_found(held, text, **kw)
        assert got == offsets_found(lance_only, text, **kw), text
        assert any(o >= 1000 for o in got), text


def test_flushed_memtables_answer_text_until_the_index_covers_them(
    make_harness: MakeHarness,
) -> None:
    """Rows a flush appended after the text index are scored from the flushed memtable, not
    by Lance's flat scan: the same rows come back, with comparable scores."""
    held = make_harness("held", dim=DIM)
    lance_only = make_harness("lance", dim=DIM, settings=ReaderSettings(unindexed_cache_bytes=0))
    text_indexed_then_flushed(held)
    text_indexed_then_flushed(lance_only)
    assert lance_only.reader.flushed_text is None
    holder = held.reader.flushed_text
    assert holder is not None
    assert holder.handoffs == 1
    views = holder.views(held.table.dataset(), "text")
    assert views is not None
    assert sum(b.num_rows for v in views for b in v.view.batches) == 600
    assert held.reader.unindexed_bytes >= holder.nbytes > 0  # under the shared bound
    answers_as_lance(held, lance_only)
    top = held.reader.search_text("row1234", k=1, columns=["_offset"])
    want = lance_only.reader.search_text("row1234", k=1, columns=["_offset"])
    assert top.column("_offset").to_pylist() == [1234]
    assert top.column("_score")[0].as_py() == pytest.approx(want.column("_score")[0].as_py(), 0.2)
    assert holder.fallbacks == 0
    # Once the index covers the flushed fragment, the memtable is let go.
    held.table.dataset().optimize.optimize_indices()
    assert offsets_found(held, "row1234") == [1234]
    assert holder.nbytes == 0
    assert holder.views(held.table.dataset(), "text") == []


def test_fragments_flushed_elsewhere_are_read_back_for_text_once(
    make_harness: MakeHarness,
) -> None:
    """Fragments the text index lacks that no flush of this process handed over (another
    pod's; every fragment for `lance-sink serve`) are read back and tokenised once, by the
    first queries that need them (however many ask at once), then scored as held memtables:
    Lance no longer searches them flat, re-tokenising on every query, and the answers are
    Lance's. Before, a query met them unheld until the background loader's second pass
    found them (during a catch-up: a new fragment every flush round), and fell back to
    Lance's flat search of every unindexed fragment."""
    held = make_harness("held", dim=DIM)
    lance_only = make_harness("lance", dim=DIM, settings=ReaderSettings(unindexed_cache_bytes=0))
    for h in (held, lance_only):
        w = h.open()
        h.put(w, range(1000))
        h.flush(w)
        h.index_text()
        append_elsewhere(h, range(1000, 1300))
        append_elsewhere(h, range(1300, 1600))
    holder = held.reader.flushed_text
    assert holder is not None
    asking = [
        threading.Thread(target=lambda: holder.views(held.table.dataset(), "text"))
        for _ in range(4)
    ]
    for t in asking:
        t.start()
    for t in asking:
        t.join()
    assert holder.loads == 2, "each fragment flushed elsewhere read back once"
    assert (holder.handoffs, holder.fallbacks) == (0, 0)
    views = holder.views(held.table.dataset(), "text")
    assert views is not None
    assert sorted(v.fragments[0][1] for v in views) == [300, 300]
    fallbacks = holder.fallbacks
    answers_as_lance(held, lance_only)
    assert holder.fallbacks == fallbacks  # every query used the read-back rows
    # A row asked for with its vector takes it from its fragment.
    top = held.reader.search_text("row1500", k=1, columns=["_offset", "vec"])
    want = lance_only.reader.search_text("row1500", k=1, columns=["_offset", "vec"])
    assert top.column("_offset").to_pylist() == [1500]
    assert top.column("vec").to_pylist() == want.column("vec").to_pylist()
    # Once the index covers them, they are let go and not read again.
    held.table.dataset().optimize.optimize_indices()
    assert offsets_found(held, "row1234") == [1234]
    assert holder.nbytes == 0
    time.sleep(0.5)  # two loader passes
    assert holder.loads == 2


def test_before_the_first_text_index_the_base_is_tokenised_once_not_per_query(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until maintenance builds a column's first INVERTED index (10 s under the catch-up of
    bench.catchup), every text query tokenised the whole base again
    (`unindexed_base_bm25`: 3-5 s a query there). Now the base's fragments are read back
    and tokenised once, held, and scored with the base's own exact statistics as that
    path scores them, memtable rows as before: the same rows and scores."""
    held = make_harness("held", dim=DIM)
    lance_only = make_harness("lance", dim=DIM, settings=ReaderSettings(unindexed_cache_bytes=0))
    queries: list[tuple[str, dict[str, Any]]] = [
        ("row1234", {}),
        ("alpha bravo", {}),
        ("bravo delta", {"filter": "n >= 500 AND n < 1700"}),
        ("delta golf", {"phrase": True}),
    ]
    for h in (held, lance_only):
        w = h.open()
        h.put(w, range(1000))
        h.flush(w)
        append_elsewhere(h, range(1000, 1300))
        append_elsewhere(h, range(1300, 1600))
        h.put(w, range(1600, 1800))  # and memtable rows, scored with the global statistics

    def ranked(h: ReadHarness, text: str, **kw: object) -> list[tuple[float, int]]:
        """Every match as (score, offset), best first (ties in offset order)."""
        got = h.reader.search_text(text, k=1000, columns=["_offset"], **kw)
        pairs = zip(
            got.column("_score").to_pylist(), got.column("_offset").to_pylist(), strict=True
        )
        return sorted(((round(score, 4), o) for score, o in pairs), key=lambda p: (-p[0], p[1]))

    want = [ranked(lance_only, t, **kw) for t, kw in queries]

    def tokenised_again(*args: object) -> None:
        raise AssertionError("the whole base was tokenised again for a query")

    monkeypatch.setattr(text_module, "unindexed_base_bm25", tokenised_again)
    holder = held.reader.flushed_text
    assert holder is not None
    for _ in range(2):
        for (text, kw), expected in zip(queries, want, strict=True):
            assert ranked(held, text, **kw) == expected, text
    assert any(o < 1000 for _, o in want[1])
    assert any(o >= 1600 for _, o in want[1])
    assert (holder.loads, holder.fallbacks) == (3, 0)  # each fragment read back once
    # Once the index exists, the held rows it covers are let go and Lance searches them.
    held.index_text()
    assert offsets_found(held, "row1234") == [1234]
    assert holder.nbytes == 0


def indexed_then_appended_elsewhere(h: ReadHarness) -> FlushedText:
    """Offsets 0..999 flushed and text-indexed, 1000..1299 appended by another process;
    the reader's text holder."""
    w = h.open()
    h.put(w, range(1000))
    h.flush(w)
    h.index_text()
    append_elsewhere(h, range(1000, 1300))
    holder = h.reader.flushed_text
    assert holder is not None
    return holder


def test_the_loader_reads_fragments_flushed_elsewhere_back_before_a_query_needs_them(
    make_harness: MakeHarness,
) -> None:
    """The background loader reads a fragment back from its second pass that finds it (a
    flush of this process hands its memtable over before that), so queries rarely pay."""
    h = make_harness("held", dim=DIM)
    holder = indexed_then_appended_elsewhere(h)
    holder.refresh()
    assert holder.loads == 0  # the first pass only notes it
    holder.refresh()
    assert holder.loads == 1
    views = holder.views(h.table.dataset(), "text")
    assert views is not None
    assert [v.fragments[0][1] for v in views] == [300]
    assert holder.loads == 1
    assert offsets_found(h, "row1234") == [1234]


def test_fragments_read_back_for_text_are_held_only_within_the_bound(
    make_harness: MakeHarness,
) -> None:
    """A fragment that does not fit in the bound is not held (nor read again until room is
    freed): Lance searches the unindexed part itself, and the answers stay Lance's."""
    small = make_harness("small", dim=DIM, settings=ReaderSettings(unindexed_cache_bytes=4096))
    holder = indexed_then_appended_elsewhere(small)
    assert holder.views(small.table.dataset(), "text") is None  # no room for it
    assert holder.refused == 1
    time.sleep(0.5)  # two more loader passes: not read again
    assert (holder.refused, holder.loads, holder.nbytes) == (1, 0, 0)
    assert offsets_found(small, "row1234") == [1234]


def test_flushed_memtables_are_held_only_within_the_bound(make_harness: MakeHarness) -> None:
    small = make_harness("small", dim=DIM, settings=ReaderSettings(unindexed_cache_bytes=4096))
    text_indexed_then_flushed(small)
    holder = small.reader.flushed_text
    assert holder is not None
    assert holder.handoffs == 0
    assert holder.refused == 1
    assert holder.nbytes == 0
    assert holder.views(small.table.dataset(), "text") is None  # Lance searches it all
    assert offsets_found(small, "row1234") == [1234]
    assert holder.fallbacks == 2  # counted: both the views call and the query


def test_the_vector_cache_gives_its_codes_up_for_a_flushed_memtables_text(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the shared bound full of vectors and their int8 codes, a flushed memtable is
    still held for text: the vector cache sheds codes (an optional speed-up) to make room,
    so text queries do not scan its rows flat."""

    def run(name: str, bound: int | None = None) -> ReadHarness:
        h = pruned_harness(make_harness, monkeypatch, name)
        h.index_text()
        cache = h.reader.unindexed
        assert cache is not None
        search(h, vectors(np.array([1]), DIM)[0])
        wait_for(lambda: cache.pruners == 2, "no pruners were built")
        if bound is not None:
            cache.max_bytes = bound
        h.put(h.writers[0], range(7000, 7200))
        h.reader.search_text("alpha", k=1)  # tokenised before the flush: same bytes in both
        h.flush(h.writers[0])
        return h

    probe = run("probe")  # what the flush adds to each holder, with room for everything
    cache, text = probe.reader.unindexed, probe.reader.flushed_text
    assert cache is not None
    assert text is not None
    assert text.handoffs == 1
    codes = cache.pruner_bytes
    assert codes > 0
    # Room for the vectors and the text, but for only half of the codes beside them.
    h = run("tight", bound=cache.nbytes + text.nbytes - codes // 2)
    cache, text = h.reader.unindexed, h.reader.flushed_text
    assert cache is not None
    assert text is not None
    assert text.handoffs == 1
    assert text.refused == 0
    assert cache.handoffs == 1  # the flush's vectors were held too
    assert cache.pruner_bytes < codes
    assert cache.nbytes + text.nbytes <= cache.max_bytes
    assert offsets_found(h, "row7123") == [7123]
    assert text.fallbacks == 0
    left = cache.pruner_bytes
    assert cache.room_beside(cache.max_bytes + 1) is False  # more than shedding all would free
    assert cache.pruner_bytes == left  # so nothing is shed in vain
    assert cache.shed == 0
    # Room for the text but not for all the vectors beside it, codes shed or not: the vector
    # cache lets fragments go (text comes first); vector queries stay right (Lance searches
    # what is not held).
    probe_vectors = probe.reader.unindexed
    assert probe_vectors is not None
    q = vectors(np.array([7150]), DIM)[0]
    full = run("full", bound=probe_vectors.nbytes - codes + text.nbytes - 1)
    cache, text = full.reader.unindexed, full.reader.flushed_text
    assert cache is not None
    assert text is not None
    assert (text.handoffs, text.refused) == (1, 0)
    assert cache.shed >= 1
    assert cache.nbytes + text.nbytes <= cache.max_bytes
    assert offsets_found(full, "row7123") == [7123]
    assert text.fallbacks == 0
    assert search(full, q)[0] == search(probe, q)[0]


def test_a_held_memtable_keeps_no_vectors(make_harness: MakeHarness) -> None:
    """The held copy has every column but the vector one, as one batch, and the tokens of
    the flushed memtable (nothing is tokenised again); its bytes are counted without the
    vectors, so a bound too small for the vectors still holds it."""
    dim = 256  # 600 rows x 1 KiB of vectors: most of a memtable's bytes
    probe = make_harness("probe", dim=dim)
    w = probe.open()
    probe.put(w, range(1000))
    probe.flush(w)
    probe.index_text()
    for start in (1000, 1300):
        probe.put(w, range(start, start + 300))
    probe.reader.search_text("alpha", k=1)  # tokenises the memtable, then holds it flushed
    probe.flush(w)
    held = probe.reader.flushed_text
    assert held is not None
    views = held.views(probe.table.dataset(), "text")
    assert views is not None
    (one,) = views
    assert len(one.view.batches) == 1  # its puts' batches as one
    assert all("vec" not in b.schema.names for b in one.view.batches)
    assert one.nbytes == held.nbytes < 600 * dim * 4
    assert probe.reader.terms.terms_ready(one.view.memtable, "text") == len(one.view.batches)
    bound = held.nbytes + 16 * 1024  # the text rows fit; with their vectors they would not
    small = make_harness("small", dim=dim, settings=ReaderSettings(unindexed_cache_bytes=bound))
    text_indexed_then_flushed(small)
    holder = small.reader.flushed_text
    assert holder is not None
    assert holder.handoffs == 1
    assert offsets_found(small, "row1234") == [1234]
    assert holder.fallbacks == 0


def test_text_results_of_a_held_memtable_carry_their_vectors(make_harness: MakeHarness) -> None:
    """Every column, the vector one included, of rows scored from a held memtable equals
    what Lance returns for them (the vectors are taken from their base fragments)."""
    h = make_harness(dim=DIM)
    w = h.open()
    h.put(w, range(1000))
    h.flush(w)
    h.index_text()
    h.reader.search_text("alpha", k=1)
    for start in (1000, 1300):  # two flushes: two held memtables
        h.put(w, range(start, start + 300))
        h.flush(w)
    holder = h.reader.flushed_text
    assert holder is not None
    assert holder.handoffs == 2
    got = h.reader.search_text("alpha bravo", k=200)
    offsets = got.column("_offset").to_pylist()
    assert sum(o >= 1000 for o in offsets) > 50  # rows of both held memtables
    assert sum(o >= 1300 for o in offsets) > 20
    want = rows_batch(h.spec, offsets)
    for column in h.spec.table_schema.names:
        assert got.column(column).to_pylist() == want.column(column).to_pylist(), column
    assert holder.fallbacks == 0


def test_held_rows_are_located_in_their_fragments() -> None:
    """A held memtable written as fragments 5 (3 rows) then 9 (4 rows): its rows 0..6 are
    fragment 5's offsets 0..2, then fragment 9's 0..3."""
    held = HeldText(view=None, fragments=((5, 3), (9, 4)))  # type: ignore[arg-type]
    rows = np.array([6, 0, 3, 2])
    located = {f: (list(offsets), list(picked)) for f, offsets, picked in held.locate(rows)}
    assert located == {5: ([0, 2], [1, 3]), 9: ([3, 0], [0, 2])}


def test_each_text_column_uses_the_held_memtables_until_its_own_index_covers_them(
    make_harness: MakeHarness,
) -> None:
    """Two full-text columns, two indexes: once one index covers the flushed rows, queries
    on it use Lance alone, while the other column's queries keep using the held memtable."""
    h = make_harness(dim=DIM, fts_columns=("text", "id"))
    w = h.open()
    h.put(w, range(1000))
    h.flush(w)
    for column in ("text", "id"):
        h.index_text(column)
    h.reader.search_text("alpha", k=1)  # the first text query: flushed memtables are held
    h.put(w, range(1000, 1600))
    h.flush(w)
    holder = h.reader.flushed_text
    assert holder is not None
    assert holder.handoffs == 1
    # Only the `text` index catches up.
    h.table.dataset().optimize.optimize_indices(index_names=["text_idx"])
    base = h.table.dataset()
    assert holder.views(base, "text") == []
    id_views = holder.views(base, "id")
    assert id_views is not None
    assert sum(b.num_rows for v in id_views for b in v.view.batches) == 600
    assert offsets_found(h, "row1234") == [1234]
    assert offsets_found(h, "k1234", column="id") == [1234]
    assert holder.nbytes > 0  # still needed by `id`
    h.table.dataset().optimize.optimize_indices(index_names=["id_idx"])
    assert holder.views(h.table.dataset(), "id") == []
    assert holder.nbytes == 0
    assert offsets_found(h, "k1234", column="id") == [1234]


def test_a_handed_over_matrix_lives_in_arrows_memory_pool() -> None:
    """`pool_matrix` is writable, float32, C-contiguous, and counted by Arrow's pool while it
    lives (malloc would map fresh pages for every flush's copy)."""
    before = pa.total_allocated_bytes()
    matrix = unindexed_module.pool_matrix(1000, 64)
    assert matrix.shape == (1000, 64)
    assert matrix.dtype == np.float32
    assert matrix.flags.c_contiguous
    assert matrix.flags.writeable
    assert pa.total_allocated_bytes() - before >= 1000 * 64 * 4
    matrix[:] = 1.5
    assert float(matrix.sum()) == 1.5 * 1000 * 64
    del matrix
    assert pa.total_allocated_bytes() - before < 1000 * 64 * 4


def test_a_read_back_memtable_counts_its_rows_once(tmp_path: Path) -> None:
    """Its batches are slices of one buffer: summing each slice's buffer size counted the
    fragment once per batch (100k short rows held 322 MiB instead of 22 in bench.text_tail)."""
    spec = read_spec(str(tmp_path / "t.lance"), dim=DIM)
    rows = pa.Table.from_batches([rows_batch(spec, list(range(2_000)))]).drop_columns(["vec"])
    memtable = Memtable.of_rows(spec, rows, 512)
    assert [b.num_rows for b in memtable.batches] == [512, 512, 512, 464]
    assert memtable.data_bytes == rows.combine_chunks().get_total_buffer_size()
    assert memtable.frozen
