"""Truthful accounting (I7): a memtable's `memory_size` matches what it really keeps resident
(Arrow buffers + Python objects of its indexes) within 20%, measured with the Arrow memory
pool and tracemalloc."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pytest

from engine.memtable import Memtable, own_copy
from tests.support.engine import make_batch, make_spec, source


def fill(memtable: Memtable, rows: int, batch_rows: int) -> None:
    for i in range(rows // batch_rows):
        first = i * batch_rows
        # Keys repeat every 3000 offsets for upserts: the index holds the distinct keys.
        batch = make_batch(memtable.spec, first, batch_rows, key_of=lambda o: f"key-{o % 3000:06d}")
        memtable.insert([own_copy(batch)], i + 1, [source(first, batch_rows)])
        del batch


def measure(mode: str, tmp_path: Path, rows: int, batch_rows: int) -> tuple[int, int]:
    spec = make_spec(tmp_path / "t.lance", mode, dim=32)
    fill(Memtable(spec, 0), batch_rows * 2, batch_rows)  # warm up: imports, caches
    gc.collect()
    tracemalloc.start()
    arrow_before = pa.total_allocated_bytes()
    py_before, _ = tracemalloc.get_traced_memory()
    memtable = Memtable(spec, 1)
    fill(memtable, rows, batch_rows)
    gc.collect()
    resident = (pa.total_allocated_bytes() - arrow_before) + (
        tracemalloc.get_traced_memory()[0] - py_before
    )
    tracemalloc.stop()
    accounted = memtable.memory_size
    del memtable
    return accounted, resident


@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_memory_size_matches_resident_bytes(mode: str, tmp_path: Path) -> None:
    accounted, resident = measure(mode, tmp_path, rows=20_000, batch_rows=500)
    assert resident > 0
    assert abs(accounted - resident) / resident <= 0.20, (accounted, resident)


def test_own_copy_drops_the_parent_buffer(tmp_path: Path) -> None:
    spec = make_spec(tmp_path / "t.lance")
    parent = make_batch(spec, 0, 10_000)
    piece = parent.slice(100, 10)
    assert piece.get_total_buffer_size() > 100 * piece.nbytes  # a slice pins the parent
    owned = own_copy(piece)
    assert owned.get_total_buffer_size() <= piece.nbytes * 1.05 + 4096
    assert owned.to_pylist() == piece.to_pylist()
    whole = make_batch(spec, 0, 100)
    assert own_copy(whole) is whole  # compact batches are not copied


def test_a_copy_without_the_vectors_keeps_only_the_other_columns(tmp_path: Path) -> None:
    """`Memtable.without_column` holds the other columns' rows in order as one batch and,
    once the memtable is gone, keeps resident what it accounts: not the vectors."""
    spec = make_spec(tmp_path / "t.lance", dim=256)
    assert spec.vector is not None
    gc.collect()
    before = pa.total_allocated_bytes()
    memtable = Memtable(spec, 1)
    fill(memtable, 4000, 500)
    copy = memtable.without_column(spec.vector.name)
    assert copy.rows == memtable.rows
    assert copy.frozen
    (kept,) = copy.batches
    rows = pa.Table.from_batches(memtable.batches).drop_columns([spec.vector.name])
    assert kept.to_pylist() == rows.to_pylist()
    assert copy.data_bytes < memtable.data_bytes - 4000 * 256 * 4 * 0.95
    assert spec.vector.name in memtable.without_column(None).batches[0].schema.names
    del memtable, rows
    gc.collect()
    resident = pa.total_allocated_bytes() - before
    assert abs(copy.memory_size - resident) / resident <= 0.20, (copy.memory_size, resident)
    upsert = Memtable(make_spec(tmp_path / "u.lance", "upsert"), 1)
    with pytest.raises(ValueError, match="upsert"):
        upsert.without_column("vec")
