"""`engine.prune`: int8 codes narrow a cached fragment's search, and the answer stays the
exact top k. The bound every pruned search rests on is checked row by row against distances
computed in float64, on random rows (distances crowd together), clustered rows, zero rows
and duplicates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import faiss
import numpy as np
import pyarrow as pa
import pytest

from engine import prune as prune_module
from engine.prune import CODE_MAX, build_pruner
from engine.reads import vector as vector_module
from engine.reads.vector import PRUNE_FETCH, fragment_knn
from engine.unindexed import CachedFragment

DIM = 32
ROWS = 6000
METRICS = ["l2", "cosine", "dot"]


def oracle(matrix: np.ndarray, query: np.ndarray, metric: str) -> np.ndarray:
    """Every row's distance in Lance's terms, in float64 (a zero row's cosine is 0)."""
    x = matrix.astype(np.float64)
    q = query.astype(np.float64)
    if metric == "l2":
        return ((x - q) ** 2).sum(axis=1)
    if metric == "dot":
        return 1.0 - x @ q
    norms = np.linalg.norm(x, axis=1)
    return 1.0 - np.divide(x @ q, norms * np.linalg.norm(q), out=np.zeros(len(x)), where=norms > 0)


def rows_of(kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "random":
        return rng.standard_normal((ROWS, DIM), dtype=np.float32)
    if kind == "clustered":
        centres = rng.standard_normal((60, DIM), dtype=np.float32) * 3
        noise = rng.standard_normal((ROWS, DIM), dtype=np.float32) * 0.05
        return (centres[rng.integers(0, 60, ROWS)] + noise).astype(np.float32)
    assert kind == "zeros"  # a tenth of the rows are zero vectors, norms vary
    x = rng.standard_normal((ROWS, DIM), dtype=np.float32) * rng.random((ROWS, 1), np.float32)
    x[::10] = 0
    return x


def fragment(matrix: np.ndarray, metric: str, pruned: bool = True) -> CachedFragment:
    norms = (
        np.sqrt(np.einsum("ij,ij->i", matrix, matrix)).astype(np.float32)
        if metric == "cosine"
        else np.empty(0, np.float32)
    )
    return CachedFragment(
        (0, None),
        pa.table({"id": np.arange(len(matrix))}),
        matrix,
        norms,
        pa.field("vec", pa.list_(pa.float32(), matrix.shape[1])),
        build_pruner(matrix, metric, min_rows=1) if pruned else None,
    )


@pytest.mark.parametrize("metric", ["l2", "dot"])
def test_int8_kernels_compute_integer_distances_exactly(metric: str) -> None:
    """The bound assumes faiss's int8 distances between integer vectors are exact."""
    rng = np.random.default_rng(1)
    codes = rng.integers(-127, 128, (3000, 256)).astype(np.float32)
    query = rng.integers(-127, 128, (1, 256)).astype(np.float32)
    index = faiss.IndexScalarQuantizer(
        256,
        faiss.ScalarQuantizer.QT_8bit_direct_signed,
        faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT,
    )
    index.add(codes)
    np.testing.assert_array_equal(index.reconstruct_n(0, 3000), codes)
    found, rows = index.search(query, 3000)
    c = codes.astype(np.int64)
    q = query[0].astype(np.int64)
    want = ((c - q) ** 2).sum(axis=1) if metric == "l2" else c @ q
    np.testing.assert_array_equal(found[0], want[rows[0]].astype(np.float32))


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("kind", ["random", "clustered", "zeros"])
@pytest.mark.parametrize("filtered", [False, True])
def test_floor_bounds_every_row_left_out(metric: str, kind: str, filtered: bool) -> None:
    rng = np.random.default_rng(7)
    matrix = rows_of(kind, rng)
    pruner = build_pruner(matrix, metric, min_rows=1)
    assert pruner is not None
    assert pruner.num_rows == ROWS
    assert pruner.nbytes == ROWS * DIM
    queries = np.vstack([rng.standard_normal((6, DIM)), matrix[rng.integers(0, ROWS, 6)] + 0.01])
    for q in queries.astype(np.float32):
        eligible = rng.random(ROWS) < 0.3 if filtered else None
        for fetch in (16, 64, 300):
            rows, floor = pruner.search(q, fetch, eligible)
            assert len(rows) == fetch
            assert len(set(rows.tolist())) == fetch
            left = np.ones(ROWS, bool) if eligible is None else eligible.copy()
            if eligible is not None:
                assert eligible[rows].all()
            left[rows] = False
            assert oracle(matrix, q, metric)[left].min() >= floor


@pytest.mark.parametrize("metric", METRICS)
def test_every_eligible_row_fetched_means_no_floor(metric: str) -> None:
    rng = np.random.default_rng(3)
    matrix = rows_of("random", rng)
    pruner = build_pruner(matrix, metric, min_rows=1)
    assert pruner is not None
    eligible = np.zeros(ROWS, bool)
    eligible[rng.choice(ROWS, 40, replace=False)] = True
    rows, floor = pruner.search(matrix[0], 64, eligible)
    assert sorted(rows.tolist()) == np.flatnonzero(eligible).tolist()
    assert floor == np.inf


class ScanSpy:
    """Records the number of rows of every exact scan the reader makes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        exact = vector_module.exact_knn

        def spy(matrix: np.ndarray, *args: Any) -> tuple[np.ndarray, np.ndarray]:
            self.sizes.append(int(matrix.shape[0]))
            return exact(matrix, *args)

        monkeypatch.setattr(vector_module, "exact_knn", spy)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("kind", ["random", "clustered", "zeros"])
def test_pruned_search_returns_the_exact_top_k(
    metric: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(11)
    matrix = rows_of(kind, rng)
    cached = fragment(matrix, metric)
    spy = ScanSpy(monkeypatch)
    queries = np.vstack([rng.standard_normal((5, DIM)), matrix[rng.integers(0, ROWS, 5)] + 0.01])
    for i, q in enumerate(queries.astype(np.float32)):
        eligible = rng.random(ROWS) < 0.5 if i % 2 else None
        rows, dist = fragment_knn(cached, q, 10, eligible, metric)
        truth = oracle(matrix, q, metric)
        if eligible is not None:
            assert eligible[rows].all()
            truth = np.where(eligible, truth, np.inf)
        want = np.sort(truth)[:10]
        np.testing.assert_allclose(dist, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(truth[rows], want, rtol=1e-4, atol=1e-4)
    assert spy.sizes
    if kind != "zeros":
        # Only candidates were scanned exactly, never the whole fragment. (The 600 zero
        # rows tie with each other in l2 and dot, which no candidate count settles; in
        # cosine their codes sit nearer every query than they are, which loosens the bound.
        # Either way the answer is exact, from a full scan.)
        assert max(spy.sizes) < ROWS / 4


def test_duplicates_that_defeat_the_bound_get_the_exact_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thousands of rows at one distance: no candidate count proves a top 10, so the search
    asks for more, then scans every row exactly."""
    rng = np.random.default_rng(5)
    matrix = rows_of("random", rng)
    matrix[: ROWS // 2] = matrix[0]
    cached = fragment(matrix, "l2")
    spy = ScanSpy(monkeypatch)
    rows, dist = fragment_knn(cached, matrix[0] + 0.5, 10, None, "l2")
    want = np.sort(oracle(matrix, matrix[0] + 0.5, "l2"))[:10]
    np.testing.assert_allclose(dist, want, rtol=1e-4)
    assert (rows < ROWS // 2).all()
    assert spy.sizes[0] == PRUNE_FETCH
    assert spy.sizes[-1] == ROWS


def test_no_pruner_for_small_non_finite_or_zero_matrices() -> None:
    rng = np.random.default_rng(2)
    matrix = rng.standard_normal((100, DIM), dtype=np.float32)
    assert build_pruner(matrix, "l2") is None  # below PRUNE_MIN_ROWS
    assert build_pruner(np.zeros((100, DIM), np.float32), "l2", min_rows=1) is None
    matrix[7, 3] = np.nan
    assert build_pruner(matrix, "l2", min_rows=1) is None
    matrix[7, 3] = np.inf
    assert build_pruner(matrix, "dot", min_rows=1) is None


def test_codes_use_the_whole_int8_range() -> None:
    matrix = np.random.default_rng(4).standard_normal((500, DIM), dtype=np.float32)
    pruner = build_pruner(matrix, "l2", min_rows=1)
    assert pruner is not None
    codes = pruner.index.reconstruct_n(0, 500)
    assert np.abs(codes).max() == CODE_MAX
    assert np.array_equal(codes, np.rint(codes))
    moved = np.linalg.norm(matrix - codes / pruner.scale, axis=1)
    assert moved.max() <= pruner.slack


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("share", [0.02, 0.2, 0.3, 0.8, 0.999])
@pytest.mark.parametrize("kind", ["random", "clustered", "zeros"])
def test_the_exact_scan_of_the_eligible_rows_is_the_oracles_top_k(
    metric: str, share: float, kind: str
) -> None:
    """The unpruned scan, at every share of eligible rows (a few are copied and scored, most
    are scored in place with the others' scores dropped): the top k of the eligible rows by
    the float64 oracle (a zero row is no cosine neighbour)."""
    rng = np.random.default_rng(int(share * 1000) + len(kind))
    matrix = rows_of(kind, rng)
    norms = np.sqrt(np.einsum("ij,ij->i", matrix, matrix)).astype(np.float32)
    eligible = rng.random(ROWS) < share
    for query in rng.standard_normal((5, DIM), dtype=np.float32):
        rows, dist = vector_module.exact_knn(matrix, lambda: norms, query, 10, eligible, metric)
        truth = oracle(matrix, query, metric)
        candidates = eligible & ((norms > 0) if metric == "cosine" else True)
        want = np.flatnonzero(candidates)[np.argsort(truth[candidates], kind="stable")][:10]
        assert eligible[rows].all()
        np.testing.assert_allclose(dist, truth[want], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.sort(truth[rows]), truth[want], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("metric", METRICS)
def test_a_row_too_long_for_float32_gets_no_pruner(metric: str) -> None:
    """A finite row whose squared norm overflows float32: its unit row cannot be made in
    float32 (before, cosine took it for a zero row, code 0, and the bound did not hold for
    it); the fragment is scanned exactly instead."""
    matrix = np.random.default_rng(6).standard_normal((500, DIM), dtype=np.float32)
    matrix[5] *= np.float32(1e20)
    assert np.isfinite(matrix).all()
    assert build_pruner(matrix, metric, min_rows=1) is None


@pytest.mark.parametrize("kind", ["random", "zeros"])
def test_cosine_codes_from_given_norms_are_those_from_computed_ones(kind: str) -> None:
    """The reader hands a fragment's row norms over (it keeps them for the exact scan); the
    pruner is the same as when it computes them, and its codes use the whole int8 range."""
    matrix = rows_of(kind, np.random.default_rng(8))
    norms = np.sqrt(np.einsum("ij,ij->i", matrix, matrix)).astype(np.float32)
    given = build_pruner(matrix, "cosine", min_rows=1, norms=norms)
    computed = build_pruner(matrix, "cosine", min_rows=1)
    assert given is not None
    assert computed is not None
    codes = given.index.reconstruct_n(0, ROWS)
    np.testing.assert_array_equal(codes, computed.index.reconstruct_n(0, ROWS))
    assert (given.scale, given.slack, given.max_norm) == (
        computed.scale,
        computed.slack,
        computed.max_norm,
    )
    assert np.abs(codes).max() == CODE_MAX
    assert given.max_norm == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("metric", METRICS)
def test_a_build_stops_between_chunks_when_asked(
    metric: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`stop` is asked before every chunk of both passes; once it says so, no pruner."""
    monkeypatch.setattr(prune_module, "BUILD_CHUNK_ROWS", 1000)
    matrix = rows_of("random", np.random.default_rng(9))  # 6 chunks a pass
    asked: list[int] = []

    def stop_at(n: int) -> Callable[[], bool]:
        """A `stop` that says so from its (n + 1)th question on."""
        asked.clear()

        def stop() -> bool:
            asked.append(1)
            return len(asked) > n

        return stop

    assert build_pruner(matrix, metric, 1, None, stop_at(8)) is None
    assert len(asked) == 9  # the first pass's six chunks, then two of the second
    built = build_pruner(matrix, metric, 1, None, stop_at(12))
    assert built is not None
    assert len(asked) == 12
    unstopped = build_pruner(matrix, metric, 1)
    assert unstopped is not None
    np.testing.assert_array_equal(
        built.index.reconstruct_n(0, ROWS), unstopped.index.reconstruct_n(0, ROWS)
    )
