"""Fan-out query latency: the same queries to one process holding every shard, and to one of
three processes holding one shard each (the other two shards' memtable rows come over HTTP),
same data, same run, interleaved query by query.

Run: ``python -m bench.query --processes 3 [--base-rows 1000000] [--memtable-rows 100000]
[--runs 100] [--rate 0] [--warmup-s 10] [--out bench/results/query-fanout.txt]`` (or
``python -m bench.fanout`` with the same options).

Set-up: the indexed base of `bench.query` (cached under ``--workdir``), and
``--memtable-rows`` fresh rows split over three shards (one memtable each, never flushed
while idle). Four child processes serve the query API on 127.0.0.1: "single" holds all
three shards (WAL root ``wal-fanout-single``), "pod-0".."pod-2" one shard each (WAL root
``wal-fanout-pods``, each advertising its URL in the shard manifests, as the chart does).
The parent times HTTP requests (JSON, the same body) to "single" and to "pod-0", one after
the other for every query (who goes first alternates), so both see the same machine load.
Query kinds: vector, vector with a filter, text (BM25), hybrid (vector + text), filter only
(a scan) and a 100-key lookup.

Phases: "idle", then with ``--rate`` > 0 "ingest": every pod (and "single", on its first
shard) ingests that many rows/s into its shard(s) (memtables then seal and flush at
``--memtable-rows`` / 3 rows, so the base grows and both sides pay the same flushes), and
one maintenance process indexes the flushed rows as a sink's does; queries are timed after
``--warmup-s``. The report gives p50/p99 per kind and side, the added p50 and the p99
ratio, answers that came back partial (an owner missed `query.fanout_timeout_ms`), and the
requests pod-0 sent to owner pods by kind (a text query asks each owner once unless the
estimate of the statistics was far off, see `engine.reads.text`; a hybrid query asks each
owner once, a `parts` request carrying its vector and text parts).

Target (issue 20): fan-out adds at most 10 ms at p50 and at most 2x at p99, idle.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import urllib3

from bench.query_data import SCALAR_INDEXES, Data, build_base, put_rows, spec_for
from config.settings import BackpressureSettings, MaintenanceSettings, QuerySettings
from engine.backpressure import BlockingValve
from engine.flusher import Flusher
from engine.maintenance import MaintenanceProcess
from engine.memtable import SealLimits
from engine.reader import Fanout, Reader, ReaderSettings
from engine.reads.owners import ShardOwners
from engine.reads.remote import unpack
from engine.shard import ShardWriter, WriterConfig
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
    start_ingest: Any,
    stop: Any,
    counts: Any,
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
    # Requests to owner pods by kind (a text query asks an owner twice when the estimate of
    # the statistics was too far off: counted here, reported by the parent).
    requests: dict[str, int] = {}
    post = fanout.post

    def counted(url: str, body: bytes, timeout_s: float) -> bytes:
        kind = str(unpack(body)[1]["kind"])
        requests[kind] = requests.get(kind, 0) + 1
        return post(url, body, timeout_s)

    fanout.post = counted  # type: ignore[method-assign]
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
            while not start_ingest.wait(0.1):
                if stop.is_set():
                    return
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
    counts.put((url, requests))
    server.stop()
    reader.close()
    for w in writers:
        w.close(flush=False)
    flusher.shutdown()


class _MaintenanceCount:
    """MaintenanceEvents that counts the tasks that did something, by task and outcome."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def ran(self, task: str, outcome: str, seconds: float) -> None:
        if outcome != "skipped":
            with self._lock:
                name = f"{task} {outcome}"
                self.counts[name] = self.counts.get(name, 0) + 1

    def process_exited(self, exitcode: int | None) -> None:
        self.ran("process_exited", str(exitcode), 0.0)


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
    counts = ctx.Queue()
    ingest = ctx.Event()
    maintenance: MaintenanceProcess | None = None
    maintenance_log = _MaintenanceCount()
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
                args=(
                    str(base_path),
                    wal,
                    shards,
                    per_shard,
                    advertise,
                    args.rate,
                    ready,
                    ingest,
                    stop,
                    counts,
                ),
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

        def text(i: int) -> str:
            return f"w{i % 200} w{(i * 7) % 900}"

        def body(kind: str, i: int) -> tuple[str, dict[str, Any]]:
            q = queries[i % len(queries)].tolist()
            if kind == "vector":
                return "/v1/search", {"vector": q, "k": 10, "columns": ["id"]}
            if kind == "vector_filter":
                return "/v1/search", {"vector": q, "k": 10, "filter": "n < 500", "columns": ["id"]}
            if kind == "text":
                return "/v1/search", {"text": text(i), "k": 10}
            if kind == "hybrid":
                return "/v1/search", {"vector": q, "text": text(i), "k": 10, "columns": ["id"]}
            if kind == "filter":
                return "/v1/search", {"filter": f"n = {i % 1000}", "k": 10, "columns": ["id"]}
            return "/v1/lookup", {"keys": keys, "columns": ["id", "n"]}

        partial: dict[str, int] = {}
        errors: dict[str, int] = {}

        def timed(url: str, path: str, payload: dict[str, Any], kind: str) -> float:
            started = time.perf_counter()
            r = http.request(
                "POST",
                url + path,
                body=orjson.dumps(payload),
                headers={"Content-Type": "application/json"},
                timeout=30.0,
            )
            took = (time.perf_counter() - started) * 1000
            if r.status != 200:  # counted at the time it took (a 504 at query.timeout_ms)
                name = f"{kind} {'single' if url == urls['single'] else 'fanout'} {r.status}"
                errors[name] = errors.get(name, 0) + 1
                print("query failed", kind, url, r.data[:300], flush=True)
            elif "partial" in json.loads(r.data):  # an owner missed the fan-out deadline
                partial[kind] = partial.get(kind, 0) + 1
            return took

        kinds = ["vector", "vector_filter", "text", "hybrid", "filter", "lookup_100"]
        phases = ["idle", *(["ingest"] if args.rate > 0 else [])]
        for phase in phases:
            if phase == "ingest":
                # Maintenance as one sink process runs it (indexes the flushed rows): without
                # it every query scans the growing unindexed base flat, on both sides.
                maintenance = MaintenanceProcess(
                    spec,
                    str(work / "wal-fanout-pods"),
                    MaintenanceSettings(scalar_indexes=SCALAR_INDEXES),
                    maintenance_log,
                )
                maintenance.start()
                ingest.set()
                time.sleep(args.warmup_s)  # memtables fill, the first flushes run
            partial.clear()
            errors.clear()
            samples: dict[str, list[float]] = {
                f"{k}_{s}": [] for k in kinds for s in ("single", "fanout")
            }
            started = time.monotonic()
            for i in range(args.runs + 1):
                for kind in kinds:
                    path, payload = body(kind, i)
                    # Alternate who goes first (the second may find pages the first read).
                    order = ["single", "fanout"] if i % 2 else ["fanout", "single"]
                    took = {
                        who: timed(
                            urls["single" if who == "single" else "pod-0"], path, payload, kind
                        )
                        for who in order
                    }
                    if i:  # the first round warms caches
                        for who, ms in took.items():
                            samples[f"{kind}_{who}"].append(ms)
            result: dict[str, Any] = {"seconds": round(time.monotonic() - started, 1)}
            for kind in kinds:
                s, f = _summary(samples[f"{kind}_single"]), _summary(samples[f"{kind}_fanout"])
                result[kind] = {
                    "single": s,
                    "fanout": f,
                    "added_p50_ms": round(f["p50_ms"] - s["p50_ms"], 2),
                    "p99_ratio": round(f["p99_ms"] / max(s["p99_ms"], 1e-9), 2),
                    "meets_target": f["p50_ms"] - s["p50_ms"] <= 10
                    and f["p99_ms"] <= 2 * s["p99_ms"],
                }
            result["partial_answers"] = dict(partial)
            result["failed_queries"] = dict(errors)
            if phase == "ingest":
                result["maintenance"] = dict(sorted(maintenance_log.counts.items()))
            report[phase] = result
    finally:
        stop.set()
        if maintenance is not None:
            maintenance.stop(timeout=30)
        try:
            for _ in procs:
                url, requests = counts.get(timeout=60)
                if url == urls.get("pod-0"):
                    # Requests pod-0 sent to the 2 owner pods, by request kind, over
                    # runs + 1 queries of each query kind (hybrid sends one `parts`
                    # request; text: 2 per text query, and 2 more per text or hybrid
                    # query whose owners were asked again).
                    report["owner_requests"] = dict(sorted(requests.items()))
        except queue.Empty:
            pass
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
    parser.add_argument(
        "--warmup-s", type=float, default=10.0, help="ingestion before the ingest phase's queries"
    )
    parser.add_argument("--workdir", default="/tmp/lance-sink-bench")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")


def main(args: argparse.Namespace | None = None) -> None:
    if args is None:
        parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        add_arguments(parser)
        args = parser.parse_args()
    report = run(args)
    text = table(report) + "\n" + json.dumps(report, indent=2)
    print(text, flush=True)
    if args.out is not None:
        args.out.write_text(text + "\n")


def table(report: dict[str, Any]) -> str:
    """The report's latencies as a table per phase (the JSON follows it in the output)."""
    head = (
        f"fan-out vs one process holding every shard (python -m bench.query --processes 3): "
        f"{report['base_rows']:,}-row base, {report['memtable_rows']:,} memtable rows over "
        f"{SHARDS} shards, k = 10; ingest phase: {report['rate_per_pod']:g} rows/s per process"
    )
    lines = [head]
    for phase in ("idle", "ingest"):
        if phase not in report:
            continue
        result = report[phase]
        lines.append(f"\n## {phase} ({result['seconds']} s of queries)")
        lines.append(
            f"{'query':<14} {'single p50':>10} {'p99':>7} {'fan-out p50':>12} {'p99':>7} "
            f"{'added p50':>10} {'p99 ratio':>10}  target (<= +10 ms p50, <= 2x p99)"
        )
        for kind, v in result.items():
            if not isinstance(v, dict) or "single" not in v:
                continue
            s, f = v["single"], v["fanout"]
            lines.append(
                f"{kind:<14} {s['p50_ms']:>10.1f} {s['p99_ms']:>7.1f} {f['p50_ms']:>12.1f} "
                f"{f['p99_ms']:>7.1f} {v['added_p50_ms']:>+10.1f} {v['p99_ratio']:>9.2f}x  "
                f"{'met' if v['meets_target'] else 'missed'}"
            )
        lines.append(
            f"partial answers: {result['partial_answers'] or 'none'}; failed queries: "
            f"{result['failed_queries'] or 'none'}"
        )
    if "owner_requests" in report:
        lines.append(f"requests pod-0 sent to the owner pods, by kind: {report['owner_requests']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
