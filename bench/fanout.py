"""Fan-out query latency: the same queries to one process holding every shard, and to one of
three processes holding one shard each (the other two shards' memtable rows come over HTTP),
same data, same run, interleaved query by query.

Run: ``python -m bench.query --processes 3 [--base-rows 1000000] [--memtable-rows 100000]
[--runs 100] [--rate 0] [--out bench/results/query-fanout.txt]`` (or ``python -m
bench.fanout`` with the same options).

Set-up: the indexed base of `bench.query` (cached under ``--workdir``), and
``--memtable-rows`` fresh rows split over three shards (one memtable each, never flushed
while idle). Four child processes serve the query API on 127.0.0.1: "single" holds all
three shards (WAL root ``wal-fanout-single``), "pod-0".."pod-2" one shard each (WAL root
``wal-fanout-pods``, each advertising its URL in the shard manifests, as the chart does).
The parent times HTTP requests (JSON, the same body) to "single" and to "pod-0", one after
the other for every query, so both see the same machine load. With ``--rate`` > 0, every
pod (and "single", on its first shard) also ingests that many rows/s into its shard(s)
while the queries are timed (memtables then seal and flush at ``--memtable-rows`` / 3 rows,
so the base grows and both sides pay the same flushes).

Target (issue 20): fan-out adds at most 10 ms at p50 and at most 2x at p99, idle.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import urllib3

from bench.query_data import Data, build_base, put_rows, spec_for
from config.settings import BackpressureSettings, QuerySettings
from engine.backpressure import BlockingValve
from engine.memtable import SealLimits
from engine.reader import Fanout, Reader, ReaderSettings
from engine.reads.owners import ShardOwners
from engine.shard import Flusher, ShardWriter, WriterConfig
from engine.storage import open_storage
from engine.table import BaseTable
from sink.cli import tune_process
from sink.http import create_query_app, run_server

SHARDS = 3
MEMTABLE_FIRST = 10_000_000  # fresh rows' offsets: disjoint from the base's


def _pod(
    table_uri: str,
    wal_uri: str,
    shards: list[int],
    rows_per_shard: int,
    advertise: bool,
    rate: float,
    ready: Any,
    stop: Any,
) -> None:
    """A child process: shard writers for `shards`, a Reader with fan-out, the query API."""

    tune_process()
    data = Data()
    spec = spec_for(table_uri)
    table = BaseTable(spec)
    table.open()
    storage = open_storage(wal_uri, fsync=True)
    flusher = Flusher(1)
    writers: list[ShardWriter] = []
    settings = QuerySettings(host="127.0.0.1", port=0, max_k=1000)
    fanout = Fanout(ShardOwners(storage, 2.0), "", settings.fanout_timeout_ms / 1000, None, 16)
    reader = Reader(spec, table, lambda: list(writers), ReaderSettings(max_k=1000), fanout=fanout)
    server = run_server(create_query_app(reader, settings), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}"
    fanout.self_url = url
    # As `bench.query.open_writer`, plus the advertised URL the claim records.
    config = WriterConfig(
        limits=SealLimits(max_rows=rows_per_shard, max_bytes=8 << 30, max_batches=100_000),
        max_wal_flush_interval_s=0.005,
        advertised_url=url if advertise else "",
    )
    valve = BlockingValve(int(BackpressureSettings().max_unflushed_memtable_bytes))
    for i in shards:
        writer = ShardWriter.open(f"bench-{i}", spec, table, storage, config, valve, flusher)
        first = MEMTABLE_FIRST + i * rows_per_shard
        for start in range(first, first + rows_per_shard, 2_000):
            put_rows(writer, spec, data, start, min(2_000, first + rows_per_shard - start))
        writers.append(writer)
    ingest: list[threading.Thread] = []
    if rate > 0:
        batch_rows = 500
        offset = [MEMTABLE_FIRST + 100_000_000 * (1 + shards[0])]

        def produce() -> None:
            interval = batch_rows / rate
            next_at = time.monotonic()
            while not stop.is_set():
                put_rows(writers[0], spec, data, offset[0], batch_rows)
                offset[0] += batch_rows
                next_at += interval
                time.sleep(max(0.0, next_at - time.monotonic()))

        ingest.append(threading.Thread(target=produce, daemon=True))
    ready.put(url)
    for t in ingest:
        t.start()
    stop.wait()
    server.stop()
    reader.close()
    for w in writers:
        w.close(flush=False)
    flusher.shutdown()


def _summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(float(np.percentile(samples, 50)), 2),
        "p99_ms": round(float(np.percentile(samples, 99)), 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Set up the four processes, time the queries, return the report."""

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("wal-fanout-single", "wal-fanout-pods"):
        shutil.rmtree(work / stale, ignore_errors=True)
    data = Data()
    base_path = work / f"base-{args.base_rows}.lance"
    spec = spec_for(str(base_path))
    report: dict[str, Any] = {
        "base_rows": args.base_rows,
        "memtable_rows": args.memtable_rows,
        "rate_per_pod": args.rate,
        "base_build": build_base(base_path, spec, data, args.base_rows),
    }
    per_shard = args.memtable_rows // SHARDS
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    ready = ctx.Queue()
    procs = []
    layouts = [
        ("single", str(work / "wal-fanout-single"), list(range(SHARDS)), False),
        *[(f"pod-{i}", str(work / "wal-fanout-pods"), [i], True) for i in range(SHARDS)],
    ]
    urls: dict[str, str] = {}
    try:
        for name, wal, shards, advertise in layouts:
            proc = ctx.Process(
                target=_pod,
                args=(str(base_path), wal, shards, per_shard, advertise, args.rate, ready, stop),
                name=name,
            )
            proc.start()
            procs.append(proc)
            urls[name] = ready.get(timeout=600)  # one at a time: their set-ups do not compete
        http = urllib3.PoolManager(maxsize=4)
        rng = np.random.default_rng(5)
        queries = data.vectors(999_999_937, 200)
        fresh_keys = [f"id{MEMTABLE_FIRST + int(k)}" for k in rng.integers(0, per_shard * 3, 10)]
        keys = [f"id{int(k)}" for k in rng.integers(0, args.base_rows, 90)] + fresh_keys

        def body(kind: str, i: int) -> tuple[str, dict[str, Any]]:
            q = queries[i % len(queries)].tolist()
            if kind == "vector":
                return "/v1/search", {"vector": q, "k": 10, "columns": ["id"]}
            if kind == "vector_filter":
                return "/v1/search", {"vector": q, "k": 10, "filter": "n < 500", "columns": ["id"]}
            if kind == "text":
                return "/v1/search", {"text": f"w{i % 200} w{(i * 7) % 900}", "k": 10}
            return "/v1/lookup", {"keys": keys, "columns": ["id", "n"]}

        def timed(url: str, path: str, payload: dict[str, Any]) -> float:
            started = time.perf_counter()
            r = http.request(
                "POST",
                url + path,
                body=orjson.dumps(payload),
                headers={"Content-Type": "application/json"},
                timeout=30.0,
            )
            took = (time.perf_counter() - started) * 1000
            assert r.status == 200, r.data[:300]
            answer = json.loads(r.data)
            assert "partial" not in answer, answer.get("missing")
            return took

        kinds = ["vector", "vector_filter", "text", "lookup_100"]
        samples: dict[str, list[float]] = {
            f"{k}_{s}": [] for k in kinds for s in ("single", "fanout")
        }
        for i in range(args.runs + 1):
            for kind in kinds:
                path, payload = body(kind, i)
                single = timed(urls["single"], path, payload)
                fan = timed(urls["pod-0"], path, payload)
                if i:  # the first round warms caches
                    samples[f"{kind}_single"].append(single)
                    samples[f"{kind}_fanout"].append(fan)
        for name, values in samples.items():
            report[name] = _summary(values)
        for kind in kinds:
            s, f = report[f"{kind}_single"], report[f"{kind}_fanout"]
            report[f"{kind}_added"] = {
                "p50_ms": round(f["p50_ms"] - s["p50_ms"], 2),
                "p99_ratio": round(f["p99_ms"] / max(s["p99_ms"], 1e-9), 2),
                "meets_target": f["p50_ms"] - s["p50_ms"] <= 10 and f["p99_ms"] <= 2 * s["p99_ms"],
            }
    finally:
        stop.set()
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-rows", type=int, default=1_000_000)
    parser.add_argument("--memtable-rows", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=100, help="timed queries per kind")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="rows/s each process ingests meanwhile (0: idle)"
    )
    parser.add_argument("--workdir", default="/tmp/lance-sink-bench")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")


def main(args: argparse.Namespace | None = None) -> None:
    if args is None:
        parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        add_arguments(parser)
        args = parser.parse_args()
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
