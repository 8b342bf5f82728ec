"""Search quality: recall@10 against an exact faiss oracle with rows spread over the active
memtable, a frozen memtable and the base (with and without a base vector index); distances
and BM25 scores that compare across tiers; full-text finds fresh and flushed rows."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import faiss
import lance
import numpy as np
import pyarrow as pa
import pytest
from lance.query import MatchQuery

from engine import fts
from engine.filters import QueryError
from engine.reader import recall
from engine.reads import text as text_module
from engine.reads import vector as vector_module
from tests.reads.conftest import ReadHarness, vectors

pytestmark = pytest.mark.timeout(180)

MakeHarness = Callable[..., ReadHarness]
DIM = 16


def spread(h: ReadHarness) -> None:
    """Offsets 0..1999 in the base, 2000..2599 frozen, 2600..2999 active."""
    w = h.open()
    for first in range(0, 2000, 500):
        h.put(w, range(first, first + 500))
    h.flush(w)
    h.hold_flushes()
    h.put(w, range(2000, 2300))
    h.put(w, range(2300, 2600))
    w.seal()
    h.put(w, range(2600, 3000))
    stats = w.stats()
    assert stats.frozen_count == 1
    assert stats.rows == 400


def oracle(metric: str, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact (distances in Lance's terms, offsets) over all 3000 rows."""
    data = vectors(np.arange(3000), DIM)
    if metric == "l2":
        index: faiss.Index = faiss.IndexFlatL2(DIM)
        index.add(data)
        dist, ids = index.search(queries, k)
        return dist, ids
    if metric == "cosine":
        index = faiss.IndexFlatIP(DIM)
        index.add(data / np.linalg.norm(data, axis=1, keepdims=True))
        sims, ids = index.search(queries / np.linalg.norm(queries, axis=1, keepdims=True), k)
        return 1 - sims, ids
    index = faiss.IndexFlatIP(DIM)
    index.add(data)
    sims, ids = index.search(queries, k)
    return 1 - sims, ids


@pytest.mark.parametrize("metric", ["l2", "cosine", "dot"])
@pytest.mark.parametrize("indexed", [False, True], ids=["exact-base", "ivf-pq-base"])
def test_recall_at_10_across_tiers(make_harness: MakeHarness, metric: str, indexed: bool) -> None:
    h = make_harness(metric=metric, dim=DIM)
    spread(h)
    if indexed:
        h.table.dataset().create_index(
            "vec", "IVF_PQ", metric=metric, num_partitions=4, num_sub_vectors=4
        )
    queries = np.random.default_rng(42).standard_normal((20, DIM)).astype(np.float32)
    want_dist, want_ids = oracle(metric, queries, 10)
    recalls = []
    tiers_hit: set[str] = set()
    for q, truth, truth_dist in zip(queries, want_ids, want_dist, strict=True):
        got = h.reader.search_vector(q, k=10, columns=["_offset"], nprobes=4, refine_factor=10)
        offsets = got.column("_offset").to_pylist()
        recalls.append(recall(offsets, truth.tolist()))
        dist = got.column("_distance").to_numpy()
        assert np.all(np.diff(dist) >= -1e-5), "not sorted nearest first"
        if not indexed:  # exact everywhere: same neighbours, same distances as the oracle
            np.testing.assert_allclose(dist, truth_dist, rtol=1e-3, atol=1e-3)
        for o in offsets:
            tiers_hit.add("base" if o < 2000 else "frozen" if o < 2600 else "active")
    assert np.mean(recalls) >= 0.95, recalls
    assert tiers_hit == {"base", "frozen", "active"}


@pytest.mark.parametrize("metric", ["l2", "cosine", "dot"])
def test_distances_compare_across_tiers(make_harness: MakeHarness, metric: str) -> None:
    """The same rows in a memtable of one table and the (indexed) base of another give the
    same distances for the same query."""
    fresh = make_harness("fresh", metric=metric, dim=DIM)
    flushed = make_harness("flushed", metric=metric, dim=DIM)
    wf, wb = fresh.open(), flushed.open()
    fresh.put(wf, range(600))
    flushed.put(wb, range(600))
    flushed.flush(wb)
    flushed.table.dataset().create_index(
        "vec", "IVF_PQ", metric=metric, num_partitions=2, num_sub_vectors=4
    )
    q = np.random.default_rng(7).standard_normal(DIM).astype(np.float32)
    a = fresh.reader.search_vector(q, k=5, columns=["_offset"])
    b = flushed.reader.search_vector(q, k=5, columns=["_offset"], nprobes=2, refine_factor=20)
    assert a.column("_offset").to_pylist() == b.column("_offset").to_pylist()
    np.testing.assert_allclose(
        a.column("_distance").to_numpy(), b.column("_distance").to_numpy(), rtol=1e-4, atol=1e-4
    )


def test_filtered_knn_is_a_prefilter(make_harness: MakeHarness) -> None:
    """Top k among matching rows, in both tiers (not top k, then filtered)."""
    h = make_harness(dim=DIM)
    spread(h)
    q = vectors(np.array([10]), DIM)[0]
    got = h.reader.search_vector(q, k=10, filter="_offset >= 1500 AND _offset < 2700")
    offsets = got.column("_offset").to_pylist()
    assert len(offsets) == 10
    assert all(1500 <= o < 2700 for o in offsets)
    data = vectors(np.arange(1500, 2700), DIM)
    truth = np.argsort(((data - q) ** 2).sum(1))[:10] + 1500
    assert sorted(offsets) == sorted(truth.tolist())
    # A filter that matches a few rows returns just those.
    few = h.reader.search_vector(q, k=10, filter="_offset IN (3, 2100, 2900)")
    assert sorted(few.column("_offset").to_pylist()) == [3, 2100, 2900]


@pytest.mark.parametrize("metric", ["l2", "dot"])
def test_filtered_memtable_knn_overfetches_instead_of_copying(
    make_harness: MakeHarness, metric: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With many rows filtered out, a batch is searched whole for more than k neighbours
    (exact as long as k of them match) rather than copying its matching rows; a filter
    too selective for that still copies. Results equal brute force either way."""
    monkeypatch.setattr(vector_module, "FAST_EXCLUDED_MAX", 0)
    searched: list[int] = []
    real = vector_module.faiss_knn

    def spy(q: np.ndarray, matrix: np.ndarray, k: int, metric: str) -> tuple[Any, Any]:
        searched.append(matrix.shape[0])
        return real(q, matrix, k, metric)

    monkeypatch.setattr(vector_module, "faiss_knn", spy)
    h = make_harness(dim=DIM, metric=metric)
    w = h.open()
    h.put(w, range(3000))  # one 3000-row batch
    data = vectors(np.arange(3000), DIM)
    for q_off in (10, 2500):
        q = vectors(np.array([q_off + 7]), DIM, version=1)[0]
        for hi, whole in ((1500, True), (150, True), (15, False)):
            searched.clear()
            got = h.reader.search_vector(q, k=10, filter=f"_offset < {hi}", columns=["_offset"])
            sub = data[:hi]
            dist = ((sub - q) ** 2).sum(1) if metric == "l2" else 1 - sub @ q
            truth = np.sort(dist)[:10]
            assert np.allclose(np.sort(got.column("_distance").to_numpy()), truth, atol=1e-4)
            assert all(o < hi for o in got.column("_offset").to_pylist())
            assert searched, "the memtable was not searched"
            assert (searched[0] == 3000) is whole


def test_a_filtered_batch_asks_faiss_for_the_smaller_heap(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half of a batch filtered out: faiss is asked for enough rows to hold k matching ones
    twice over (56), not k + the excluded rows (1510), and the answer is still exact."""
    asked: list[int] = []
    real = vector_module.faiss_knn

    def spy(q: np.ndarray, matrix: np.ndarray, k: int, metric: str) -> tuple[Any, Any]:
        asked.append(k)
        return real(q, matrix, k, metric)

    monkeypatch.setattr(vector_module, "faiss_knn", spy)
    h = make_harness(dim=DIM)
    w = h.open()
    h.put(w, range(3000))  # one 3000-row batch
    data = vectors(np.arange(3000), DIM)
    q = vectors(np.array([2507]), DIM, version=1)[0]
    got = h.reader.search_vector(q, k=10, filter="_offset < 1500", columns=["_offset"])
    assert asked == [56]  # ceil(2 * 10 * 3000 / 1500) + 16
    truth = np.argsort(((data[:1500] - q) ** 2).sum(1))[:10]
    assert sorted(got.column("_offset").to_pylist()) == sorted(truth.tolist())


def test_fulltext_finds_fresh_and_flushed_rows(make_harness: MakeHarness) -> None:
    h = make_harness(dim=DIM)
    spread(h)
    for offset in [12, 2100, 2701]:  # base, frozen, active
        got = h.reader.search_text(f"row{offset}", k=3, columns=["_offset"])
        assert got.column("_offset").to_pylist() == [offset]
    for where, lo, hi in [("_offset < 2000", 0, 2000), ("_offset >= 2600", 2600, 3000)]:
        got = h.reader.search_text("alpha", k=50, filter=where, columns=["_offset"])
        offsets = got.column("_offset").to_pylist()
        assert len(offsets) == 50
        assert all(lo <= o < hi for o in offsets)
    h.index_text()
    for offset in [12, 2100, 2701]:
        got = h.reader.search_text(f"row{offset}", k=3, columns=["_offset"])
        assert got.column("_offset").to_pylist() == [offset]


@pytest.mark.parametrize("indexed", [False, True], ids=["flat", "inverted-index"])
def test_bm25_scores_compare_across_tiers(make_harness: MakeHarness, indexed: bool) -> None:
    """The same documents scored in a memtable (our BM25) and in the base (Lance's) get the
    same scores: the IDF statistics of an all-fresh table equal those of an all-flushed one."""
    fresh = make_harness("fresh", dim=DIM)
    flushed = make_harness("flushed", dim=DIM)
    wf, wb = fresh.open(), flushed.open()
    fresh.put(wf, range(300))
    flushed.put(wb, range(300))
    flushed.flush(wb)
    if indexed:
        flushed.index_text()
    for query in ["alpha", "bravo delta", "golf hotel row7"]:
        a = fresh.reader.search_text(query, k=20, columns=["_offset"])
        b = flushed.reader.search_text(query, k=20, columns=["_offset"])
        np.testing.assert_allclose(
            a.column("_score").to_numpy(), b.column("_score").to_numpy(), rtol=1e-3
        )
        score_a = dict(
            zip(a.column("_offset").to_pylist(), a.column("_score").to_pylist(), strict=True)
        )
        score_b = dict(
            zip(b.column("_offset").to_pylist(), b.column("_score").to_pylist(), strict=True)
        )
        common = set(score_a) & set(score_b)
        assert len(common) >= 15
        for o in common:
            assert score_a[o] == pytest.approx(score_b[o], rel=1e-3)


def test_phrase_query_in_both_tiers(make_harness: MakeHarness) -> None:
    h = make_harness(dim=DIM)
    w = h.open()
    h.put(w, range(100))
    h.flush(w)
    h.index_text()
    h.put(w, range(100, 200))
    # text_of: words step by 3 through WORDS, so "delta golf" is a phrase only where the
    # row has at least two words starting at delta (offset % 8 == 3, offset % 4 >= 1).
    got = h.reader.search_text("delta golf", k=200, phrase=True, columns=["_offset", "text"])
    offsets = got.column("_offset").to_pylist()
    assert offsets
    assert all("delta golf" in t for t in got.column("text").to_pylist())
    assert {o for o in offsets if o < 100}
    assert {o for o in offsets if o >= 100}
    loose = h.reader.search_text("delta golf", k=200, columns=["_offset"]).num_rows
    assert loose > len(offsets)


def test_lance_dot_distance_is_one_minus_inner_product(tmp_path: object) -> None:
    """The definition the memtable tier copies (checked, not assumed)."""
    data = vectors(np.arange(50), 8)
    table = pa.table({"vec": pa.FixedSizeListArray.from_arrays(pa.array(data.reshape(-1)), 8)})
    ds = lance.write_dataset(table, f"{tmp_path}/dot.lance")
    q = data[0]
    got = ds.to_table(nearest={"column": "vec", "q": q, "k": 3, "metric": "dot"})
    best = got.column("_distance").to_numpy()
    assert best[0] == pytest.approx(1 - float(np.max(data @ q)), rel=1e-5)


def test_reader_caches_are_counted_in_memtable_memory(make_harness: MakeHarness) -> None:
    """I7: the norms (cosine) and token arrays (BM25) a query builds for a memtable count
    in that memtable's resident bytes, and so against the backpressure budget."""
    h = make_harness(dim=DIM, metric="cosine")
    writer = h.open()
    h.put(writer, range(500))
    active = writer.view().memtables[0].memtable
    before = active.memory_size
    h.reader.search_vector(vectors(np.array([7]), DIM)[0], k=5)
    after_vector = active.memory_size
    assert after_vector - before >= 500 * 4  # one float32 norm per row
    h.reader.search_text("alpha", k=5)
    assert active.memory_size - after_vector >= 500 * 4 * 3  # token, doc, position arrays
    assert writer.stats().index_bytes >= active.cache_bytes


def test_new_memtable_batches_are_tokenised_off_the_query_path(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a first text query, batches put later are tokenised by the reader's background
    tokenizer, so the next text query tokenises nothing (under ingestion, tokenising the
    new rows dominated every text query); close() stops the tokenizer."""
    h = make_harness(dim=DIM)
    writer = h.open()
    h.put(writer, range(100))
    assert h.reader.search_text("alpha", k=5).num_rows
    for first in range(100, 1100, 250):
        h.put(writer, range(first, first + 250))
    view = writer.view().memtables[0]
    deadline = time.monotonic() + 10
    while h.reader.terms.terms_ready(view.memtable, "text") < len(view.batches):
        assert time.monotonic() < deadline, "the background tokenizer did not catch up"
        time.sleep(0.01)

    def no_tokenising(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a text query tokenised a batch")

    monkeypatch.setattr(fts, "batch_terms", no_tokenising)
    got = h.reader.search_text("row1049", k=5, columns=["_offset"])
    assert got.column("_offset").to_pylist() == [1049]
    h.reader.close()
    thread = h.reader.text.tokenizer.thread
    assert thread is not None
    assert not thread.is_alive()


@pytest.mark.parametrize("sample", [1000, 7])
def test_base_statistics_count_each_document_as_tokenised_alone(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, sample: int
) -> None:
    """The base's text statistics (documents with a token, their average length, documents
    per term in the sample) are those of each document tokenised alone: empty and stop-word
    texts are no document, a word twice in a document counts once; past the sample, the
    documents are scaled to the base's non-null texts."""
    monkeypatch.setattr(text_module, "AVGDL_SAMPLE_ROWS", sample)
    texts = [
        "The cats, the CATS and running dogs",
        "",
        None,
        "of the and",
        "row2100 jumped over row12 row12",
        "Élan naïve café cats",
        "dogs",
        "a b c d e f g h",
        "cats cats cats",
        None,
        "running",
    ]
    base = lance.write_dataset(pa.table({"text": pa.array(texts, pa.string())}), tmp_path / "t")
    h = make_harness(dim=DIM)
    n, avgdl, sample_n, sample_df = h.reader.text.base_text_stats(base, "text")
    seen = [t for t in texts if t is not None][:sample]
    alone = [[w for w, _ in fts.tokenize(t)] for t in seen]
    documents = [words for words in alone if words]
    expected_df: dict[str, int] = {}
    for words in documents:
        for w in set(words):
            expected_df[w] = expected_df.get(w, 0) + 1
    assert sample_n == len(documents)
    assert sample_df == expected_df
    assert avgdl == pytest.approx(sum(map(len, documents)) / len(documents))
    non_null = sum(t is not None for t in texts)
    assert n == (
        len(documents) if sample >= non_null else round(non_null * len(documents) / len(seen))
    )


def test_a_rare_terms_first_count_is_estimated_while_it_is_slow(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A query waits `DF_WAIT_S` at most for a rare term's first count; past it, it scores
    with the sample's estimate, and the exact count serves the queries after."""
    monkeypatch.setattr(text_module, "AVGDL_SAMPLE_ROWS", 40)  # "golf" is rare in 40 docs
    monkeypatch.setattr(text_module, "DF_WAIT_S", 0.05)
    h = make_harness(dim=DIM)
    w = h.open()
    h.put(w, range(1200))
    h.flush(w)
    h.index_text()
    base = h.reader.snapshot().base
    n, _, sample_n, sample_df = h.reader.text.base_text_stats(base, "text")
    hits = sample_df.get("golf", 0)
    assert hits < text_module.DF_SAMPLE_MIN_HITS
    everything = base.scanner(full_text_query=MatchQuery("golf", "text")).count_rows()
    estimate = round(max(hits, 0.5) / sample_n * n)
    assert estimate != everything
    # The stats thread is busy with a slow statistic: the count waits in line behind it.
    gate = threading.Event()
    h.reader.ctx.stats.in_background(("busy",), lambda: gate.wait(30), int(base.version), n)
    started = time.monotonic()
    assert h.reader.text.base_df(base, "text", "golf") == estimate
    assert time.monotonic() - started < 5
    found = h.reader.search_text("golf", k=5, columns=["_offset"])  # scored with it
    assert found.num_rows == 5
    gate.set()
    deadline = time.monotonic() + 30
    while h.reader.text.base_df(base, "text", "golf") != everything:
        assert time.monotonic() < deadline, "the exact count never landed"
        time.sleep(0.01)


def test_rare_term_df_counts_the_indexed_fragments_while_the_text_index_lags(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lance's full count scans unindexed rows flat; while the INVERTED index covers most of
    the base the reader counts on the indexed fragments and scales to the whole base."""
    monkeypatch.setattr(text_module, "AVGDL_SAMPLE_ROWS", 40)  # "golf" is rare in 40 docs
    h = make_harness(dim=DIM)
    w = h.open()
    h.put(w, range(1200))
    h.flush(w)
    h.index_text()
    h.put(w, range(1200, 1600))
    h.flush(w)
    base = h.reader.snapshot().base
    assert h.reader.text.text_index_coverage(base, "text") == 0.75
    query = MatchQuery("golf", "text")
    indexed = base.scanner(full_text_query=query, fast_search=True).count_rows()
    everything = base.scanner(full_text_query=query).count_rows()
    assert 0 < indexed < everything
    df = h.reader.text.base_df(base, "text", "golf")
    assert df == round(indexed / 0.75)
    assert abs(df - everything) <= 0.1 * everything
    # Once the index covers every row, the count is exact again.
    h.table.dataset().optimize.optimize_indices()
    base = h.reader.snapshot().base
    assert h.reader.text.text_index_coverage(base, "text") == 1.0
    h.reader.ctx.stats.clear()  # the estimate would be reused for a while (STATS_MAX_AGE_S)
    assert h.reader.text.base_df(base, "text", "golf") == everything


def test_queries_after_close_search_the_base_inline_with_the_same_results(
    make_harness: MakeHarness,
) -> None:
    """The base is searched on a worker thread while the memtables are searched; once the
    reader is closed the base is searched inline, with the same results."""
    h = make_harness(dim=DIM)
    spread(h)
    q = vectors(np.array([1500]), DIM)[0] + 0.01
    before = [
        h.reader.search_vector(q, k=10, columns=["_offset"]),
        h.reader.search_vector(q, k=10, filter="n < 2400", columns=["_offset"]),
        h.reader.search_text("alpha row2100 row12", k=10, columns=["_offset"]),
    ]
    assert before[0].column("_offset")[0].as_py() == 1500
    h.reader.close()
    after = [
        h.reader.search_vector(q, k=10, columns=["_offset"]),
        h.reader.search_vector(q, k=10, filter="n < 2400", columns=["_offset"]),
        h.reader.search_text("alpha row2100 row12", k=10, columns=["_offset"]),
    ]
    for a, b in zip(before, after, strict=True):
        assert a.column("_offset").to_pylist() == b.column("_offset").to_pylist()


def test_a_batch_is_tokenised_as_its_documents_are_one_by_one() -> None:
    """The memtable tokenizer splits one joined tokenizer call back into documents: the same
    terms and positions as tokenising each document alone (None, empty and stop-word-only
    documents included), and the separator never becomes a term of any document."""
    texts: list[str | None] = [
        "The quick brown foxes were running",
        None,
        "",
        "the and of",
        "Élan naïve CAFÉ café",
        "dogs dogs dogs",
    ]
    vocab: dict[str, int] = {}
    batch = fts.batch_terms(texts, vocab)
    words = {i: w for w, i in vocab.items()}
    for row, text in enumerate(texts):
        mine = batch.doc == row
        alone = fts.tokenize(text or "")
        assert [words[int(t)] for t in batch.term[mine]] == [t for t, _ in alone]
        assert batch.pos[mine].tolist() == [p for _, p in alone]
        assert batch.doc_len[row] == len(alone)
    assert batch.valid.tolist() == [t is not None for t in texts]
    assert fts.separator_token() not in {words[int(t)] for t in batch.term}


def test_a_selective_filter_on_an_indexed_base_still_finds_k_rows(
    make_harness: MakeHarness,
) -> None:
    """IVF probes `nprobes` partitions; the rows a selective filter matches are mostly in
    others. Probing stops at nprobes no more: it goes on until k matching rows are found
    (it returned 2 of 10 on a 300k-row base, here about one)."""
    h = make_harness(dim=DIM)
    w = h.open()
    for first in range(0, 4000, 1000):
        h.put(w, range(first, first + 1000))
    h.flush(w)
    h.table.dataset().create_index("vec", "IVF_PQ", num_partitions=32, num_sub_vectors=4)
    matching = list(range(7, 4000, 200))  # 20 rows spread over the partitions
    q = vectors(np.array([5000]), DIM)[0]
    where = f"_offset IN ({', '.join(map(str, matching))})"
    got = h.reader.search_vector(q, k=10, filter=where, columns=["_offset"], nprobes=1)
    offsets = got.column("_offset").to_pylist()
    assert len(offsets) == 10
    assert set(offsets) <= set(matching)
    few = h.reader.search_vector(q, k=10, filter="_offset IN (3, 2100, 3900)", nprobes=1)
    assert sorted(few.column("_offset").to_pylist()) == [3, 2100, 3900]


@pytest.mark.parametrize("indexed", [False, True], ids=["exact-base", "ivf-pq-base"])
def test_cosine_ignores_the_query_vectors_length(make_harness: MakeHarness, indexed: bool) -> None:
    """A row's own vector, scaled by anything, finds that row first at distance ~0, in
    every tier. Scaled by 1e-25 or 1e30 it used to come back with distances such as
    -77,200 or all 1.0, in arbitrary order."""
    h = make_harness(metric="cosine", dim=DIM)
    spread(h)
    if indexed:
        h.table.dataset().create_index(
            "vec", "IVF_PQ", metric="cosine", num_partitions=4, num_sub_vectors=4
        )
    for offset in (10, 2100, 2700):  # base, frozen, active
        own = vectors(np.array([offset]), DIM)[0]
        for scale in (1e-30, 1e-25, 1.0, 1e30):
            got = h.reader.search_vector(
                own * np.float32(scale), k=3, columns=["_offset"], refine_factor=10
            )
            assert got.column("_offset")[0].as_py() == offset, (offset, scale)
            dist = got.column("_distance").to_numpy()
            assert abs(dist[0]) < 1e-5, (offset, scale, dist)
            assert np.all(np.diff(dist) >= -1e-5)
    with pytest.raises(QueryError, match="all zeros"):
        h.reader.search_vector(np.zeros(DIM, np.float32), k=3)


def test_a_query_vector_whose_distances_overflow_is_refused(make_harness: MakeHarness) -> None:
    h = make_harness(metric="l2", dim=DIM)
    h.put(h.open(), range(10))
    with pytest.raises(QueryError, match="overflows float32"):
        h.reader.search_vector(np.full(DIM, 1e30, np.float32), k=3)
    assert h.reader.search_vector(np.full(DIM, 1e15, np.float32), k=3).num_rows == 3
