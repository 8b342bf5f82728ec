"""A flush that fails keeps its memtable frozen and counted (I8), retries with backoff, and
poisons the writer when it keeps failing (I6). The failure is real: the table's data folder
is replaced by a file, so Lance cannot write data files."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.errors import Poisoned
from tests.engine.conftest import MakeHarness
from tests.support.engine import make_batch, source, writer_config

pytestmark = pytest.mark.timeout(120)


@contextmanager
def broken_table(table_dir: Path) -> Iterator[None]:
    data = table_dir / "data"
    saved = table_dir / "data.saved"
    if data.exists():
        data.rename(saved)
    data.write_text("not a folder")
    try:
        yield
    finally:
        data.unlink()
        if saved.exists():
            saved.rename(data)
        else:
            data.mkdir()


def wait_for(predicate: object, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_failed_flush_stays_frozen_counted_and_retries(
    local_harness: MakeHarness, tmp_path: Path
) -> None:
    h = local_harness(config=writer_config(flush_retry_initial_s=0.05, flush_max_attempts=1000))
    writer = h.open()
    writer.put(make_batch(h.spec, 0, 50), source(0, 50)).result(10)
    with broken_table(tmp_path / "table.lance"):
        writer.seal()
        wait_for(lambda: writer.stats().flush_failures_total >= 2)
        stats = writer.stats()
        assert stats.frozen_count == 1
        assert stats.frozen_bytes > 0
        assert writer.memory.frozen_bytes == stats.frozen_bytes  # the live view agrees
        assert writer.poisoned is None
        # Puts still work while the flush is being retried.
        writer.put(make_batch(h.spec, 50, 10), source(50, 10)).result(10)
    assert writer.wait_flushed(20)
    assert writer.stats().frozen_bytes == 0
    writer.close(flush=True)
    assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(60))


def test_persistent_flush_failure_poisons(local_harness: MakeHarness, tmp_path: Path) -> None:
    h = local_harness(config=writer_config(flush_retry_initial_s=0.01, flush_max_attempts=3))
    writer = h.open()
    writer.put(make_batch(h.spec, 0, 50), source(0, 50)).result(10)
    with broken_table(tmp_path / "table.lance"):
        writer.seal()
        wait_for(lambda: writer.poisoned is not None)
    assert isinstance(writer.poisoned, Poisoned)
    with pytest.raises(Poisoned):
        writer.put(make_batch(h.spec, 50, 10), source(50, 10))
    with pytest.raises(Poisoned):
        writer.view()
    stats = writer.stats()  # stats stay readable and truthful
    assert stats.flush_failures_total == 3
    assert stats.frozen_count == 1
    assert stats.frozen_bytes > 0
    writer.close(flush=True)
    # Recovery is close-and-reopen: the next writer replays and flushes the rows.
    again = h.open()
    again.close(flush=True)
    assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(50))


def test_wal_write_failure_poisons_and_fails_the_put(
    local_harness: MakeHarness, tmp_path: Path
) -> None:
    h = local_harness()
    writer = h.open()
    writer.put(make_batch(h.spec, 0, 5), source(0, 5)).result(10)
    wal_dir = tmp_path / "wal" / h.shard / "wal"
    shutil.rmtree(wal_dir)
    wal_dir.write_text("not a folder")
    future = writer.put(make_batch(h.spec, 5, 5), source(5, 5))
    with pytest.raises(Poisoned, match="WAL append failed"):
        future.result(10)
    with pytest.raises(Poisoned):
        writer.put(make_batch(h.spec, 10, 5), source(10, 5))
    writer.close(flush=False)
