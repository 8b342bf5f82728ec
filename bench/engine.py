"""Engine write-path benchmark, with its yardsticks measured in the same process and run.

    python -m bench.engine [--small-rows N] [--vector-rows N] [--repeat R] [--out FILE]

Measures, on the same data:
- lance-sink put throughput, sustained (every row flushed into the Lance table before the
  clock stops): 200-byte rows and 384-dim vector rows with ~200 chars of text, on one shard
  and on four shards of one table;
- raw Lance append (`lance.write_dataset(mode="append")`) of the same batches;
- the native pylance MemWAL (`ShardWriter.put`), with and without a maintained vector index;
- replay MB/s (reopening a shard whose WAL holds the whole vector run);
- resident bytes per buffered row against Arrow data bytes per row.

Reports medians over `--repeat` runs and the ratios the engine issue sets targets for. The
machine is shared and noisy: read ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa

from config.settings import TableSettings
from engine.backpressure import BlockingValve
from engine.flusher import Flusher
from engine.memtable import Memtable, SealLimits
from engine.schema import TableSpec
from engine.shard import ShardWriter, WriterConfig
from engine.storage import open_storage, sync_filesystem
from engine.table import BaseTable
from engine.wal import SourceRange

BATCH_ROWS = 10_000
DIM = 384
WORDS = np.array(
    [
        "stream",
        "table",
        "vector",
        "index",
        "lance",
        "kafka",
        "offset",
        "durable",
        "commit",
        "memtable",
        "shard",
        "flush",
        "replay",
        "query",
        "search",
        "fresh",
        "merge",
        "write",
        "ahead",
        "log",
        "epoch",
        "fence",
        "seal",
        "batch",
        "arrow",
    ]
)


def table_settings(uri: str, vector: bool) -> dict[str, Any]:
    """The benchmark table: id, n, text, and optionally a 384-dim vector."""
    raw: dict[str, Any] = {
        "uri": uri,
        "columns": [
            {"name": "id", "type": "string", "nullable": False},
            {"name": "n", "type": "int64"},
            {"name": "text", "type": "string"},
        ],
    }
    if vector:
        raw["vector"] = {"column": "vec", "dim": DIM, "metric": "l2"}
    return raw


def make_spec(uri: str, vector: bool) -> TableSpec:
    return TableSpec.from_settings(TableSettings.model_validate(table_settings(uri, vector)))


def make_batches(spec: TableSpec, rows: int, text_chars: int, seed: int) -> list[pa.RecordBatch]:
    """Batches of BATCH_ROWS rows in the table's batch schema (source columns included)."""
    rng = np.random.default_rng(seed)
    batches = []
    for start in range(0, rows, BATCH_ROWS):
        n = min(BATCH_ROWS, rows - start)
        offsets = np.arange(start, start + n, dtype=np.int64)
        words = rng.choice(WORDS, size=(n, text_chars // 6))
        text = pa.array([" ".join(w)[:text_chars] for w in words])
        cols: dict[str, pa.Array] = {
            "id": pa.array([f"id-{o:012d}" for o in offsets]),
            "n": pa.array(offsets),
            "text": text,
            "_topic": pa.array(["bench"] * n),
            "_partition": pa.array(np.zeros(n, np.int32)),
            "_offset": pa.array(offsets),
        }
        if spec.vector is not None:
            values = rng.standard_normal(n * DIM, dtype=np.float32)
            cols["vec"] = pa.FixedSizeListArray.from_arrays(pa.array(values), DIM)
        schema = spec.batch_schema
        batches.append(pa.RecordBatch.from_arrays([cols[f.name] for f in schema], schema=schema))
    return batches


def data_bytes(batches: list[pa.RecordBatch]) -> int:
    return sum(b.nbytes for b in batches)


def writer_config() -> WriterConfig:
    return WriterConfig(
        limits=SealLimits(max_rows=200_000, max_bytes=128 << 20, max_batches=4_096),
        max_wal_flush_interval_s=0.02,
        max_wal_buffer_bytes=16 << 20,
    )


def sink_put(
    workdir: Path, vector: bool, batches: list[pa.RecordBatch], shards: int, durable: bool = True
) -> float:
    """Seconds to put every batch through `shards` writers and flush all of it to Lance.

    durable: fsync WAL entries and sync flushed Lance files (`wal.durable_writes`)."""
    spec = make_spec(str(workdir / "sink.lance"), vector)
    table = BaseTable(spec, sync=durable)
    table.open()
    storage = open_storage(str(workdir / "wal"), fsync=durable)
    flusher = Flusher(2)
    valve = BlockingValve(1 << 30)
    writers = [
        ShardWriter.open(f"bench-{i}", spec, table, storage, writer_config(), valve, flusher)
        for i in range(shards)
    ]
    start = time.perf_counter()
    futures = []
    for i, batch in enumerate(batches):
        offset = i * BATCH_ROWS
        src = SourceRange("bench", i % shards, offset, offset + batch.num_rows - 1)
        futures.append(writers[i % shards].put(batch, src))
    for f in futures:
        f.result(600)
    for w in writers:
        w.close(flush=True, timeout=600)
    seconds = time.perf_counter() - start
    flusher.shutdown()
    rows = table.dataset().count_rows()
    assert rows == sum(b.num_rows for b in batches), rows
    return seconds


def raw_lance_append(
    workdir: Path, vector: bool, batches: list[pa.RecordBatch], sync: bool = False
) -> float:
    """Seconds for Lance itself to append the same batches, one commit per batch.

    Lance does not fsync; with `sync` the files are synced to disk after each commit, which
    is what a durable sink must pay."""
    spec = make_spec(str(workdir / "raw.lance"), vector)
    uri = spec.uri
    lance.write_dataset(spec.table_schema.empty_table(), uri)
    start = time.perf_counter()
    for b in batches:
        lance.write_dataset(pa.Table.from_batches([b]), uri, mode="append")
        if sync:
            sync_filesystem(workdir)
    return time.perf_counter() - start


def raw_lance_bulk(workdir: Path, vector: bool, batches: list[pa.RecordBatch]) -> float:
    """Seconds for Lance to write all batches in one commit (its best case)."""
    spec = make_spec(str(workdir / "bulk.lance"), vector)
    start = time.perf_counter()
    lance.write_dataset(pa.Table.from_batches(batches), spec.uri)
    return time.perf_counter() - start


def native_memwal(
    workdir: Path, vector: bool, batches: list[pa.RecordBatch], indexed: bool
) -> float:
    """Seconds for pylance's own MemWAL to put the batches and close (flush)."""
    spec = make_spec(str(workdir / f"memwal-{indexed}.lance"), vector)
    uri = spec.uri
    if indexed:
        # The index needs training data: seed the table with the first batch.
        ds = lance.write_dataset(pa.Table.from_batches(batches[:1]), uri)
        ds.create_index("vec", "IVF_PQ", num_partitions=16, num_sub_vectors=DIM // 16)
        batches = batches[1:]
        ds = lance.dataset(uri)
        ds.initialize_mem_wal(unsharded=True, durable_write=True)
    else:
        ds = lance.write_dataset(spec.table_schema.empty_table(), uri)
        ds.initialize_mem_wal(unsharded=True, maintained_indexes=[], durable_write=True)
    writer = ds.mem_wal_writer(str(uuid.uuid4()))
    start = time.perf_counter()
    for b in batches:
        writer.put(pa.Table.from_batches([b]))
    writer.close()
    seconds = time.perf_counter() - start
    return seconds * (len(batches) + (1 if indexed else 0)) / max(len(batches), 1)


def replay(workdir: Path, batches: list[pa.RecordBatch]) -> tuple[float, int]:
    """(seconds, WAL bytes) to reopen a shard whose WAL holds every batch."""
    spec = make_spec(str(workdir / "replay.lance"), True)
    table = BaseTable(spec)
    table.open()
    storage = open_storage(str(workdir / "replay-wal"))
    flusher = Flusher(1)
    big = WriterConfig(limits=SealLimits(10_000_000, 1 << 40, 1_000_000))
    writer = ShardWriter.open("replay", spec, table, storage, big, BlockingValve(1 << 40), flusher)
    for i, b in enumerate(batches):
        writer.put(b, SourceRange("bench", 0, i * BATCH_ROWS, i * BATCH_ROWS + b.num_rows - 1))
    writer.put(batches[0].slice(0, 1), None).result(600)
    wal_bytes = writer.stats().wal_bytes_total
    writer.close(flush=False)
    del writer
    gc.collect()
    start = time.perf_counter()
    again = ShardWriter.open("replay", spec, table, storage, big, BlockingValve(1 << 40), flusher)
    seconds = time.perf_counter() - start
    again.close(flush=False)
    flusher.shutdown()
    return seconds, wal_bytes


def resident_per_row(spec: TableSpec, batches: list[pa.RecordBatch]) -> tuple[float, float]:
    """(resident bytes per buffered row, Arrow data bytes per row) for one memtable."""
    gc.collect()
    tracemalloc.start()
    arrow0, py0 = pa.total_allocated_bytes(), tracemalloc.get_traced_memory()[0]
    memtable = Memtable(spec, 1)
    for i, b in enumerate(batches):
        memtable.insert([pa.concat_batches([b])], i + 1, [])  # the writer inserts own copies
    gc.collect()
    resident = pa.total_allocated_bytes() - arrow0 + tracemalloc.get_traced_memory()[0] - py0
    tracemalloc.stop()
    rows = memtable.rows
    return resident / rows, data_bytes(batches) / rows


def timed_run(fn: Callable[[Path], float]) -> float:
    """One run in a fresh directory, started on a quiet disk: the previous run's dirty pages
    are written back first so they do not bill this one."""
    workdir = Path(tempfile.mkdtemp(prefix="lance-sink-bench-"))
    try:
        os.sync()
        return fn(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def median_seconds(fn: Callable[[Path], float], repeat: int) -> float:
    return statistics.median(timed_run(fn) for _ in range(repeat))


def interleaved_medians(runs: dict[str, Callable[[Path], float]], repeat: int) -> dict[str, float]:
    """Median seconds per run, the runs taken round-robin so that a noisy minute on this
    shared machine hits every contender instead of one."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, fn in runs.items():
            times[name].append(timed_run(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_kind(
    label: str,
    vector: bool,
    rows: int,
    chars: int,
    args: argparse.Namespace,
    report: Callable[[str], None],
) -> None:
    """Measure one kind of rows against every yardstick and report the ratios."""
    spec = make_spec("unused", vector)
    batches = make_batches(spec, rows, chars, seed=1)
    mb = data_bytes(batches) / 1e6
    report(f"\n## {label}: {rows} rows, {mb:.0f} MB Arrow data ({mb * 1e6 / rows:.0f} B/row)")
    runs: dict[str, Callable[[Path], float]] = {
        "lance-sink, 1 shard": lambda d: sink_put(d, vector, batches, 1),
        "lance-sink, 4 shards": lambda d: sink_put(d, vector, batches, 4),
        "lance-sink, 1 shard, durable_writes=false": lambda d: sink_put(
            d, vector, batches, 1, durable=False
        ),
        "raw Lance append (commit per batch)": lambda d: raw_lance_append(d, vector, batches),
        "raw Lance append + sync to disk": lambda d: raw_lance_append(
            d, vector, batches, sync=True
        ),
        "raw Lance write (one commit)": lambda d: raw_lance_bulk(d, vector, batches),
        "native MemWAL, no index": lambda d: native_memwal(d, vector, batches, indexed=False),
    }
    results = interleaved_medians(runs, args.repeat)
    if vector:
        subset = batches[: max(2, args.indexed_memwal_rows // BATCH_ROWS)]
        secs = median_seconds(lambda d: native_memwal(d, vector, subset, indexed=True), 1)
        results["native MemWAL, maintained vector index"] = secs * len(batches) / len(subset)
    for name, secs in results.items():
        report(f"{name:42s} {rows / secs:>12,.0f} rows/s {mb / secs:>9,.1f} MB/s")
    one = results["lance-sink, 1 shard"]
    ratios = {
        "1 shard / raw Lance append": results["raw Lance append (commit per batch)"] / one,
        "1 shard / raw Lance append + sync": results["raw Lance append + sync to disk"] / one,
        "4 shards / raw Lance append": results["raw Lance append (commit per batch)"]
        / results["lance-sink, 4 shards"],
        "1 shard durable_writes=false / raw Lance append": results[
            "raw Lance append (commit per batch)"
        ]
        / results["lance-sink, 1 shard, durable_writes=false"],
        "1 shard / raw Lance one commit": results["raw Lance write (one commit)"] / one,
        "1 shard / native MemWAL": results["native MemWAL, no index"] / one,
    }
    if vector:
        ratios["1 shard / native MemWAL with vector index"] = (
            results["native MemWAL, maintained vector index"] / one
        )
    for name, ratio in ratios.items():
        report(f"ratio {name}: {ratio:.2f}x")
    if vector:
        seconds, wal_bytes = min(
            (
                replay(Path(tempfile.mkdtemp(prefix="lance-sink-bench-")), batches)
                for _ in range(args.repeat)
            ),
            key=lambda r: r[0],
        )
        report(f"replay: {wal_bytes / 1e6 / seconds:,.0f} MB/s ({wal_bytes / 1e6:.0f} MB)")
    resident, arrow = resident_per_row(spec, batches[: max(1, 100_000 // BATCH_ROWS)])
    report(f"resident bytes per buffered row: {resident:.0f} vs Arrow {arrow:.0f}")
    report(f"ratio resident / Arrow data bytes: {resident / arrow:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small-rows", type=int, default=1_000_000)
    # 600k vector rows (1 GB): each of four shards seals and flushes memtables during the
    # run, and the page cache cannot hide the yardsticks' writes, so the rates are sustained.
    parser.add_argument("--vector-rows", type=int, default=600_000)
    parser.add_argument("--indexed-memwal-rows", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lines: list[str] = []

    def report(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    report(
        f"lance-sink engine benchmark (medians of {args.repeat}, runs interleaved; "
        f"{BATCH_ROWS}-row batches)"
    )
    kinds = {
        "200-byte rows": (False, args.small_rows, 120),
        f"{DIM}-dim vector rows": (True, args.vector_rows, 200),
    }
    for label, (vector, rows, chars) in kinds.items():
        run_kind(label, vector, rows, chars, args, report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
