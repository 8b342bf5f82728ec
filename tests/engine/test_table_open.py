"""`BaseTable.open` when other processes create the same table at the same time: the first
create wins and every other opener uses that table, whatever error its own create saw (on S3
a losing create can see a preempted commit rather than "already exists"); a create never
lands on top of a table that exists (an Overwrite there would drop every row in it)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import lance
import pyarrow as pa
import pytest
from lance.file import LanceFileReader

from engine.errors import PersistenceError
from engine.schema import TableSpec
from engine.table import STRUCTURAL_ENCODING, BaseTable, create_table, flush_properties
from tests.engine.conftest import Storage
from tests.support.engine import make_batch, make_spec


def spec_for(storage: Storage) -> TableSpec:
    table, _, options = storage
    return make_spec(table, storage_options=options or {})


class RacedTable(BaseTable):
    """A table whose first look finds nothing, after which a rival opener creates the table
    before this one's own create runs: the interleaving of two pods starting together."""

    def __init__(self, spec: TableSpec, rival: BaseTable) -> None:
        super().__init__(spec)
        self._rival: BaseTable | None = rival

    def dataset(self, version: int | None = None) -> lance.LanceDataset:
        rival, self._rival = self._rival, None
        try:
            return super().dataset(version)
        finally:
            if rival is not None:
                rival.open()


def test_a_table_created_between_the_check_and_the_create_is_used(any_storage: Storage) -> None:
    spec = spec_for(any_storage)
    raced = RacedTable(spec, rival=BaseTable(spec))
    raced.open()
    ds = raced.dataset()
    assert ds.version == 1  # the rival's create only: nothing was overwritten
    assert ds.count_rows() == 0
    spec.check_table(ds.schema)


def test_openers_starting_together_all_open_the_one_table(any_storage: Storage) -> None:
    spec = spec_for(any_storage)
    openers = [BaseTable(spec) for _ in range(4)]
    start = threading.Barrier(len(openers))
    errors: list[BaseException] = []

    def open_one(table: BaseTable) -> None:
        start.wait()
        try:
            table.open()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(t,)) for t in openers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # One create committed (version 1); the others' were refused, not retried as an
    # Overwrite on top of it (with `write_dataset(mode="create")` one landed as version 2).
    assert {t.latest_version() for t in openers} == {1}
    ds = openers[0].dataset()
    assert ds.count_rows() == 0
    spec.check_table(ds.schema)


def test_a_create_that_cannot_happen_names_the_table(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    spec = make_spec(str(blocker / "t.lance"))
    with pytest.raises(PersistenceError, match="cannot create table") as raised:
        BaseTable(spec).open()
    assert "t.lance" in str(raised.value)


def test_a_create_that_finds_the_table_too_late_drops_no_row(any_storage: Storage) -> None:
    # The race behind it: a pod looks, finds no table, and commits its create only after
    # another pod created the table and flushed rows into it. Lance's create retried its
    # commit as an Overwrite there, version 3 with no rows: the flushed rows (their offsets
    # committed) were gone from the table.
    spec = spec_for(any_storage)
    first = BaseTable(spec)
    first.open()
    lance.write_dataset(
        pa.Table.from_batches([make_batch(spec, 0, 3)]).select(spec.table_schema.names),
        spec.uri,
        mode="append",
        storage_options=spec.storage_options or None,
    )
    with pytest.raises((OSError, ValueError, RuntimeError)):
        create_table(spec.uri, spec.table_schema, spec.storage_options or None)
    ds = first.dataset()
    assert ds.count_rows() == 3
    assert ds.version == 2


def test_a_created_tables_vectors_are_laid_out_for_scans(tmp_path: Path) -> None:
    """The sink creates its table with the vector column laid out as mini-blocks (Lance's
    default for 1,536-byte values is full-zip, whose flat kNN scan, the search of every row
    no vector index covers, took 1.7x as long), and the files its flushes write follow it;
    the table answers as before (schema check, rows, a kNN query)."""
    spec = make_spec(tmp_path / "t.lance")
    table = BaseTable(spec)
    table.open()
    ds = table.dataset()
    spec.check_table(ds.schema)
    vec = spec.vector
    assert vec is not None
    assert ds.schema.field(vec.name).metadata == {STRUCTURAL_ENCODING.encode(): b"miniblock"}
    batch = make_batch(spec, 0, 300)
    table.commit_flush([batch], None, flush_properties("s1", 1, 1, 300, {"t:0": 300}))
    ds = table.dataset()
    assert ds.count_rows() == 300
    (fragment,) = ds.get_fragments()
    (data_file,) = fragment.metadata.files
    reader = LanceFileReader(str(tmp_path / "t.lance" / "data" / data_file.path))
    column = spec.table_schema.names.index(vec.name)
    layouts = {_layout(str(page.encoding)) for page in reader.metadata().columns[column].pages}
    assert layouts == {"MiniBlockLayout"}, layouts
    query = batch.column(vec.name)[7].values.to_numpy()
    found = ds.to_table(nearest={"column": vec.name, "q": query, "k": 1}, columns=["_offset"])
    assert found.column("_offset").to_pylist() == [7]


def _layout(encoding: str) -> str:
    """The structural layout a page's encoding names (Lance prints it as a Rust value)."""
    found = re.search(r"(MiniBlock|FullZip|Constant|Blob)Layout", encoding)
    assert found is not None, encoding
    return found.group(0)
