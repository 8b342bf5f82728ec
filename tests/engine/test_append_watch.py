"""`BaseTable.watch_appends`: what an append flush tells its watchers, and when."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lance
import pyarrow as pa
import pytest

from engine.errors import PersistenceError
from engine.memtable import Memtable
from engine.table import flush_properties
from tests.engine.conftest import MakeHarness
from tests.support.engine import make_batch


class Recorder:
    """An AppendWatcher that logs every call; `keep` makes it take the rows."""

    def __init__(self, keep: bool, fail_on_commit: bool = False) -> None:
        self.keep = keep
        self.fail_on_commit = fail_on_commit
        self.events: list[tuple[str, Any]] = []

    @contextmanager
    def appending(
        self, rows: pa.Table, memtable: Memtable | None
    ) -> Iterator[Callable[[lance.LanceDataset], None]]:
        self.events.append(("appending", rows.num_rows))
        if self.keep:
            self.events.append(("rows", rows))

        def committed(ds: lance.LanceDataset) -> None:
            self.events.append(("committed", int(ds.version)))
            if self.fail_on_commit:
                raise RuntimeError("watcher bug")

        try:
            yield committed
        finally:
            self.events.append(("exit", None))


def commit(h: Any, first: int, count: int) -> int:
    batches = [h.spec.to_table_batch(make_batch(h.spec, first + i * 10, 10)) for i in range(count)]
    props = flush_properties(h.shard, 1, 1, 1, {"t:0": first + count * 10 - 1})
    version: int = h.table.commit_flush(batches, None, props)
    return version


def test_watchers_see_the_rows_before_and_the_version_after_the_commit(
    local_harness: MakeHarness,
) -> None:
    h = local_harness()
    keeper, bystander = Recorder(keep=True), Recorder(keep=False, fail_on_commit=True)
    h.table.watch_appends(keeper)
    h.table.watch_appends(bystander)
    version = commit(h, 0, 3)
    kinds = [e[0] for e in keeper.events]
    assert kinds == ["appending", "rows", "committed", "exit"]
    assert keeper.events[0][1] == 30
    rows: pa.RecordBatch = keeper.events[1][1]
    assert rows.column("_offset").to_pylist() == list(range(30))  # the order written
    assert keeper.events[2][1] == version
    # A watcher failing after the commit does not fail the flush: the rows are in.
    assert [e[0] for e in bystander.events] == ["appending", "committed", "exit"]
    base = h.table.dataset().to_table(columns=["_offset"]).column("_offset").to_pylist()
    assert base == list(range(30))
    h.table.unwatch_appends(keeper)
    commit(h, 30, 1)
    assert len(keeper.events) == 4


def test_a_failed_commit_is_not_reported_as_committed(
    local_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = local_harness()
    watcher = Recorder(keep=True)
    h.table.watch_appends(watcher)

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(lance.LanceDataset, "commit", refuse)
    with pytest.raises(PersistenceError):
        commit(h, 0, 2)
    assert [e[0] for e in watcher.events] == ["appending", "rows", "exit"]
