"""Query latency of the read path: memtable kNN, merged (base + memtable) vector, filtered
vector, text and 100-key lookup queries, idle and under ingestion, with Lance's own search
on the base (and pylance's MemWAL `LsmVectorSearchPlanner` on it) as yardsticks.

Run: ``python -m bench.query [--base-rows 1000000] [--memtable-rows 100000]``.

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

from config.settings import TableSettings
from engine.backpressure import BlockingValve
from engine.memtable import SealLimits
from engine.reader import Reader, ReaderSettings, recall
from engine.schema import TableSpec
from engine.shard import Flusher, ShardWriter, WriterConfig
from engine.storage import open_storage
from engine.table import BaseTable
from engine.wal import SourceRange

DIM = 384
CENTRES = 1_000
LATENT = 16
#: Bumped whenever `Data` changes, so a cached base is rebuilt.
DATA_VERSION = 2
VOCAB = 5_000
WORDS_PER_ROW = 10
CHUNK = 100_000


def spec_for(uri: str) -> TableSpec:
    return TableSpec.from_settings(
        TableSettings.model_validate(
            {
                "uri": uri,
                "mode": "append",
                "primary_key": ["id"],
                "columns": [
                    {"name": "id", "type": "string", "nullable": False},
                    {"name": "n", "type": "int64"},
                    {"name": "text", "type": "string"},
                ],
                "vector": {"column": "vec", "dim": DIM, "metric": "l2"},
                "fts_columns": ["text"],
            }
        )
    )


class Data:
    """Deterministic rows: row i's content depends only on i."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.centres = rng.standard_normal((CENTRES, DIM)).astype(np.float32) * 2
        self.bases = rng.standard_normal((64, DIM, LATENT)).astype(np.float32) / np.sqrt(LATENT)
        ranks = np.arange(1, VOCAB + 1, dtype=np.float64)
        self.word_p = (1 / ranks) / (1 / ranks).sum()
        self.words = np.array([f"w{i}" for i in range(VOCAB)])

    def vectors(self, first: int, count: int) -> np.ndarray:
        """Cluster centre + a point of the cluster's 16-dim subspace + a little isotropic
        noise: embeddings have low intrinsic dimension, unlike isotropic Gaussian noise in
        384 dims (where all neighbours are nearly equidistant and no ANN index has recall)."""
        rng = np.random.default_rng(first + 1)
        centre = rng.integers(0, CENTRES, count)
        latent = rng.standard_normal((count, LATENT)).astype(np.float32)
        vec = self.centres[centre]
        basis = centre % len(self.bases)
        for b in range(len(self.bases)):
            rows = basis == b
            vec[rows] += latent[rows] @ self.bases[b].T
        vec += 0.05 * rng.standard_normal((count, DIM)).astype(np.float32)
        return vec.astype(np.float32)

    def batch(self, spec: TableSpec, first: int, count: int) -> pa.RecordBatch:
        rng = np.random.default_rng(first + 7)
        idx = rng.choice(VOCAB, size=(count, WORDS_PER_ROW), p=self.word_p)
        text = [" ".join(r) for r in self.words[idx]]
        offsets = np.arange(first, first + count, dtype=np.int64)
        vec = self.vectors(first, count)
        cols = {
            "id": pa.array([f"id{o}" for o in offsets]),
            "n": pa.array(offsets % 1000),
            "text": pa.array(text),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(vec.reshape(-1)), DIM),
            "_topic": pa.array(["bench"] * count),
            "_partition": pa.array(np.zeros(count, np.int32)),
            "_offset": pa.array(offsets),
        }
        schema = spec.batch_schema
        return pa.RecordBatch.from_arrays([cols[f.name] for f in schema], schema=schema)


def build_base(path: Path, spec: TableSpec, data: Data, rows: int) -> dict[str, float]:
    """Write and index the base (skipped when a cached one with `rows` rows exists)."""
    marker = path / "bench-built.json"
    cached = json.loads(marker.read_text()) if marker.exists() else {}
    if cached.get("rows") == rows and cached.get("data") == DATA_VERSION and "version" in cached:
        # Undo what a previous run's ingestion flushed: the built version becomes latest.
        if int(lance.dataset(str(path)).version) != cached["version"]:
            lance.dataset(str(path), version=cached["version"]).restore()
        return dict(cached)
    shutil.rmtree(path, ignore_errors=True)
    started = time.monotonic()
    for first in range(0, rows, CHUNK):
        count = min(CHUNK, rows - first)
        table = pa.Table.from_batches([spec.to_table_batch(data.batch(spec, first, count))])
        lance.write_dataset(
            table, str(path), mode="append" if first else "create", max_rows_per_file=CHUNK
        )
    write_s = time.monotonic() - started
    ds = lance.dataset(str(path))
    started = time.monotonic()
    partitions = max(1, min(int(np.sqrt(rows)), rows // 256, 512))
    ds.create_index("vec", "IVF_PQ", metric="l2", num_partitions=partitions, num_sub_vectors=48)
    vector_s = time.monotonic() - started
    started = time.monotonic()
    ds.create_scalar_index("text", "INVERTED", with_position=True)
    fts_s = time.monotonic() - started
    started = time.monotonic()
    ds.create_scalar_index("id", "BTREE")
    btree_s = time.monotonic() - started
    info = {
        "data": DATA_VERSION,
        "rows": rows,
        "write_s": write_s,
        "ivf_pq_s": vector_s,
        "partitions": partitions,
        "fts_s": fts_s,
        "btree_s": btree_s,
    }
    info["version"] = int(lance.dataset(str(path)).version)
    marker.write_text(json.dumps(info))
    return info


def timed(fn: Callable[[], Any], runs: int) -> list[float]:
    fn()  # warm caches (tokenised memtable text, index pages)
    out = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1000)
    return out


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(samples, q))


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(samples), 2),
        "p99_ms": round(pct(samples, 99), 2),
    }


def open_writer(
    spec: TableSpec, table: BaseTable, wal: Path, shard: str, flusher: Flusher, max_rows: int
) -> ShardWriter:
    config = WriterConfig(
        limits=SealLimits(max_rows=max_rows, max_bytes=8 << 30, max_batches=100_000),
        max_wal_flush_interval_s=0.005,
    )
    return ShardWriter.open(
        shard,
        spec,
        table,
        open_storage(str(wal), fsync=True),
        config,
        BlockingValve(1 << 40),
        flusher,
    )


def put_rows(writer: ShardWriter, spec: TableSpec, data: Data, first: int, count: int) -> None:
    batch = data.batch(spec, first, count)
    writer.put(batch, SourceRange("bench", 0, first, first + count - 1)).result(60)


def put_prebuilt(writer: ShardWriter, batch: pa.RecordBatch, first: int) -> None:
    """Put a pre-built batch under new offsets (the producer does no per-row work, so the
    measured rate is the writer's, not the data generator's)."""
    idx = batch.schema.get_field_index("_offset")
    columns = list(batch.columns)
    columns[idx] = pa.array(np.arange(first, first + batch.num_rows, dtype=np.int64))
    shifted = pa.RecordBatch.from_arrays(columns, schema=batch.schema)
    last = first + batch.num_rows - 1
    writer.put(shifted, SourceRange("bench", 0, first, last)).result(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-rows", type=int, default=1_000_000)
    parser.add_argument("--memtable-rows", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--workdir", default="/tmp/lance-sink-bench")
    args = parser.parse_args()
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
    flusher = Flusher(1)
    base_first = 10_000_000  # memtable offsets: disjoint from the base's
    w_m = open_writer(spec_m, table_m, work / "wal-memonly", "mem", flusher, 10**9)
    for first in range(base_first, base_first + args.memtable_rows, 2_000):
        put_rows(w_m, spec_m, data, first, 2_000)
    reader_m = Reader(spec_m, table_m, lambda: [w_m], ReaderSettings(max_k=1000))
    queries = data.vectors(999_999_937, args.runs + 1)
    qi = iter(range(10**9))
    report["memtable_knn"] = summary(
        timed(lambda: reader_m.search_vector(queries[next(qi) % len(queries)], k=10), args.runs)
    )
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
    writer = open_writer(spec, table, work / "wal-merged", "merged", flusher, 10**9)
    for first in range(base_first, base_first + args.memtable_rows, 2_000):
        put_rows(writer, spec, data, first, 2_000)
    writers = [writer]
    settings = ReaderSettings(nprobes=20, refine_factor=None, max_k=1000)
    reader = Reader(spec, table, lambda: list(writers), settings)
    rng = np.random.default_rng(5)

    def vq() -> np.ndarray:
        return queries[int(rng.integers(0, len(queries)))]

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
    report["merged_idle"] = {}
    for name, fn in kinds.items():
        report["merged_idle"][name] = summary(timed(fn, args.runs))
        print("merged idle", name, report["merged_idle"][name], flush=True)

    # ---- yardsticks on the base alone.
    ds = table.dataset()
    yard = {
        "lance_base_vector": lambda: ds.to_table(
            nearest={"column": "vec", "q": vq(), "k": 10, "nprobes": 20, "refine_factor": 10},
            columns=["id", "_distance"],
        ),
        "lance_base_vector_filter": lambda: ds.to_table(
            nearest={"column": "vec", "q": vq(), "k": 10, "nprobes": 20, "refine_factor": 10},
            filter="n < 500",
            prefilter=True,
            columns=["id", "_distance"],
        ),
        "lance_base_text": lambda: ds.to_table(
            full_text_query=next(word), columns=["id", "_score"], limit=10
        ),
        "lance_base_lookup_100": lambda: ds.to_table(
            filter=pc.field("id").isin(keys), columns=["id", "n"]
        ),
    }
    try:
        planner = lance.LsmVectorSearchPlanner(ds, [], "vec", pk_columns=["id"], distance_type="l2")
        yard["lance_lsm_planner_vector"] = lambda: planner.plan_search(
            pa.array(vq()), k=10, nprobes=20, columns=["id"]
        ).to_table()
    except Exception as exc:
        report["lance_lsm_planner_vector"] = f"not applicable: {exc}"
    report["yardsticks"] = {}
    for name, fn in yard.items():
        try:
            report["yardsticks"][name] = summary(timed(fn, args.runs))
        except Exception as exc:
            report["yardsticks"][name] = f"failed: {exc}"
        print("yardstick", name, report["yardsticks"][name], flush=True)

    # ---- recall@10 of the merged query against an exact oracle over base + memtable.
    n_queries = 30
    base_vec = np.concatenate(
        [
            data.vectors(first, min(CHUNK, args.base_rows - first))
            for first in range(0, args.base_rows, CHUNK)
        ]
    )
    mem_vec = np.concatenate(
        [
            data.vectors(first, 2_000)
            for first in range(base_first, base_first + args.memtable_rows, 2_000)
        ]
    )
    oracle = faiss.IndexFlatL2(DIM)
    oracle.add(base_vec)
    oracle.add(mem_vec)
    del base_vec, mem_vec
    ids = [f"id{i}" for i in range(args.base_rows)] + [
        f"id{base_first + i}" for i in range(args.memtable_rows)
    ]
    recalls: dict[str, list[float]] = {"nprobes20_refine1": [], "nprobes20_refine10": []}
    for q in queries[:n_queries]:
        _, truth = oracle.search(q.reshape(1, -1), 10)
        want = [ids[int(t)] for t in truth[0]]
        got = reader.search_vector(q, k=10, columns=["id"], refine_factor=1)
        recalls["nprobes20_refine1"].append(recall(got.column("id").to_pylist(), want))
        got = reader.search_vector(q, k=10, columns=["id"], refine_factor=10)
        recalls["nprobes20_refine10"].append(recall(got.column("id").to_pylist(), want))
    report["recall_at_10"] = {k: round(float(np.mean(v)), 4) for k, v in recalls.items()}
    report["merged_vector_refine1"] = summary(
        timed(lambda: reader.search_vector(vq(), k=10, columns=["id"], refine_factor=1), args.runs)
    )
    print("recall", report["recall_at_10"], report["merged_vector_refine1"], flush=True)

    # ---- under ingestion at about half the max put rate (a second shard of the table).
    probe = open_writer(spec_m, table_m, work / "wal-probe", "probe", flusher, 10**9)
    prebuilt = [data.batch(spec, 40_000_000 + i * 500, 500) for i in range(20)]
    started = time.monotonic()
    sent = 0
    while time.monotonic() - started < 5:
        put_prebuilt(probe, prebuilt[(sent // 500) % len(prebuilt)], 20_000_000 + sent)
        sent += 500
    max_rate = sent / (time.monotonic() - started)
    probe.close(flush=False)
    report["max_put_rows_per_s"] = round(max_rate)
    # Two rates: a sink-like one (decoding 384-float JSON costs ~40 us/row, so a 2-core pod
    # tops out near 25k rows/s: half is ~10k) and half the writer's own max put rate.
    report["merged_ingesting"] = {}
    ingest_runs = min(args.runs, 40)
    for label, target in [("10k_rows_per_s", 10_000.0), ("half_max", max_rate / 2)]:
        ingest = open_writer(
            spec,
            table,
            work / f"wal-ingest-{label}",
            f"ingest-{label}",
            flusher,
            args.memtable_rows,
        )
        writers.append(ingest)
        stop = threading.Event()
        ingested = 0

        def produce(writer: ShardWriter, rate: float, stop: threading.Event) -> None:
            nonlocal ingested
            t0 = time.monotonic()
            while not stop.is_set():
                batch = prebuilt[(ingested // 500) % len(prebuilt)]
                put_prebuilt(writer, batch, 30_000_000 + ingested)
                ingested += 500
                ahead = ingested / rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)

        thread = threading.Thread(target=produce, args=(ingest, target, stop), daemon=True)
        ingest_started = time.monotonic()
        thread.start()
        phase: dict[str, Any] = {}
        try:
            for name, fn in kinds.items():
                phase[name] = summary(timed(fn, ingest_runs))
                print("merged ingesting", label, name, phase[name], flush=True)
        finally:
            stop.set()
            thread.join(60)
        phase["ingest_rows_per_s"] = round(ingested / (time.monotonic() - ingest_started))
        phase["base_rows_after"] = table.dataset().count_rows()
        report["merged_ingesting"][label] = phase
        ingest.close(flush=False)
        writers.remove(ingest)
    for w in writers:
        w.close(flush=False)
    flusher.shutdown()

    idle = report["merged_idle"]["vector"]["p50_ms"]
    lance_base = report["yardsticks"].get("lance_base_vector")
    if isinstance(lance_base, dict):
        report["ratio_merged_vector_to_lance_base_p50"] = round(idle / lance_base["p50_ms"], 2)
    report["ratio_memtable_knn_to_merged_vector_p50"] = round(
        report["memtable_knn"]["p50_ms"] / idle, 2
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
