"""Bounded replay (I4): a WAL longer than five memtables replays with the live seal predicate,
flushing as it goes, so memory stays around two memtables; the result is exactly-once."""

from __future__ import annotations

import gc
import tracemalloc

import pyarrow as pa
import pytest

from engine.shard_stats import NoEvents
from tests.engine.conftest import MakeHarness
from tests.support.engine import make_batch, source, writer_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ENTRY_ROWS = 500
ENTRIES = 60
MEMTABLE_ROWS = 4_000  # 30k rows replayed = 7.5 memtables


class PeakMemory(NoEvents):
    """Samples resident bytes (Arrow pool + Python heap) at every seal and flush."""

    def __init__(self) -> None:
        self.peak = 0
        self.flushes = 0
        self.seals = 0

    def sample(self) -> None:
        used = pa.total_allocated_bytes() + tracemalloc.get_traced_memory()[0]
        self.peak = max(self.peak, used)

    def memtable_sealed(self, shard: str, generation: int, rows: int, nbytes: int) -> None:
        self.seals += 1
        self.sample()

    def flushed(self, shard: str, seconds: float, rows: int) -> None:
        self.flushes += 1
        self.sample()


def test_long_wal_replays_in_bounded_memory(any_harness: MakeHarness) -> None:
    # Write the WAL with memtables large enough that nothing seals or flushes.
    h = any_harness(config=writer_config(max_rows=10_000_000, max_bytes=1 << 40))
    writer = h.open()
    for i in range(ENTRIES):
        writer.put(
            make_batch(h.spec, i * ENTRY_ROWS, ENTRY_ROWS), source(i * ENTRY_ROWS, ENTRY_ROWS)
        ).result(30)
    memtable_bytes = writer.stats().bytes * MEMTABLE_ROWS // (ENTRIES * ENTRY_ROWS)
    writer.close(flush=False)
    del writer
    assert h.base_rows().num_rows == 0

    gc.collect()
    tracemalloc.start()
    baseline = pa.total_allocated_bytes() + tracemalloc.get_traced_memory()[0]
    events = PeakMemory()
    replayer = h.open(config=writer_config(max_rows=MEMTABLE_ROWS), events=events)
    tracemalloc.stop()
    stats = replayer.stats()
    assert stats.replayed_rows == ENTRIES * ENTRY_ROWS
    assert events.flushes >= 5  # flushed as it went, not at the end
    assert events.seals >= 5
    assert events.peak - baseline <= 3 * memtable_bytes, (events.peak - baseline, memtable_bytes)
    replayer.close(flush=True)
    offsets = h.base_rows().column("_offset").to_pylist()
    assert sorted(offsets) == list(range(ENTRIES * ENTRY_ROWS))
