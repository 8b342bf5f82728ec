"""Query latency of the read path: memtable kNN, merged (base + memtable) vector, filtered
vector, text and 100-key lookup queries, idle and under ingestion, with Lance's own search
on the base (and pylance's MemWAL `LsmVectorSearchPlanner` on it) as yardsticks.

Run: ``python -m bench.query [--base-rows 1000000] [--memtable-rows 100000]
[--ingest-seconds 60] [--out bench/results/query.txt]``.
``--processes 3`` runs the fan-out comparison instead (`bench.fanout`): the same queries to
one process holding every shard and to one of three processes holding one shard each.

Under ingestion the phase is bounded: a producer puts at half the sink's max rate for these
rows (``--rate``, default `HALF_SINK_MAX_RATE`) for ``--warmup-s`` + ``--ingest-seconds``
while maintenance runs as the sink runs it; the
queries are timed in rotation, lance-sink's kinds and Lance's yardsticks taking turns of
``--slice-s`` (so neither's load is counted against the other, and the growing base hits
both alike), each on a thread of its own with a deadline (``--query-timeout-s``): a query
that misses it counts at the timeout value and is reported as timed out (it finishes in the
background). Progress is printed every ~10 s. The process runs with the settings
`lance-sink run` applies to itself (`sink.cli.tune_process`).

Data: 384-dim float32 embeddings drawn around 1 000 cluster centres (so an IVF index has
structure to find, like real embeddings), a 10-word text per row from a 5 000-word
Zipf-distributed vocabulary, an integer ``n`` column for filters and a string key ``id``.
The base is written straight to Lance (chunks of 100k rows) and indexed like maintenance
does (IVF_PQ, INVERTED, BTREE); it is cached under ``--workdir`` between runs. The memtable
rows go through a real `ShardWriter` (WAL on local disk), so they are exactly what the sink
serves.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faiss
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench import fanout
from bench.query_data import (
    CHUNK,
    DIM,
    SCALAR_INDEXES,
    Data,
    build_base,
    chunks,
    put_rows,
    spec_for,
)
from config.settings import BackpressureSettings, MaintenanceSettings
from engine.backpressure import BlockingValve
from engine.flusher import Flusher
from engine.maintenance import Maintenance, MaintenanceProcess
from engine.memtable import SealLimits
from engine.reader import Reader, ReaderSettings, recall
from engine.schema import TableSpec
from engine.shard import ShardWriter, WriterConfig
from engine.storage import Storage, open_storage
from engine.table import BaseTable
from engine.wal import SourceRange
from sink.cli import tune_process

#: Half the sink's end-to-end max for 384-dim vector rows on the development machine
#: (bench/e2e, vector messages: ~30k msg/s through Kafka, decoding, the WAL and flushes).
#: The engine's put rate alone (no Kafka, no decoding; measured in each run as "max put
#: rate") is about twice that, and no machine sustains it with the index upkeep.
HALF_SINK_MAX_RATE = 15_000


def interleaved(kinds: dict[str, Callable[[], Any]], runs: int) -> dict[str, list[float]]:
    """`runs` timed calls of every kind, in rotation (so every kind sees the same background:
    flushes, maintenance runs, a growing base), after one untimed warm-up call each."""
    for fn in kinds.values():
        fn()  # warm caches (tokenised memtable text, index pages)
    out: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(runs):
        for name, fn in kinds.items():
            started = time.perf_counter()
            fn()
            out[name].append((time.perf_counter() - started) * 1000)
    return out


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(float(np.percentile(samples, 50)), 2),
        "p99_ms": round(float(np.percentile(samples, 99)), 2),
    }


def open_writer(
    spec: TableSpec,
    table: BaseTable,
    storage: Storage,
    shard: str,
    flusher: Flusher,
    max_rows: int,
) -> ShardWriter:
    """A shard writer like the sink's: memtables seal at `max_rows` and flush to the table;
    puts wait while the shard holds more than the default 512 MiB unflushed (the valve)."""
    config = WriterConfig(
        limits=SealLimits(max_rows=max_rows, max_bytes=8 << 30, max_batches=100_000),
        max_wal_flush_interval_s=0.005,
    )
    valve = BlockingValve(int(BackpressureSettings().max_unflushed_memtable_bytes))
    return ShardWriter.open(shard, spec, table, storage, config, valve, flusher)


def put_prebuilt(writer: ShardWriter, batch: pa.RecordBatch, first: int) -> None:
    """Put a pre-built batch under new offsets (the producer does no per-row work, so the
    measured rate is the writer's, not the data generator's)."""
    idx = batch.schema.get_field_index("_offset")
    columns = list(batch.columns)
    columns[idx] = pa.array(np.arange(first, first + batch.num_rows, dtype=np.int64))
    shifted = pa.RecordBatch.from_arrays(columns, schema=batch.schema)
    last = first + batch.num_rows - 1
    writer.put(shifted, SourceRange("bench", 0, first, last)).result(60)


class Producer:
    """Puts pre-built batches into one writer on a thread, at `rate` rows/s (None = as fast
    as one synchronous producer can: each put waits until its WAL entry is durable)."""

    def __init__(
        self, writer: ShardWriter, batches: list[pa.RecordBatch], first: int, rate: float | None
    ) -> None:
        self.writer = writer
        self.batches = batches
        self.first = first
        self.rate = rate
        self.rows = 0
        self.started = 0.0
        self.stopped = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="producer", daemon=True)

    def start(self) -> None:
        self.started = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        size = self.batches[0].num_rows
        while not self._stop.is_set():
            batch = self.batches[(self.rows // size) % len(self.batches)]
            put_prebuilt(self.writer, batch, self.first + self.rows)
            self.rows += size
            if self.rate is not None:
                ahead = self.rows / self.rate - (time.monotonic() - self.started)
                if ahead > 0:
                    time.sleep(ahead)

    def stop(self) -> float:
        """Stop; returns the achieved rate (rows/s)."""
        self._stop.set()
        self._thread.join(60)
        self.stopped = time.monotonic()
        return self.rows / max(self.stopped - self.started, 1e-9)


class MaintenanceLog:
    """MaintenanceEvents that keeps every (task, outcome, seconds)."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, str, float]] = []
        self._lock = threading.Lock()

    def ran(self, task: str, outcome: str, seconds: float) -> None:
        with self._lock:
            self.runs.append((task, outcome, seconds))
        if outcome != "skipped":
            print(f"{time.strftime('%H:%M:%S')} maintenance {task} {outcome} in {seconds:.1f} s")

    def process_exited(self, exitcode: int | None) -> None:
        self.ran("process_exited", f"exit code {exitcode}", 0.0)

    def summary(self) -> dict[str, str]:
        with self._lock:
            runs = list(self.runs)
        out = {}
        for task in dict.fromkeys(t for t, _, _ in runs):
            mine = [(o, sec) for t, o, sec in runs if t == task]
            done = [sec for o, sec in mine if o == "done"]
            counts = {
                o: sum(1 for x, _ in mine if x == o) for o in dict.fromkeys(o for o, _ in mine)
            }
            text = ", ".join(f"{o} {n}" for o, n in counts.items())
            if done:
                text += f" (done: mean {statistics.mean(done):.1f} s, max {max(done):.1f} s)"
            out[task] = text
        return out


TARGETS = {
    "memtable_knn": (20.0, None),
    "vector": (50.0, 150.0),
    "vector_filter": (50.0, 150.0),
    "text": (50.0, 150.0),
    "lookup_100": (50.0, 150.0),
}
RECALL_TARGET = 0.95
LABELS = {
    "memtable_knn": "memtable kNN (exact, memtable only)",
    "vector": "merged vector",
    "vector_filter": "merged vector + filter (n < 500)",
    "text": "merged text (2 terms)",
    "lookup_100": "merged lookup, 100 keys",
    "lance_base_vector": "Lance on the base: vector",
    "lance_base_vector_filter": "Lance on the base: vector + filter",
    "lance_base_text": "Lance on the base: text",
    "lance_base_lookup_100": "Lance on the base: lookup 100 keys",
    "lance_lsm_planner_vector": "pylance LsmVectorSearchPlanner (base)",
}


def verdict(name: str, stats: dict[str, float]) -> str:
    if name not in TARGETS:
        return ""
    p50, p99 = TARGETS[name]
    parts = [f"p50 <= {p50:g}: {'met' if stats['p50_ms'] <= p50 else 'MISSED'}"]
    if p99 is not None:
        parts.append(f"p99 <= {p99:g}: {'met' if stats['p99_ms'] <= p99 else 'MISSED'}")
    return "; ".join(parts)


def table_lines(results: dict[str, Any]) -> list[str]:
    lines = [f"{'query (k = 10)':<42}{'p50 ms':>9}{'p99 ms':>9}   target"]
    for name, stats in results.items():
        label = LABELS.get(name, name)
        if isinstance(stats, dict):
            p50, p99 = stats["p50_ms"], stats["p99_ms"]
            note = verdict(name, stats)
            if "runs" in stats:
                extra = f"{stats['runs']} runs, {stats['timed_out']} timed out"
                note = f"{note}; {extra}" if note else extra
            lines.append(f"{label:<42}{p50:>9.1f}{p99:>9.1f}   {note}")
        else:
            lines.append(f"{label:<42}{stats}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-rows", type=int, default=1_000_000)
    parser.add_argument("--memtable-rows", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=100, help="timed queries per kind")
    parser.add_argument(
        "--ingest-seconds",
        type=float,
        default=60.0,
        help="queries are timed in rotation under ingestion for this long",
    )
    parser.add_argument(
        "--query-timeout-s",
        type=float,
        default=1.0,
        help="under ingestion, a query slower than this counts as a miss at this value",
    )
    parser.add_argument("--probe-s", type=float, default=10.0, help="max-rate probe length")
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="ingestion rate in rows/s (default: half the sink's max rate for these rows)",
    )
    parser.add_argument(
        "--slice-s",
        type=float,
        default=10.0,
        help="under ingestion, lance-sink's queries and Lance's take turns of this length",
    )
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=10.0,
        help="ingestion (and maintenance) runs this long before queries are timed",
    )
    parser.add_argument(
        "--maintenance",
        choices=("process", "thread"),
        default="process",
        help="run maintenance in a child process (the sink's default) or in threads of the "
        "bench process (maintenance.process = false)",
    )
    parser.add_argument(
        "--maintenance-nice", type=int, default=None, help="maintenance.nice (default: its default)"
    )
    parser.add_argument("--workdir", default="/tmp/lance-sink-bench")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument(
        "--processes",
        type=int,
        choices=(1, 3),
        default=1,
        help="3: fan-out across three processes against one holding every shard "
        "(bench.fanout; uses --base-rows, --memtable-rows, --runs, --rate, --workdir, --out)",
    )
    args = parser.parse_args()
    if args.processes == 3:
        if args.rate is None:
            args.rate = 0.0
        fanout.main(args)
        return
    tune_process()  # as `lance-sink run` does: the reads run in the sink's process
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    for stale in work.glob("wal-*"):  # shard WALs and manifests of a previous run
        shutil.rmtree(stale, ignore_errors=True)
    data = Data()
    report: dict[str, Any] = {"base_rows": args.base_rows, "memtable_rows": args.memtable_rows}

    # ---- memtable only (empty base): the exact faiss tier on its own.
    mem_path = work / "memonly.lance"
    shutil.rmtree(mem_path, ignore_errors=True)
    spec_m = spec_for(str(mem_path))
    table_m = BaseTable(spec_m)
    table_m.open()
    storage_m = open_storage(str(work / "wal-memonly"), fsync=True)
    flusher = Flusher(1)
    base_first = 10_000_000  # memtable offsets: disjoint from the base's
    w_m = open_writer(spec_m, table_m, storage_m, "mem", flusher, 10**9)
    for first, count in chunks(base_first, args.memtable_rows):
        put_rows(w_m, spec_m, data, first, count)
    reader_m = Reader(spec_m, table_m, lambda: [w_m], ReaderSettings(max_k=1000))
    queries = data.vectors(999_999_937, args.runs + 1)
    qi = iter(range(10**9))
    knn = interleaved(
        {"memtable_knn": lambda: reader_m.search_vector(queries[next(qi) % len(queries)], k=10)},
        args.runs,
    )
    report["memtable_knn"] = summary(knn["memtable_knn"])
    w_m.close(flush=False)
    print("memtable_knn", report["memtable_knn"], flush=True)

    # ---- merged: indexed base + a 100k-row active memtable.
    base_path = work / f"base-{args.base_rows}.lance"
    spec = spec_for(str(base_path))
    started = time.monotonic()
    report["base_build"] = build_base(base_path, spec, data, args.base_rows)
    print("base", report["base_build"], round(time.monotonic() - started, 1), "s", flush=True)
    table = BaseTable(spec)
    table.open()
    storage = open_storage(str(work / "wal-merged"), fsync=True)  # one WAL root, like the sink
    writer = open_writer(spec, table, storage, "merged", flusher, 10**9)
    for first, count in chunks(base_first, args.memtable_rows):
        put_rows(writer, spec, data, first, count)
    writers = [writer]
    settings = ReaderSettings(nprobes=20, refine_factor=None, max_k=1000)
    reader = Reader(spec, table, lambda: list(writers), settings)
    rng = np.random.default_rng(5)

    def vq() -> np.ndarray:
        q: np.ndarray = queries[int(rng.integers(0, len(queries)))]
        return q

    word = iter(f"w{i % 200} w{(i * 7) % 900}" for i in range(10**9))
    keys = [f"id{int(k)}" for k in rng.integers(0, args.base_rows, 90)] + [
        f"id{base_first + int(k)}" for k in rng.integers(0, args.memtable_rows, 10)
    ]
    kinds: dict[str, Callable[[], Any]] = {
        "vector": lambda: reader.search_vector(vq(), k=10, columns=["id"]),
        "vector_filter": lambda: reader.search_vector(vq(), k=10, filter="n < 500", columns=["id"]),
        "text": lambda: reader.search_text(next(word), k=10, columns=["id"]),
        "lookup_100": lambda: reader.lookup(keys, columns=["id", "n"]),
    }

    # Yardsticks: Lance's own search on the base alone, on its latest version (opened per
    # query with one shared session, as the reader does).
    session: list[Any] = []

    def base_ds() -> lance.LanceDataset:
        ds = lance.dataset(str(base_path), session=session[0] if session else None)
        if not session:
            session.append(ds.session())
        return ds

    nearest = {"column": "vec", "k": 10, "nprobes": 20, "refine_factor": 10}
    yard: dict[str, Callable[[], Any]] = {
        "lance_base_vector": lambda: base_ds().to_table(
            nearest={**nearest, "q": vq()}, columns=["id", "_distance"]
        ),
        "lance_base_vector_filter": lambda: base_ds().to_table(
            nearest={**nearest, "q": vq()},
            filter="n < 500",
            prefilter=True,
            columns=["id", "_distance"],
        ),
        "lance_base_text": lambda: base_ds().to_table(
            full_text_query=next(word), columns=["id", "_score"], limit=10
        ),
        "lance_base_lookup_100": lambda: base_ds().to_table(
            filter=pc.field("id").isin(keys), columns=["id", "n"]
        ),
    }
    planner_yard: dict[str, Callable[[], Any]] = {}
    try:
        planner = lance.LsmVectorSearchPlanner(
            base_ds(), [], "vec", pk_columns=["id"], distance_type="l2"
        )
        planner_yard["lance_lsm_planner_vector"] = lambda: planner.plan_search(
            pa.array(vq()), k=10, nprobes=20, columns=["id"]
        ).to_table()
    except Exception as exc:
        report["lance_lsm_planner_vector"] = f"not applicable: {exc}"

    idle = interleaved({**kinds, **yard, **planner_yard}, args.runs)
    report["idle"] = {name: summary(samples) for name, samples in idle.items()}
    for name, stats in report["idle"].items():
        print("idle", name, stats, flush=True)

    # ---- recall@10 of the merged query against an exact oracle over base + memtable.
    n_queries = 30
    base_vec = np.concatenate(
        [
            data.vectors(first, min(CHUNK, args.base_rows - first))
            for first in range(0, args.base_rows, CHUNK)
        ]
    )
    mem_vec = np.concatenate(
        [data.vectors(first, count) for first, count in chunks(base_first, args.memtable_rows)]
    )
    oracle = faiss.IndexFlatL2(DIM)
    oracle.add(base_vec)
    oracle.add(mem_vec)
    del base_vec, mem_vec
    ids = [f"id{i}" for i in range(args.base_rows)] + [
        f"id{base_first + i}" for i in range(args.memtable_rows)
    ]
    recalls: dict[str, list[float]] = {"refine_factor_1": [], "refine_factor_10_default": []}
    for q in queries[:n_queries]:
        _, truth = oracle.search(q.reshape(1, -1), 10)
        want = [ids[int(t)] for t in truth[0]]
        got = reader.search_vector(q, k=10, columns=["id"], refine_factor=1)
        recalls["refine_factor_1"].append(recall(got.column("id").to_pylist(), want))
        got = reader.search_vector(q, k=10, columns=["id"], refine_factor=10)
        recalls["refine_factor_10_default"].append(recall(got.column("id").to_pylist(), want))
    del oracle, ids
    report["recall_at_10"] = {k: round(float(np.mean(v)), 4) for k, v in recalls.items()}
    print("recall", report["recall_at_10"], flush=True)

    # ---- the max put rate: one synchronous producer of 500-row batches (the ingestion
    # phase's own producer) into a writer configured like the ingesting one, flushing
    # 100k-row memtables into a table of its own (so the measured base is left alone).
    prebuilt = [data.batch(spec, 40_000_000 + i * 500, 500) for i in range(20)]
    probe_writer = open_writer(spec_m, table_m, storage_m, "probe", flusher, args.memtable_rows)
    probe = Producer(probe_writer, prebuilt, 20_000_000, None)
    probe.start()
    time.sleep(args.probe_s)
    max_rate = probe.stop()
    probe_writer.close(flush=False)
    report["max_put_rows_per_s"] = round(max_rate)
    report["probe_s"] = args.probe_s
    print("max put rate", report["max_put_rows_per_s"], flush=True)

    # ---- under ingestion at half the sink's max rate, with maintenance running as the sink
    # runs it (engine.maintenance with the default settings and cadence, plus the filter
    # column's index), on a second shard, for a fixed time.
    rows_before = table.dataset().count_rows()
    maint_log = MaintenanceLog()
    maint_settings = MaintenanceSettings(
        scalar_indexes=SCALAR_INDEXES,
        process=args.maintenance == "process",
        **({} if args.maintenance_nice is None else {"nice": args.maintenance_nice}),
    )
    maintenance: Maintenance | MaintenanceProcess = (
        MaintenanceProcess(spec, storage.uri, maint_settings, maint_log)
        if maint_settings.process
        else Maintenance(spec, table, storage, maint_settings, maint_log)
    )
    ingest = open_writer(spec, table, storage, "ingest", flusher, args.memtable_rows)
    writers.append(ingest)
    target_rate = args.rate if args.rate is not None else HALF_SINK_MAX_RATE
    producer = Producer(ingest, prebuilt, 30_000_000, target_rate)
    rotation = TimedRotation({**kinds, **yard}, args.query_timeout_s)
    monitor = Monitor(table, producer, rotation, reader)
    maintenance.start()
    producer.start()
    monitor.start()
    try:
        time.sleep(args.warmup_s)
        backlog_start = monitor.unindexed()
        rotation.run(args.ingest_seconds, [list(kinds), list(yard)], args.slice_s)
        backlog_end = monitor.unindexed()
    finally:
        monitor.stop()
        rate = producer.stop()
        stopping = time.monotonic()
        maintenance.stop(timeout=30)
        # A task that outlived stop's bound: still running (threads) or killed (process).
        maintenance_overran = time.monotonic() - stopping >= 30
    ingest.close(flush=False)
    writers.remove(ingest)
    for w in writers:
        w.close(flush=False)
    reader.close()
    flusher.shutdown()
    report["ingesting"] = {
        name: {**summary(samples), "timed_out": rotation.timeouts[name], "runs": len(samples)}
        for name, samples in rotation.samples.items()
    }
    report["ingest"] = {
        "target_rows_per_s": round(target_rate),
        "rate_given": args.rate is not None,
        "achieved_rows_per_s": round(rate),
        "warmup_s": args.warmup_s,
        "measured_s": round(rotation.elapsed_s, 1),
        "slice_s": args.slice_s,
        "query_timeout_s": args.query_timeout_s,
        "base_rows_before": rows_before,
        "base_rows_after": table.dataset().count_rows(),
        "unindexed_at_start": backlog_start,
        "unindexed_at_end": backlog_end,
        "unindexed_max": monitor.max_unindexed(),
        "stragglers_at_end": rotation.running(),
        "held": monitor.held(),
        "maintenance": maint_log.summary(),
        "maintenance_overran": maintenance_overran,
        "maintenance_settings": maint_settings.model_dump(),
    }
    for name, stats in report["ingesting"].items():
        print("ingesting", name, stats, flush=True)

    lines = render(report, args.runs)
    print("\n".join(lines))
    print(json.dumps(report, indent=2, default=str))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


#: Queries at least this slow under ingestion are printed with the time they ended (to line
#: them up with the flushes and maintenance tasks logged around them).
SLOW_MS = 150.0


class TimedRotation:
    """Times every kind in rotation for a fixed time; each call runs on a daemon thread of
    its own and is waited for at most `timeout_s` (a slower call counts as `timeout_s`, is
    counted in `timeouts`, and finishes in the background: one slow query cannot stall the
    phase)."""

    def __init__(self, kinds: dict[str, Callable[[], Any]], timeout_s: float) -> None:
        self.kinds = kinds
        self.timeout_s = timeout_s
        self.samples: dict[str, list[float]] = {name: [] for name in kinds}
        self.timeouts = dict.fromkeys(kinds, 0)
        self.done = 0
        self.elapsed_s = 0.0
        self._threads: list[threading.Thread] = []

    def running(self) -> int:
        """Timed-out calls still running."""
        return sum(1 for t in self._threads if t.is_alive())

    def run(self, seconds: float, groups: list[list[str]], slice_s: float) -> None:
        """Rotate through the kinds of one group for `slice_s`, then the next group's, and
        so on for `seconds`: groups do not load each other, and base growth over the
        phase hits them alike."""
        started = time.monotonic()
        end = started + seconds
        turn = 0
        while time.monotonic() < end:
            names = groups[turn % len(groups)]
            turn += 1
            slice_end = min(end, time.monotonic() + slice_s)
            while time.monotonic() < slice_end:
                for name in names:
                    if time.monotonic() >= slice_end:
                        break
                    self.samples[name].append(self._call(name, self.kinds[name]))
                    self.done += 1
        self.elapsed_s = time.monotonic() - started

    def _call(self, name: str, fn: Callable[[], Any]) -> float:
        result: dict[str, Any] = {}
        finished = threading.Event()

        def call() -> None:
            began = time.perf_counter()
            try:
                fn()
            except BaseException as exc:  # re-raised on the timing thread
                result["error"] = exc
            result["ms"] = (time.perf_counter() - began) * 1000
            finished.set()

        thread = threading.Thread(target=call, name=f"query-{name}", daemon=True)
        thread.start()
        if not finished.wait(self.timeout_s):
            self.timeouts[name] += 1
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            return self.timeout_s * 1000
        if "error" in result:
            raise RuntimeError(f"query {name} failed") from result["error"]
        ms: float = result["ms"]
        if ms >= SLOW_MS and not name.startswith("lance_"):  # Lance's own are slow throughout
            print(f"{time.strftime('%H:%M:%S')} slow query: {name} {ms:.0f} ms", flush=True)
        return ms


class Monitor:
    """Samples the base's unindexed rows every 2 s and prints progress every ~10 s."""

    def __init__(
        self, table: BaseTable, producer: Producer, rotation: TimedRotation, reader: Reader
    ) -> None:
        self.reader = reader
        self.table = table
        self.producer = producer
        self.rotation = rotation
        self.samples: list[dict[str, int]] = []
        self.held_samples: list[dict[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)
        self._started = 0.0

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def unindexed(self) -> dict[str, int]:
        """Base rows and rows missing from the vector index and from the scalar (text, key)
        indexes, now."""
        ds = self.table.dataset()
        rows = ds.count_rows()
        vector = scalar = 0
        for index in ds.describe_indices():
            missing = max(rows - int(getattr(index, "num_rows_indexed", rows) or 0), 0)
            if "Vector" in str(getattr(index, "type_url", "")):
                vector = max(vector, missing)
            else:
                scalar = max(scalar, missing)
        return {"base_rows": rows, "vector_index": vector, "text_key_indexes": scalar}

    def cache(self) -> dict[str, int]:
        """What the reader holds of the unindexed base now, and its fallbacks so far."""
        vector, text = self.reader.unindexed, self.reader.flushed_text
        return {
            "vector_mib": 0 if vector is None else round(vector.nbytes / 2**20),
            "text_mib": 0 if text is None else round(text.nbytes / 2**20),
            "vector_fallbacks": 0 if vector is None else vector.fallbacks,
            "text_fallbacks": 0 if text is None else text.fallbacks,
            "text_refused": 0 if text is None else text.refused,
        }

    def held(self) -> dict[str, int]:
        """`cache()` now, with the bytes at their largest sample."""
        out = self.cache()
        for key in ("vector_mib", "text_mib"):
            out[key] = max([out[key], *(s[key] for s in self.held_samples)])
        return out

    def max_unindexed(self) -> dict[str, int]:
        keys = ("vector_index", "text_key_indexes")
        return {k: max((s[k] for s in self.samples), default=0) for k in keys}

    def _run(self) -> None:
        last_print = time.monotonic()
        while not self._stop.wait(2.0):
            try:
                now = self.unindexed()
            except Exception as exc:  # a failed sample is skipped
                print("progress: sample failed", exc, flush=True)
                continue
            self.samples.append(now)
            cache = self.cache()
            self.held_samples.append(cache)
            if time.monotonic() - last_print >= 10.0:
                last_print = time.monotonic()
                print(
                    f"progress {time.monotonic() - self._started:5.0f} s: ingested "
                    f"{self.producer.rows:,} rows, base {now['base_rows']:,} rows, unindexed "
                    f"{now['vector_index']:,} (vector) / {now['text_key_indexes']:,} "
                    f"(text, key), queries done {self.rotation.done} "
                    f"(timed out {sum(self.rotation.timeouts.values())}); held "
                    f"{cache['vector_mib']} MiB (vector) / {cache['text_mib']} MiB (text), "
                    f"fallbacks {cache['vector_fallbacks']} / {cache['text_fallbacks']}",
                    flush=True,
                )


def render(report: dict[str, Any], runs: int) -> list[str]:
    """The human-readable report (what `--out` writes)."""
    b = report["base_build"]
    ing = report["ingest"]
    lines = [
        (
            f"lance-sink query benchmark (python -m bench.query): k = 10, "
            f"{report['base_rows']:,}-row base + {report['memtable_rows']:,}-row memtable, "
            f"384-dim l2; {runs} queries per kind idle; under ingestion for "
            f"{ing['measured_s']} s, lance-sink's kinds in rotation and Lance's own in "
            f"rotation taking turns of {ing['slice_s']:g} s"
        ),
        (
            f"base: IVF_PQ ({b['partitions']} partitions, 48 sub-vectors), INVERTED (text), "
            "BTREE (id) and BITMAP (n, the filter column: maintenance.scalar_indexes) "
            "indexes; memtable rows put through a real shard writer"
        ),
        "",
        "## idle (nothing else running)",
        *table_lines({"memtable_knn": report["memtable_knn"], **report["idle"]}),
    ]
    if "lance_lsm_planner_vector" in report:
        lines.append(f"pylance LsmVectorSearchPlanner: {report['lance_lsm_planner_vector']}")
    rec = report["recall_at_10"]
    ok = "met" if rec["refine_factor_10_default"] >= RECALL_TARGET else "MISSED"
    lines += [
        (
            f"recall@10 of the merged vector query vs an exact oracle over all rows: "
            f"{rec['refine_factor_10_default']} (default refine factor 10; target >= "
            f"{RECALL_TARGET}: {ok}); {rec['refine_factor_1']} with refine factor 1"
        ),
    ]
    idle = report["idle"]
    if isinstance(idle.get("lance_base_vector"), dict):
        lines.append(
            "ratio merged vector / Lance base vector, p50: "
            f"{idle['vector']['p50_ms'] / idle['lance_base_vector']['p50_ms']:.2f}x"
        )
    if isinstance(idle.get("lance_lsm_planner_vector"), dict):
        lines.append(
            "ratio merged vector / LsmVectorSearchPlanner, p50: "
            f"{idle['vector']['p50_ms'] / idle['lance_lsm_planner_vector']['p50_ms']:.2f}x"
        )
    start, end, peak = ing["unindexed_at_start"], ing["unindexed_at_end"], ing["unindexed_max"]
    held = ing["held"]
    lines += [
        "",
        (
            (
                f"## under ingestion at {ing['target_rows_per_s']:,} rows/s (--rate; the max "
                f"put rate is {report['max_put_rows_per_s']:,}), maintenance running"
            )
            if ing.get("rate_given")
            else (
                f"## under ingestion at half the sink's max rate ({ing['target_rows_per_s']:,} "
                f"rows/s: bench/e2e sustains ~{2 * HALF_SINK_MAX_RATE:,} msg/s of these "
                f"vectors end to end; the engine alone puts {report['max_put_rows_per_s']:,} "
                "rows/s), maintenance running"
            )
        ),
        (
            "max rate: one synchronous producer of 500-row puts (each waits for its durable WAL "
            f"entry), {report['memtable_rows']:,}-row memtables flushing, "
            f"for {report['probe_s']:g} s"
        ),
        (
            f"achieved {ing['achieved_rows_per_s']:,} rows/s into a second shard; queries timed "
            f"after {ing['warmup_s']:g} s of warm-up, for {ing['measured_s']} s, each with a "
            f"{ing['query_timeout_s']:g} s deadline (a timed-out query counts as "
            f"{ing['query_timeout_s'] * 1000:g} ms); base {ing['base_rows_before']:,} -> "
            f"{ing['base_rows_after']:,} rows"
        ),
        (
            "base rows missing from the vector index / from the text and key indexes: "
            f"{start['vector_index']:,} / {start['text_key_indexes']:,} when timing started "
            f"(base {start['base_rows']:,}), {end['vector_index']:,} / "
            f"{end['text_key_indexes']:,} when it ended (base {end['base_rows']:,}), at most "
            f"{peak['vector_index']:,} / {peak['text_key_indexes']:,}"
        ),
        (
            "rows held for the unindexed base (query.unindexed_cache_bytes), at most: vector "
            f"cache {held['vector_mib']:,} MiB, flushed memtables for text {held['text_mib']:,} "
            f"MiB; queries that scanned it flat instead: vector {held['vector_fallbacks']}, "
            f"text {held['text_fallbacks']} (flushed memtables not held for room: "
            f"{held['text_refused']})"
        ),
        "maintenance (settings: "
        + ", ".join(
            f"{k}={ing['maintenance_settings'][k]}"
            for k in (
                "process",
                "nice",
                "interval_s",
                "optimize_interval_s",
                "optimize_unindexed_rows",
                "scalar_indexes",
            )
            if k in ing["maintenance_settings"]
        )
        + "): "
        + "; ".join(f"{task}: {text}" for task, text in ing["maintenance"].items())
        + ("; a task still ran 30 s after the phase" if ing["maintenance_overran"] else ""),
        *table_lines(report["ingesting"]),
    ]
    loaded = report["ingesting"]
    if isinstance(loaded.get("lance_base_vector"), dict):
        lines.append(
            "ratio merged vector / Lance base vector, p50: "
            f"{loaded['vector']['p50_ms'] / loaded['lance_base_vector']['p50_ms']:.2f}x"
        )
    missed = [
        f"{phase} {LABELS[name]}"
        for phase, results in (
            ("idle", {"memtable_knn": report["memtable_knn"], **idle}),
            ("ingesting", loaded),
        )
        for name, stats in results.items()
        if isinstance(stats, dict) and "MISSED" in verdict(name, stats)
    ]
    lines += ["", "targets missed: " + (", ".join(missed) if missed else "none")]
    return lines


if __name__ == "__main__":
    main()
