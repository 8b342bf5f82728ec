"""A shard writer on a table whose history holds compactions of indexed fragments.

pylance 14.0.2 cannot decode such a compaction's Rewrite transaction (`get_transactions`
raises TypeError from `RewrittenIndex.__init__`). The flush watermark lookup
(`BaseTable.find_flush`), the reader's `holds_generation` and maintenance's cleanup rule read
flush commits one version at a time and count an undecodable commit as carrying no
properties (`engine.table.transaction_properties`), so maintenance can never poison a shard.
"""

from __future__ import annotations

import lance
import pytest

from engine.shard import ShardWriter
from engine.table import PROP_SHARD, flush_commits, flush_properties, holds_generation
from tests.engine.conftest import MakeHarness
from tests.support.engine import Harness, make_batch, source, visible_rows, writer_config


def _flush_puts(h: Harness, writer: ShardWriter, first: int, puts: int, rows: int = 50) -> None:
    for i in range(puts):
        start = first + i * rows
        writer.put(make_batch(h.spec, start, rows), source(start, rows)).result(10)
    assert writer.wait_flushed(30)


def _index_and_compact(uri: str) -> int:
    """What maintenance does: a key index on the flushed rows, then a compaction of the
    indexed fragments. Returns the version of the compaction's commit."""
    ds = lance.dataset(uri)
    ds.create_scalar_index("id", "BTREE")
    lance.dataset(uri).optimize.compact_files()
    return int(lance.dataset(uri).version)


def test_pylance_cannot_decode_a_compaction_of_indexed_fragments(
    local_harness: MakeHarness,
) -> None:
    """The upstream failure this module guards against, reproduced with plain pylance. If a
    pylance upgrade fixes it, this test says so (and `transaction_properties` keeps working)."""
    h = local_harness(config=writer_config(max_rows=50))
    writer = h.open()
    _flush_puts(h, writer, 0, 4)
    writer.close(flush=True)
    rewrite = _index_and_compact(h.spec.uri)
    ds = h.table.dataset()
    with pytest.raises(TypeError, match="RewrittenIndex"):
        ds.get_transactions(ds.version)
    with pytest.raises(TypeError, match="RewrittenIndex"):
        ds.read_transaction(rewrite)


def test_flush_and_open_after_compacting_indexed_fragments(local_harness: MakeHarness) -> None:
    h = local_harness(config=writer_config(max_rows=50))
    writer = h.open()
    _flush_puts(h, writer, 0, 4)
    _index_and_compact(h.spec.uri)
    # The next flushes look for a stale writer's flush above the compaction: none, no error.
    _flush_puts(h, writer, 200, 3)
    stats = writer.stats()
    assert stats.flush_failures_total == 0
    assert stats.poisoned is None
    writer.put(make_batch(h.spec, 350, 10), source(350, 10)).result(10)
    assert writer.wait_flushed(30)  # the memtable these 10 rows sealed is flushed
    writer.close(flush=False)  # 10 rows left to replay

    reopened = h.open()  # finds its watermark above the compaction, replays the rest
    assert reopened.stats().replayed_rows == 10
    assert reopened.durable_offsets[("t", 0)] == 359
    ids = h.base_rows().column("n").to_pylist() + [r["n"] for r in visible_rows(reopened)]
    assert sorted(ids) == list(range(360))  # exactly once
    reopened.close(flush=False)


def test_a_crash_window_flush_below_a_compaction_is_found(local_harness: MakeHarness) -> None:
    """A flush committed but not recorded in its manifest (the crash window, I3), then a
    compaction of indexed fragments above it: the next open must still find the flush."""
    h = local_harness(config=writer_config(max_rows=50))
    writer = h.open()
    _flush_puts(h, writer, 0, 2)
    writer.close(flush=False)
    batch = h.spec.to_table_batch(make_batch(h.spec, 100, 50))
    ghost = h.table.commit_flush([batch], None, flush_properties(h.shard, 1, 99, 7, {"t:0": 149}))
    rewrite = _index_and_compact(h.spec.uri)
    ds = h.table.dataset()
    assert [v for v, _ in flush_commits(ds, 0)][:1] == [ghost]
    assert holds_generation(ds, h.shard, 99, ghost - 1)
    assert not holds_generation(ds, h.shard, 99, ghost)
    mark = h.table.find_flush(h.shard, 0)
    assert mark is not None
    assert (mark.version, mark.wal_end, mark.generation) == (ghost, 7, 99)
    assert rewrite > ghost
    assert all(PROP_SHARD in props for _, props in flush_commits(ds, 0))
