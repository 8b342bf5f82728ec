"""A memtable's batches are searched as runs of one contiguous matrix (`Memtable.vector_runs`).

Each exact search call gives the interpreter lock up and waits to get it back behind
ingestion; a memtable of many small batches cost a query one call per batch (a writer's
fan-out answer took 100-530 ms over ~60-90 batches during a catch-up). The batches are
joined into runs, the vectors copied once and shared, so a query makes one call per run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from engine import memtable as memtable_module
from engine.memtable import RUN_MIN_BATCHES, Memtable
from engine.reads import vector as vector_module
from engine.schema import OP_DELETE, OP_UPSERT
from engine.wal import SourceRange
from tests.reads.conftest import ReadHarness, read_spec, rows_batch, vectors

MakeHarness = Callable[..., ReadHarness]
DIM = 16
BATCHES = 40
ROWS = 25


def _count_searches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = vector_module.faiss_knn

    def counting(q: np.ndarray, matrix: np.ndarray, k: int, metric: str) -> Any:
        calls.append(matrix.shape[0])
        return real(q, matrix, k, metric)

    monkeypatch.setattr(vector_module, "faiss_knn", counting)
    return calls


def _truth(metric: str, q: np.ndarray, offsets: np.ndarray, k: int) -> tuple[list[int], np.ndarray]:
    data = vectors(offsets, DIM)
    if metric == "l2":
        dist = ((data - q) ** 2).sum(1)
    elif metric == "dot":
        dist = 1 - data @ q
    else:
        dist = 1 - (data @ q) / (np.linalg.norm(data, axis=1) * np.linalg.norm(q))
    order = np.argsort(dist, kind="stable")[:k]
    return offsets[order].tolist(), dist[order]


@pytest.mark.parametrize("metric", ["l2", "cosine", "dot"])
@pytest.mark.parametrize("where", [None, "n >= 300"])
def test_a_memtables_batches_are_searched_as_one_matrix(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch, metric: str, where: str | None
) -> None:
    """40 puts (40 batches of one memtable): a query makes one or two exact search calls,
    not one per batch, and finds the exact top k (the rows and distances of a brute force)."""
    h = make_harness(metric=metric, dim=DIM)
    w = h.open()
    for b in range(BATCHES):
        h.put(w, range(b * ROWS, (b + 1) * ROWS))
    calls = _count_searches(monkeypatch)
    q = np.random.default_rng(5).standard_normal(DIM).astype(np.float32)
    got = h.reader.search_vector(q, k=10, filter=where, columns=["_offset"])
    offsets = np.arange(BATCHES * ROWS)
    if where is not None:  # n is null where offset % 7 == 3
        offsets = offsets[(offsets >= 300) & (offsets % 7 != 3)]
    want, want_dist = _truth(metric, q, offsets, 10)
    assert got.column("_offset").to_pylist() == want
    np.testing.assert_allclose(got.column("_distance").to_numpy(), want_dist, rtol=1e-4, atol=1e-4)
    if metric != "cosine":  # cosine ranks by numpy, not faiss
        assert len(calls) <= 2, calls
    # A second query finds the run made; new puts join the next run once there are enough.
    for b in range(BATCHES, BATCHES + RUN_MIN_BATCHES):
        h.put(w, range(b * ROWS, (b + 1) * ROWS))
    runs = w.view().memtables[0].memtable.vector_runs(BATCHES + RUN_MIN_BATCHES)
    assert [(r.start, r.end) for r in runs] == [(0, BATCHES), (BATCHES, BATCHES + RUN_MIN_BATCHES)]


def test_joined_batches_share_the_runs_vectors_and_flush_the_same_rows(tmp_path: Path) -> None:
    """After joining, each batch's vector column is a slice of the run's matrix (its own
    buffer let go: resident bytes as counted), the memtable's size is unchanged, and what
    a flush writes is row for row what was put."""
    spec = read_spec(str(tmp_path / "t.lance"), dim=DIM)
    m = Memtable(spec, 1)
    puts = [rows_batch(spec, range(b * ROWS, (b + 1) * ROWS)) for b in range(RUN_MIN_BATCHES + 3)]
    for i, batch in enumerate(puts):
        m.insert([batch], i + 1, [SourceRange("t", 0, i * ROWS, (i + 1) * ROWS)])
    size = m.memory_size
    (run,) = m.vector_runs(len(puts))
    assert (run.start, run.end) == (0, len(puts))
    lo, hi = run.matrix.ctypes.data, run.matrix.ctypes.data + run.matrix.nbytes
    for batch in m.batches:
        address = batch.column("vec").values.buffers()[1].address
        assert lo <= address < hi
    assert m.memory_size == size
    written, _ = m.flush_data()
    assert pa.Table.from_batches(written).equals(
        pa.Table.from_batches([spec.to_table_batch(b) for b in puts])
    )


def test_a_batch_with_deletes_keeps_its_vectors_and_its_copy_is_counted(tmp_path: Path) -> None:
    """An upsert memtable's deletes carry null vectors: that batch keeps its own column (the
    validity of a joined slice would be lost), its rows are copied into the run and counted
    as reader cache; the batches without nulls are joined as in an append memtable."""
    spec = read_spec(str(tmp_path / "t.lance"), mode="upsert", dim=DIM)
    m = Memtable(spec, 1)
    batches = []
    for b in range(RUN_MIN_BATCHES):
        batch = rows_batch(spec, range(b * ROWS, (b + 1) * ROWS))
        if b == 3:  # deletes of keys put before: null vectors
            ops = [OP_DELETE if o % 2 else OP_UPSERT for o in range(b * ROWS, (b + 1) * ROWS)]
            vec = batch.column("vec")
            mask = pa.array([op == OP_DELETE for op in ops])
            nulled = pa.FixedSizeListArray.from_arrays(vec.values, type=vec.type, mask=mask)
            batch = batch.set_column(batch.schema.get_field_index("vec"), "vec", nulled)
            batch = batch.set_column(
                batch.schema.get_field_index("_op"), "_op", pa.array(ops, pa.int8())
            )
        batches.append(batch)
        m.insert([batch], b + 1, [SourceRange("t", 0, b * ROWS, (b + 1) * ROWS)])
    cache = m.cache_bytes
    assert len(m.vector_runs(len(batches))) == 1
    assert m.cache_bytes - cache == ROWS * DIM * 4
    assert m.batches[3].column("vec").null_count == batches[3].column("vec").null_count > 0
    assert m.batches[3].column("vec").equals(batches[3].column("vec"))
    assert m.batches[2].column("vec").equals(batches[2].column("vec"))
    assert m.batches[2].column("vec").values.buffers()[1].address != (
        batches[2].column("vec").values.buffers()[1].address
    )


def test_runs_are_not_made_below_the_minimum(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Fewer new batches than `RUN_MIN_BATCHES` since the last run: searched batch by batch."""
    monkeypatch.setattr(memtable_module, "RUN_MIN_BATCHES", 4)
    spec = read_spec(str(tmp_path / "t.lance"), dim=DIM)
    m = Memtable(spec, 1)
    for b in range(3):
        m.insert([rows_batch(spec, range(b * ROWS, (b + 1) * ROWS))], b + 1, [])
    assert m.vector_runs(3) == []
    m.insert([rows_batch(spec, range(75, 100))], 4, [])
    assert [(r.start, r.end) for r in m.vector_runs(4)] == [(0, 4)]
    assert [(r.start, r.end) for r in m.vector_runs(3)] == []


def test_an_upsert_memtables_runs_skip_superseded_and_deleted_rows(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upserts of keys put earlier in the same memtable, and deletes, over more batches
    than `RUN_MIN_BATCHES`: one run, and only each key's newest live row is found."""
    h = make_harness(mode="upsert", dim=DIM)
    w = h.open()
    for b in range(6):  # keys k0..k149, version 0
        h.put(w, range(b * ROWS, (b + 1) * ROWS))
    for b in range(6, 10):  # offsets 150..249 upsert keys k0..k99 again, version 1
        h.put(w, range(b * ROWS, (b + 1) * ROWS), key_of=lambda o: f"k{o - 150}", version=1)
    h.put(w, range(250, 275), key_of=lambda o: f"k{o - 150}", deletes=set(range(250, 275)))
    calls = _count_searches(monkeypatch)
    q = np.random.default_rng(9).standard_normal(DIM).astype(np.float32)
    got = h.reader.search_vector(q, k=10, columns=["id", "_offset"])
    assert len(calls) <= 2, calls
    # Live: k0..k99 at version 1 (offsets 150..249), k100..k124 deleted, k125..k149 at version 0.
    live = np.concatenate([np.arange(150, 250), np.arange(125, 150)])
    data = np.concatenate([vectors(np.arange(150, 250), DIM, 1), vectors(np.arange(125, 150), DIM)])
    dist = ((data - q) ** 2).sum(1)
    order = np.argsort(dist, kind="stable")[:10]
    assert got.column("_offset").to_pylist() == live[order].tolist()
    np.testing.assert_allclose(
        got.column("_distance").to_numpy(), dist[order], rtol=1e-4, atol=1e-4
    )
