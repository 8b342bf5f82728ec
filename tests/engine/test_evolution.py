"""`table.evolve`: a column added to the settings of an existing table is added to the Lance
table as a nullable column, and int32/float32 columns widen; WAL entries written before the
change replay with the new column null; anything else is an error naming the column."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import engine.table
from engine.backpressure import BlockingValve
from engine.errors import SchemaMismatch
from engine.flusher import Flusher
from engine.reader import Reader
from engine.schema import OP_COLUMN, OP_UPSERT, TableSpec
from engine.shard import ShardWriter
from engine.storage import open_storage
from engine.table import BaseTable
from tests.support.engine import DIM, make_spec, source, vectors_for, writer_config

BASE = [
    {"name": "id", "type": "string", "nullable": False},
    {"name": "n", "type": "int32"},
    {"name": "score", "type": "float32"},
]
EVOLVED = [
    {"name": "id", "type": "string", "nullable": False},
    {"name": "n", "type": "int64"},  # widened
    {"name": "score", "type": "float64"},  # widened
    {"name": "tag", "type": "string"},  # added
]


def spec(
    tmp_path: Path, columns: list[dict[str, Any]], evolve: bool = False, mode: str = "append"
) -> TableSpec:
    return make_spec(tmp_path / "t.lance", mode, columns=columns, fts_columns=[], evolve=evolve)


def batch(spec: TableSpec, first: int, count: int) -> pa.RecordBatch:
    offsets = np.arange(first, first + count, dtype=np.int64)
    types = {f.name: f.type for f in spec.table_schema}
    cols: dict[str, pa.Array] = {
        "id": pa.array([f"r{o}" for o in offsets]),
        "n": pa.array(offsets).cast(types["n"]),
        "score": pa.array(offsets / 2, pa.float64()).cast(types["score"]),
        "vec": pa.FixedSizeListArray.from_arrays(
            pa.array(vectors_for(offsets).reshape(-1), pa.float32()), DIM
        ),
        "_topic": pa.array(["t"] * count),
        "_partition": pa.array([0] * count, pa.int32()),
        "_offset": pa.array(offsets),
    }
    if "tag" in types:
        cols["tag"] = pa.array([f"tag {o}" for o in offsets])
    cols[OP_COLUMN] = pa.array([OP_UPSERT] * count, pa.int8())
    schema = spec.batch_schema
    return pa.RecordBatch.from_arrays([cols[f.name] for f in schema], schema=schema)


def open_writer(tmp_path: Path, spec: TableSpec, flusher: Flusher) -> ShardWriter:
    table = BaseTable(spec)
    table.open()
    return ShardWriter.open(
        "t-0-test",
        spec,
        table,
        open_storage(str(tmp_path / "wal")),
        writer_config(max_rows=100),
        BlockingValve(1 << 40),
        flusher,
    )


def test_added_and_widened_columns_with_wal_entries_from_before(tmp_path: Path) -> None:
    flusher = Flusher(1)
    try:
        old = spec(tmp_path, BASE)
        writer = open_writer(tmp_path, old, flusher)
        writer.put(batch(old, 0, 100), source(0, 100)).result(30)  # seals and flushes
        writer.put(batch(old, 100, 50), source(100, 50)).result(30)  # only in the WAL
        writer.close(flush=False)

        new = spec(tmp_path, EVOLVED, evolve=True)
        writer = open_writer(tmp_path, new, flusher)  # evolves, then replays 100..149
        assert writer.stats().replayed_rows == 50
        writer.put(batch(new, 150, 40), source(150, 40)).result(30)
        # Queries see the column at once, over base rows and memtable rows alike.
        reader = Reader(new, writer.table, lambda: [writer])
        try:
            hits = reader.scan(filter="tag IS NOT NULL OR n < 2", columns=["n", "tag"])
            got = sorted(
                zip(hits.column("n").to_pylist(), hits.column("tag").to_pylist(), strict=True)
            )
            assert got == [(0, None), (1, None)] + [(o, f"tag {o}") for o in range(150, 190)]
            near = reader.search_vector(vectors_for(np.array([120]))[0], k=1, columns=["n", "tag"])
            assert near.column("n").to_pylist() == [120]
            assert near.column("tag").to_pylist() == [None]  # replayed from before the change
        finally:
            reader.close()
        writer.put(batch(new, 190, 10), source(190, 10)).result(30)
        writer.close(flush=True)
    finally:
        flusher.shutdown()

    table = BaseTable(new).dataset().to_table()
    assert table.schema.field("n").type == pa.int64()
    assert table.schema.field("score").type == pa.float64()
    assert table.schema.field("tag").nullable
    rows = sorted(table.to_pylist(), key=lambda r: r["_offset"])
    assert [r["_offset"] for r in rows] == list(range(200))
    assert [r["n"] for r in rows] == list(range(200))
    assert [r["score"] for r in rows] == [o / 2 for o in range(200)]
    assert [r["tag"] for r in rows] == [None] * 150 + [f"tag {o}" for o in range(150, 200)]


def test_without_evolve_the_error_says_how(tmp_path: Path) -> None:
    BaseTable(spec(tmp_path, BASE)).open()
    added = [*BASE, {"name": "tag", "type": "string"}]
    with pytest.raises(SchemaMismatch, match=r"no column 'tag' \(set table.evolve = true"):
        BaseTable(spec(tmp_path, added)).open()
    with pytest.raises(SchemaMismatch, match=r"'n' is int32 .* \(set table.evolve = true"):
        BaseTable(spec(tmp_path, EVOLVED[:3])).open()


def test_incompatible_changes_name_the_column(tmp_path: Path) -> None:
    BaseTable(spec(tmp_path, BASE)).open()
    narrowed = [BASE[0], {"name": "n", "type": "string"}, BASE[2]]
    with pytest.raises(SchemaMismatch, match=r"column 'n' is int32 in the table, string"):
        BaseTable(spec(tmp_path, narrowed, evolve=True)).open()
    required = [*BASE, {"name": "tag", "type": "string", "nullable": False}]
    with pytest.raises(SchemaMismatch, match=r"'tag' is not in the table and not nullable"):
        BaseTable(spec(tmp_path, required, evolve=True)).open()
    # Nothing was changed by the failed attempts.
    assert BaseTable(spec(tmp_path, BASE)).dataset().schema.names[:3] == ["id", "n", "score"]


@pytest.mark.parametrize(
    ("columns", "rival_at"),
    [
        (EVOLVED, "open"),
        ([*BASE, {"name": "tag", "type": "string"}], "open"),
        (EVOLVED, "widen"),
    ],
    ids=["widened-at-open", "added-at-open", "widened-before-the-cast"],
)
def test_pods_that_evolve_the_table_together_all_open_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, columns: list[dict[str, Any]], rival_at: str
) -> None:
    # Pods restart to evolve together. One that read the table before another pod's
    # evolution committed had its own refused by Lance (a preempted Merge, or an alter's
    # plain "Retryable commit conflict") and did not start: `cannot evolve the table`.
    table = BaseTable(spec(tmp_path, BASE))
    table.open()
    table.dataset().create_scalar_index("n", "BTREE")  # dropped to widen, by either pod
    first, second = (BaseTable(spec(tmp_path, columns, evolve=True)) for _ in range(2))
    rival_ran: list[str] = []

    def rival() -> None:
        if not rival_ran:
            rival_ran.append(rival_at)
            first.open()

    if rival_at == "open":  # between this pod's read of the table and its evolution
        real = engine.table.open_or_create

        def read_then_rival(*args: Any) -> Any:
            ds = real(*args)
            rival()
            return ds

        monkeypatch.setattr(engine.table, "open_or_create", read_then_rival)
    else:  # between this pod's drop of the index (and its read after) and its cast
        drop = second._drop_indexes

        def drop_then_rival(*args: Any) -> Any:
            ds = drop(*args)
            rival()
            return ds

        monkeypatch.setattr(second, "_drop_indexes", drop_then_rival)
    second.open()
    assert rival_ran == [rival_at]
    schema = BaseTable(spec(tmp_path, columns, evolve=True)).dataset().schema
    assert sorted(schema.names) == sorted(second.spec.table_schema.names)  # each column once
    second.spec.check_table(schema)


@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_a_pod_that_has_not_evolved_flushes_into_a_widened_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # Another pod widened `n` and `score` and added `tag` (its messages carried the new
    # writer schema first) while this pod's flush was writing its rows. Lance refuses an
    # append narrower than the table ("Append with different schema"): this pod's flushes
    # failed until it was poisoned, and its partitions stalled until it restarted. And an
    # append begun before the evolution was committed over it, its widened columns null.
    flusher = Flusher(1)
    try:
        old = spec(tmp_path, BASE, mode=mode)
        writer = open_writer(tmp_path, old, flusher)
        writer.put(batch(old, 0, 100), source(0, 100)).result(30)
        assert writer.wait_flushed(30)
        read = writer.table.dataset
        evolved: list[int] = []

        def read_then_evolve(version: int | None = None) -> Any:
            ds = read(version)
            if commits and not evolved:  # between the flush's read of the table and its commit
                BaseTable(spec(tmp_path, EVOLVED, evolve=True, mode=mode)).open()
                evolved.append(BaseTable(spec(tmp_path, EVOLVED)).latest_version())
            return ds

        commit = writer.table._append if mode == "append" else writer.table._merge
        commits: list[int] = []

        def count(*args: Any, **kwargs: Any) -> Any:
            commits.append(1)
            return commit(*args, **kwargs)

        monkeypatch.setattr(writer.table, "_append" if mode == "append" else "_merge", count)
        monkeypatch.setattr(writer.table, "dataset", read_then_evolve)
        writer.put(batch(old, 100, 100), source(100, 100)).result(30)
        assert writer.wait_flushed(30)
        assert evolved
        assert len(commits) == 2  # preempted by the evolution, then made on its schema
        monkeypatch.setattr(writer.table, "dataset", read)
        writer.put(batch(old, 200, 50), source(200, 50)).result(30)  # in memory
        reader = Reader(old, writer.table, lambda: [writer])
        try:  # base rows (widened) and memtable rows (not) answer together
            hits = reader.scan(filter="n >= 98 AND n < 102 OR n >= 248", columns=["n", "score"])
            assert sorted(hits.column("n").to_pylist()) == [98, 99, 100, 101, 248, 249]
            assert hits.schema.field("n").type == pa.int64()  # as the table has it now
        finally:
            reader.close()
        writer.close(flush=True)
        assert writer.stats().poisoned is None
        assert writer.stats().flush_failures_total == 0
    finally:
        flusher.shutdown()
    table = BaseTable(spec(tmp_path, EVOLVED)).dataset().to_table()
    rows = sorted(table.to_pylist(), key=lambda r: r["_offset"])
    assert [r["n"] for r in rows] == list(range(250))
    assert [r["score"] for r in rows] == [o / 2 for o in range(250)]
    assert {r["tag"] for r in rows} == {None}


def test_a_pod_that_has_not_evolved_answers_values_only_the_widened_type_holds(
    tmp_path: Path,
) -> None:
    # Its queries cast every tier's rows to its own (narrower) types: a row another pod
    # wrote after widening `n` failed the query (ArrowInvalid: an HTTP 500), in a writer
    # pod until it restarted to evolve, in a query-only pod until it was restarted.
    flusher = Flusher(1)
    try:
        old = spec(tmp_path, BASE)
        writer = open_writer(tmp_path, old, flusher)
        writer.put(batch(old, 0, 100), source(0, 100)).result(30)
        assert writer.wait_flushed(30)
        writer.put(batch(old, 100, 10), source(100, 10)).result(30)  # in memory
        new = spec(tmp_path, EVOLVED, evolve=True)
        other = BaseTable(new)
        other.open()
        rows = batch(new, 200, 2)
        big = pa.array([2**40, 2**40 + 1], pa.int64())
        rows = rows.set_column(rows.schema.get_field_index("n"), "n", big)
        other.commit_flush([new.to_table_batch(rows)], None, {})
        reader = Reader(old, writer.table, lambda: [writer])
        try:  # the first query's literal fits only the widened type
            assert reader.scan(filter=f"n = {2**40 + 1}", columns=["_offset"]).num_rows == 1
            hits = reader.scan(filter="n > 105", columns=["n", "score"])
            assert sorted(hits.column("n").to_pylist()) == [106, 107, 108, 109, 2**40, 2**40 + 1]
            assert hits.schema.field("n").type == pa.int64()  # as the table has it now
            assert hits.schema.field("score").type == pa.float64()
            near = reader.search_vector(vectors_for(np.array([200]))[0], k=1, columns=["n"])
            assert near.column("n").to_pylist() == [2**40]
            assert reader.scan(filter=f"n = {2**40 + 1}", columns=["_offset"]).num_rows == 1
        finally:
            reader.close()
        writer.close(flush=True)
    finally:
        flusher.shutdown()


def test_a_column_with_an_index_is_widened(tmp_path: Path) -> None:
    # Maintenance builds the scalar indexes the settings name (`n`: BTREE by default in the
    # chart's examples); Lance refuses to cast an indexed column, so a pod restarting to
    # widen it could not start ("cannot evolve the table: ... 1 index(es) attached").
    flusher = Flusher(1)
    try:
        old = spec(tmp_path, BASE)
        writer = open_writer(tmp_path, old, flusher)
        writer.put(batch(old, 0, 100), source(0, 100)).result(30)
        assert writer.wait_flushed(30)
        writer.close(flush=True)
    finally:
        flusher.shutdown()
    ds = BaseTable(old).dataset()
    ds.create_scalar_index("n", "BTREE")
    ds.create_scalar_index("score", "BTREE")
    ds.create_scalar_index("id", "BTREE")
    table = BaseTable(spec(tmp_path, EVOLVED, evolve=True))
    table.open()
    ds = table.dataset()
    assert ds.schema.field("n").type == pa.int64()
    assert ds.schema.field("score").type == pa.float64()
    assert [i.field_names for i in ds.describe_indices()] == [["id"]]  # the others dropped
    assert sorted(ds.to_table(columns=["n"]).column("n").to_pylist()) == list(range(100))


def test_a_pod_widening_indexed_columns_beside_another_drops_what_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lance moves a dataset to the newest version as it drops an index: another pod that
    # dropped the second index meanwhile made this pod's second drop fail ("Lance index not
    # found", a RuntimeError), and its start with it.
    BaseTable(spec(tmp_path, BASE)).open()
    table = BaseTable(spec(tmp_path, BASE))
    table.commit_flush([table.spec.to_table_batch(batch(table.spec, 0, 10))], None, {})
    ds = table.dataset()
    ds.create_scalar_index("n", "BTREE")
    ds.create_scalar_index("score", "BTREE")
    pod = BaseTable(spec(tmp_path, EVOLVED, evolve=True))
    listed = engine.table.indexes_on

    def list_then_rival(ds: Any, columns: set[str]) -> list[str]:
        names = listed(ds, columns)
        if len(names) == 2:  # the other pod drops the second one now
            BaseTable(spec(tmp_path, BASE)).dataset().drop_index(names[1])
        return names

    monkeypatch.setattr(engine.table, "indexes_on", list_then_rival)
    pod.open()
    assert pod.dataset().schema.field("n").type == pa.int64()
    assert pod.dataset().describe_indices() == []
