"""Queries during a catch-up: a writer pod's own query API against a query-only process.

    python -m bench.catchup [--messages N] [--budget BYTES] [--shares 1,0.5] [--serve-cpu C]
                            [--serve-cache BYTES] [--query both|each] [--out FILE]

One run on tansu (memory storage): N pre-produced 384-dim vector JSON messages (~4 KB with
~200 chars of text) consumed from a fresh group by `lance-sink run` at its backpressure
budget, maintenance on as in production (vector, full-text and key indexes, optimising,
compacting), and beside it `lance-sink serve` on the same config (no consumer: the base,
and the writer's memtables by fan-out). For the whole catch-up (and `--after-s` beyond it)
two paced clients, one per process, each send one vector, one text and one filtered vector
query per second (k = 10; a round that overruns its second starts the next at once), and
time every query. With `--query each`, one catch-up per process instead, the other not
queried: the serve round is the topology docs/deploy.md recommends (clients query the
serve pods; the writer answers only their fan-out requests, while with both queried its
own queries, which read what its smaller cache does not hold from storage, take the CPU
its fan-out answers need).

One round per writer `query.ingest_share` in `--shares` (a fresh group and table each, the
same messages): 1 never yields to queries (the writer as it was), 0.5 is the default.

Report: per round and process the queries answered, p50, p99 and the largest latency, errors by
status, and the catch-up's duration and rate; the ratio of the query-only process's p99
to the writer's is the figure to compare (both run on this 2-core machine, so the
query-only process shares the cores but not the writer's interpreter lock; on a cluster
it runs on nodes of its own: `--serve-cpu C` pins it to CPU C and the writer to the
others, to tell its own cost from the shortage of CPU). Both processes hold at most the
budget of unindexed base rows in memory (`query.unindexed_cache_bytes`) unless
`--serve-cache` gives the query-only process its own bound (it has no memtables: a
serve pod's memory goes to that cache). Target (issue 40): p99 <= 500 ms against the
query-only process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from bench.e2e import (
    Committed,
    free_port,
    histogram,
    payloads,
    produce,
    quantile,
    scrape,
    tansu,
)
from bench.engine import DIM, WORDS
from bench.memory import sink_settings, toml

ROOT = Path(__file__).resolve().parents[1]


class PacedQueries(threading.Thread):
    """One vector, one text and one filtered vector query per second to one process."""

    def __init__(self, port: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.rng = np.random.default_rng(seed)
        self.stop = threading.Event()
        self.latencies: dict[str, list[float]] = {"vector": [], "text": [], "filtered": []}
        self.errors: dict[str, int] = {}
        self.started = time.monotonic()
        self.timeline: list[tuple[float, str, float]] = []  # (since start, kind, latency)

    def bodies(self) -> dict[str, dict[str, Any]]:
        vector = self.rng.standard_normal(DIM).astype(np.float32).tolist()
        return {
            "vector": {"vector": vector, "k": 10, "columns": ["id", "n"]},
            "text": {"text": str(self.rng.choice(WORDS)), "k": 10, "columns": ["id", "n"]},
            "filtered": {
                "vector": vector,
                "k": 10,
                "filter": f"n >= {int(self.rng.integers(0, 100_000))}",
                "columns": ["id", "n"],
            },
        }

    def run(self) -> None:
        while not self.stop.is_set():
            round_start = time.monotonic()
            for kind, body in self.bodies().items():
                self.ask(kind, body)
            self.stop.wait(max(1.0 - (time.monotonic() - round_start), 0.0))

    def ask(self, kind: str, body: dict[str, Any]) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/search",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:  # noqa: S310 - loopback
                resp.read()
            latency = time.perf_counter() - started
            self.latencies[kind].append(latency)
            self.timeline.append((time.monotonic() - latency - self.started, kind, latency))
        except urllib.error.HTTPError as exc:
            self.errors[str(exc.code)] = self.errors.get(str(exc.code), 0) + 1
        except (urllib.error.URLError, OSError) as exc:
            key = type(exc).__name__
            self.errors[key] = self.errors.get(key, 0) + 1
            time.sleep(0.2)

    def summary(self) -> dict[str, Any]:
        every = sorted(x for values in self.latencies.values() for x in values)
        if not every:
            return {"answered": 0, "errors": self.errors}
        return {
            "answered": len(every),
            "p50": statistics.median(every),
            "p99": every[min(len(every) - 1, len(every) * 99 // 100)],
            "max": every[-1],
            "by_kind_p99": {
                kind: sorted(v)[min(len(v) - 1, len(v) * 99 // 100)] if v else None
                for kind, v in self.latencies.items()
            },
            "errors": self.errors,
            "slowest": sorted(self.timeline, key=lambda t: -t[2])[:3],
        }


def start(
    command: str, config: Path, log: Path, cpus: str | None = None
) -> subprocess.Popen[bytes]:
    """`lance-sink <command>`, on the CPUs `cpus` lists (taskset's list form) if given."""
    pinned = [] if cpus is None else ["taskset", "-c", cpus]
    return subprocess.Popen(
        [*pinned, sys.executable, "-m", "sink.cli", command, "--config", str(config)],
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


def wait_listening(port: int, deadline: float) -> None:
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/openapi.json", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def catch_up(
    bootstrap: str,
    topic: str,
    messages: int,
    workdir: Path,
    args: argparse.Namespace,
    share: float,
    queried: tuple[str, ...] = ("writer", "serve"),
) -> dict[str, Any]:
    """One catch-up of `topic` by a fresh group into a fresh table, the writer at `share`
    (``query.ingest_share``), the `queried` processes queried; returns the figures."""
    settings = sink_settings(
        bootstrap, topic, str(workdir / "table.lance"), args.budget, args.budget
    )
    settings["table"]["fts_columns"] = ["text"]
    settings["query"]["ingest_share"] = share
    ports = {name: (free_port(), free_port()) for name in ("writer", "serve")}
    for name, (metrics_port, query_port) in ports.items():
        own = json.loads(json.dumps(settings))
        if name == "serve" and args.serve_cache is not None:
            own["query"]["unindexed_cache_bytes"] = args.serve_cache
        (workdir / f"{name}.toml").write_text(toml(own, metrics_port, query_port))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        started = time.monotonic()
        serve_cpu = args.serve_cpu
        others = None
        if serve_cpu is not None:
            others = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)) if c != serve_cpu)
        procs.append(start("run", workdir / "writer.toml", workdir / "writer.log", others))
        procs.append(
            start(
                "serve",
                workdir / "serve.toml",
                workdir / "serve.log",
                None if serve_cpu is None else str(serve_cpu),
            )
        )
        deadline = started + args.timeout
        for _, query_port in ports.values():
            wait_listening(query_port, deadline)
        clients = {
            name: PacedQueries(query_port, seed)
            for seed, (name, (_, query_port)) in enumerate(ports.items())
            if name in queried
        }
        for client in clients.values():
            client.start()
        committed = Committed(bootstrap, settings["kafka"]["group_id"], topic)
        first = time.monotonic()
        while committed.total() < messages:
            assert all(p.poll() is None for p in procs), "a process exited"
            assert time.monotonic() < deadline, "no catch-up within the timeout"
            time.sleep(0.5)
        caught_up = time.monotonic() - first
        time.sleep(args.after_s)
        for client in clients.values():
            client.stop.set()
            client.join(120)
        committed.close()
        paused = metric(ports["writer"][0], "lance_sink_ingest_paused_seconds_total")
        fallbacks = {
            name: {
                kind: metric(
                    metrics_port, f'lance_sink_query_unindexed_fallbacks_total{{kind="{kind}"}}'
                )
                for kind in ("vector", "text")
            }
            for name, (metrics_port, _) in ports.items()
            if name in queried
        }
        fresh = histogram(scrape(ports["writer"][0]), "lance_sink_query_seconds", ',kind="fresh"')
        stale = metric(ports["serve"][0], "lance_sink_query_fanout_stale_base_total")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(120)
    return {
        "seconds": caught_up,
        "paused": paused,
        "fallbacks": fallbacks,
        "fresh": fresh,
        "stale": stale,
        "summaries": {name: client.summary() for name, client in clients.items()},
    }


def serve_cache(args: argparse.Namespace) -> str:
    """How the report names serve's own unindexed cache bound, if one was given."""
    cache = args.serve_cache
    return "" if cache is None else f" (serve's unindexed cache {cache >> 20} MiB)"


def metric(port: int, name: str) -> float:
    """One sample of a process's /metrics, `name` with its labels if it has any (0 when none)."""
    for line in scrape(port).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def fresh_line(fresh: list[tuple[float, float]], stale: float) -> str:
    """What the writer's answers to serve's fan-out requests took (`fresh`: the buckets of
    its `query_seconds{kind="fresh"}`), and how often serve ran a query again because the
    writer had flushed past its base version."""
    count = fresh[-1][1] if fresh else 0.0
    if not count:
        return f"{'':>8}the writer answered no fan-out request; serve ran {stale:.0f} again"
    at_most = dict(fresh)
    over = {le: count - at_most.get(le, count) for le in (0.25, 0.5, 1.0)}
    return (
        f"{'':>8}the writer answered {count:.0f} fan-out requests, p50 "
        f"{quantile(fresh, 0.5) * 1000:.0f} ms, p99 {quantile(fresh, 0.99) * 1000:.0f} ms "
        f"(from the buckets), over 250 ms {over[0.25]:.0f}, over 500 ms {over[0.5]:.0f}, over "
        f"1 s {over[1.0]:.0f}; serve ran {stale:.0f} queries again on a newer base (the "
        "writer had flushed past theirs)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--budget", type=int, default=256 << 20)
    parser.add_argument(
        "--serve-cache",
        type=int,
        default=None,
        help="serve's query.unindexed_cache_bytes (default: the budget, as the writer's)",
    )
    parser.add_argument("--after-s", type=float, default=10.0, help="queries after lag 0")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument(
        "--shares",
        default="1,0.5",
        help="the writer's query.ingest_share of each round (1: never yields to queries)",
    )
    parser.add_argument(
        "--serve-cpu",
        type=int,
        default=None,
        help="pin the query-only process to this CPU and the writer to the others, as if "
        "each had a node of its own (tansu and the clients are not pinned)",
    )
    parser.add_argument(
        "--query",
        choices=("both", "each"),
        default="both",
        help="both: the two processes queried during one catch-up; each: one catch-up per "
        "process, the other not queried (the topology docs/deploy.md recommends: clients "
        "query the serve pods, the writer answers only their fan-out requests)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lines: list[str] = []

    def report(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    broker, bootstrap = tansu()
    try:
        topic = f"catchup-{uuid.uuid4().hex[:6]}"
        values = payloads("vector", args.messages)
        size = statistics.mean(len(v) for v in values[:1000])
        produce(bootstrap, topic, values)
        del values
        p99s: dict[str, float] = {}
        rounds = [
            (float(x), queried)
            for x in args.shares.split(",")
            for queried in (
                [("writer", "serve")] if args.query == "both" else [("serve",), ("writer",)]
            )
        ]
        for share, queried in rounds:
            workdir = Path(tempfile.mkdtemp(prefix="lance-sink-catchup-"))
            figures = catch_up(bootstrap, topic, args.messages, workdir, args, share, queried)
            seconds = figures["seconds"]
            who = "both processes" if len(queried) == 2 else f"{queried[0]} alone"
            report(
                f"catch-up, writer query.ingest_share = {share:g}: {args.messages:,} vector "
                f"messages of {size / 1024:.1f} KB, budget {args.budget >> 20} MiB"
                f"{serve_cache(args)}, "
                f"maintenance on: {seconds:.1f} s to lag 0 ({args.messages / seconds:,.0f} "
                f"msg/s) with {who} queried; the writer paused "
                f"{figures['paused']:.1f} s for its queries"
            )
            for name, s in figures["summaries"].items():
                if not s["answered"]:
                    report(f"{name:>6}: no query answered, errors {s['errors']}")
                    continue
                p99s[f"{name} at {share:g}"] = s["p99"]
                kinds = ", ".join(
                    f"{k} {v * 1000:.0f}" for k, v in s["by_kind_p99"].items() if v is not None
                )
                report(
                    f"{name:>6}: {s['answered']} queries answered, p50 "
                    f"{s['p50'] * 1000:.0f} ms, p99 {s['p99'] * 1000:.0f} ms (by kind: "
                    f"{kinds} ms), max {s['max'] * 1000:.0f} ms, errors {s['errors'] or 'none'}"
                )
                slowest = ", ".join(
                    f"{kind} {latency * 1000:.0f} ms at +{at:.1f} s"
                    for at, kind, latency in s["slowest"]
                )
                report(f"{'':>8}slowest (seconds after the clients started): {slowest}")
                fell = figures["fallbacks"][name]
                report(
                    f"{'':>8}queries reading unindexed base rows from storage: vector "
                    f"{fell['vector']:.0f}, text {fell['text']:.0f} times"
                )
            if "serve" in queried:
                report(fresh_line(figures["fresh"], figures["stale"]))
        baseline = p99s.get("writer at 1")
        if baseline:
            for name, p99 in p99s.items():
                report(
                    f"p99 {name} / writer at 1: {p99 / baseline:.2f}x ({p99 * 1000:.0f} ms; "
                    "target: query-only p99 <= 500 ms)"
                )
    finally:
        broker.terminate()
        broker.wait(30)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
