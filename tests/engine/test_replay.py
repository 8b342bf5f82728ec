"""Bounded replay (I4): a WAL longer than five memtables replays with the live seal predicate,
flushing as it goes, so memory stays around two memtables; the result is exactly-once."""

from __future__ import annotations

import gc
import multiprocessing
import tracemalloc
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pytest

from engine.shard_stats import NoEvents
from tests.engine.conftest import MakeHarness, Storage
from tests.support.engine import Harness, make_batch, source, writer_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ENTRY_ROWS = 500
ENTRIES = 60
MEMTABLE_ROWS = 4_000  # 30k rows replayed = 7.5 memtables


@dataclass(frozen=True)
class Measured:
    base_rows_before: int
    replayed_rows: int
    flushes: int
    seals: int
    peak_growth: int
    memtable_bytes: int


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


def replay_in_a_fresh_process(table: str, wal: str, options: dict[str, str] | None) -> Measured:
    """Write a long WAL, then replay it and sample memory at every seal and flush.

    Runs in a spawned interpreter: the samples are process-wide (Arrow's pool, the Python
    heap), so threads left by earlier tests in the pytest process would count as the replay's.
    """
    # Write the WAL with memtables large enough that nothing seals or flushes.
    config = writer_config(max_rows=10_000_000, max_bytes=1 << 40)
    h = Harness(table, wal, storage_options=options, config=config)
    writer = h.open()
    for i in range(ENTRIES):
        writer.put(
            make_batch(h.spec, i * ENTRY_ROWS, ENTRY_ROWS), source(i * ENTRY_ROWS, ENTRY_ROWS)
        ).result(30)
    memtable_bytes = writer.stats().bytes * MEMTABLE_ROWS // (ENTRIES * ENTRY_ROWS)
    writer.close(flush=False)
    del writer
    base_rows_before = h.base_rows().num_rows

    gc.collect()
    tracemalloc.start()
    baseline = pa.total_allocated_bytes() + tracemalloc.get_traced_memory()[0]
    events = PeakMemory()
    replayer = h.open(config=writer_config(max_rows=MEMTABLE_ROWS), events=events)
    tracemalloc.stop()
    measured = Measured(
        base_rows_before,
        replayer.stats().replayed_rows,
        events.flushes,
        events.seals,
        events.peak - baseline,
        memtable_bytes,
    )
    replayer.close(flush=True)
    h.flusher.shutdown()
    return measured


def test_long_wal_replays_in_bounded_memory(any_harness: MakeHarness, any_storage: Storage) -> None:
    table, wal, options = any_storage
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as child:
        measured = child.submit(replay_in_a_fresh_process, table, wal, options).result(240)
    assert measured.base_rows_before == 0
    assert measured.replayed_rows == ENTRIES * ENTRY_ROWS
    assert measured.flushes >= 5  # flushed as it went, not at the end
    assert measured.seals >= 5
    assert measured.peak_growth <= 3 * measured.memtable_bytes, measured
    h = any_harness()
    offsets = h.base_rows().column("_offset").to_pylist()
    assert sorted(offsets) == list(range(ENTRIES * ENTRY_ROWS))
