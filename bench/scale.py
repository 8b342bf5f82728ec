"""Cost by partition count: one `lance-sink run` process reading one topic of P partitions.

    python -m bench.scale [--partitions 8,64,256,1024] [--messages N] [--idle-s S]
                          [--compare ROOT] [--by-topic] [--max-age-s S]
                          [--s3-latency-ms MS] [--processes 2,4] [--out FILE]

One tansu broker (memory storage) for the whole run. For each partition count P, a topic of
P partitions gets N small vector messages (16-dim JSON vectors, ~200 B), spread evenly;
`lance-sink run` (query API on, maintenance off: its child process is not what is measured)
consumes them from a fresh group. Measured on the sink process (not its children):

- catch-up: N / (seconds from the first durable row to every offset committed), and the
  seconds from the process start to the first durable row (the group join and the opening
  of P shards);
- then, with nothing to consume, after `--settle-s`: the threads (`/proc/PID/status`), the
  CPU it uses over `--idle-s` seconds (% of one core, utime + stime of `/proc/PID/stat`),
  its RSS, the number of series `/metrics` exposes, and how long two scrapes in a row take
  (the first sets every partition's gauges, the second only changed ones).

Lance flush commits: the table versions the run made (`commits`, from the first durable
row to the end of the idle window) and the most made in any one second (`peak/s`, the table
version sampled every 0.1 s). With the default `memtable.max_age_s` (300 s) small runs
flush nothing; `--max-age-s S` seals every partition's memtable S seconds after its first
row, so every partition flushes during the run (the flush round `flush.max_commits_per_s`
paces).

Then the drain: SIGTERM with every partition's memtable holding rows (unless `--max-age-s`
flushed them), the seconds until the process exited (`drain s`, against
`shutdown.drain_deadline_s`, 30 s) and the Lance commits it made (`drain commits`); every
row must then be in the table. With `--s3-latency-ms MS` the table and its WAL are on a
moto S3 server behind a proxy that holds each request MS ms (`bench.s3_latency`).

With `--compare ROOT` (another checkout, e.g. a worktree of main), every partition count
runs there too, right before this checkout's, so the two columns of each row share the
machine's state. With `--by-topic`, this checkout runs once more per partition count with
`observability.partition_metrics = "topic"` (row `topic`). With `--processes 2,4`, after
the single-process rows, each partition count runs with that many processes of one group
started together (`group_run`: the seconds until every partition is ACTIVE in exactly one
of them, idle CPU summed over them, the drain of all at once). Targets (issue #39): at 1,024
partitions idle CPU <= 5% of a core and <= 100 threads; catch-up rate at 256 partitions
>= 0.8x the rate at 8.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import confluent_kafka
import lance
import numpy as np
import orjson
from confluent_kafka.admin import AdminClient, NewTopic

from bench.e2e import cpu_split, free_port, ingested, scrape, tansu, thread_cpu
from bench.engine import WORDS
from bench.rebalance import active
from bench.s3_latency import SlowS3, slow_s3

ROOT = Path(__file__).resolve().parents[1]
DIM = 16
CLK_TCK = os.sysconf("SC_CLK_TCK")


def payloads(n: int) -> list[bytes]:
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((n, DIM), dtype=np.float32).round(5)
    out = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS, 8))[:60]
        out.append(
            orjson.dumps(
                {"id": f"v-{i:09d}", "n": i, "text": text, "vec": vectors[i]},
                option=orjson.OPT_SERIALIZE_NUMPY,
            )
        )
    return out


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        future.result(60)
    deadline = time.monotonic() + 60
    while True:
        meta = admin.list_topics(topic, timeout=10).topics.get(topic)
        if meta is not None and meta.error is None and len(meta.partitions) == partitions:
            return
        assert time.monotonic() < deadline, f"topic {topic} not ready"
        time.sleep(0.2)


def produce(bootstrap: str, topic: str, partitions: int, values: list[bytes]) -> None:
    producer = confluent_kafka.Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 1 << 20}
    )
    for i, value in enumerate(values):
        while True:
            try:
                producer.produce(topic, value=value, key=str(i).encode(), partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(600)


class Committed:
    """The group's committed offsets summed over the topic's partitions."""

    def __init__(self, bootstrap: str, group: str, topic: str, partitions: int) -> None:
        self._consumer = confluent_kafka.Consumer(
            {"bootstrap.servers": bootstrap, "group.id": group}
        )
        self._partitions = [confluent_kafka.TopicPartition(topic, p) for p in range(partitions)]

    def total(self) -> int:
        tps = self._consumer.committed(self._partitions, timeout=30)
        return sum(max(tp.offset, 0) for tp in tps)

    def close(self) -> None:
        self._consumer.close()


def write_config(
    path: Path,
    bootstrap: str,
    topic: str,
    group: str,
    uri: str,
    by_topic: bool = False,
    max_age_s: int | None = None,
    storage_options: dict[str, str] | None = None,
) -> int:
    port = free_port()
    lines = [
        "[kafka]",
        f'bootstrap_servers = "{bootstrap}"',
        f'group_id = "{group}"',
        f'topics = ["{topic}"]',
        "session_timeout_ms = 10000",
        "[backpressure]",
        'process_budget_bytes = "1GiB"',
        "[query]",
        'host = "127.0.0.1"',
        f"port = {free_port()}",
        "[maintenance]",
        "enabled = false",
        "[observability]",
        f"metrics_port = {port}",
        'log_format = "json"',
        'log_level = "info"',  # the drain's steps are read from the log
        *(['partition_metrics = "topic"'] if by_topic else []),
        *(["[memtable]", f"max_age_s = {max_age_s}"] if max_age_s is not None else []),
        "[table]",
        f'uri = "{uri}"',
        (
            'columns = [{ name = "id", type = "string", nullable = false }, '
            '{ name = "n", type = "int64", nullable = true }, '
            '{ name = "text", type = "string", nullable = true }]'
        ),
        f'vector = {{ column = "vec", dim = {DIM}, metric = "l2" }}',
    ]
    if storage_options:
        lines.append("[table.storage_options]")
        lines.extend(f'{k} = "{v}"' for k, v in storage_options.items())
    path.write_text("\n".join(lines) + "\n")
    return port


def proc_stat(pid: int) -> tuple[float, int, int]:
    """(CPU seconds used, threads, RSS bytes) of process `pid` (not its children)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    values = {line.split(":")[0]: line.split(":")[1].strip() for line in status if ":" in line}
    return cpu, int(values["Threads"]), int(values["VmRSS"].split()[0]) * 1024


def scrape_slowly(port: int) -> str:
    """/metrics with a long timeout: at 1,024 partitions (37,000 series, and on main 1,000
    WAL threads) one exposition took longer than bench.e2e's 5 s."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=120) as r:
        return str(r.read().decode())


def series(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


class Versions:
    """Samples the table's version every 0.1 s (on a thread) to count Lance commits."""

    def __init__(self, uri: str, storage_options: dict[str, str] | None = None) -> None:
        self.uri = uri
        self.storage_options = storage_options
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                version = int(lance.dataset(self.uri, storage_options=self.storage_options).version)
            except (ValueError, OSError):
                continue  # not created yet
            self.samples.append((time.monotonic(), version))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def commits(self, since: float) -> tuple[int, int]:
        """(versions made since `since`, the most made in any one second)."""
        rows = [(t, v) for t, v in self.samples if t >= since] or self.samples[-1:]
        if not rows:
            return 0, 0
        before = [v for t, v in self.samples if t < since]
        start = before[-1] if before else 1  # version 1: the empty table of the create
        peak = 0
        for i, (t, _v) in enumerate(rows):
            later = [w for u, w in rows[i:] if u <= t + 1.0]
            prev = rows[i - 1][1] if i else start
            peak = max(peak, later[-1] - prev)
        return rows[-1][1] - start, peak


def one_run(
    root: Path,
    bootstrap: str,
    partitions: int,
    messages: int,
    args: argparse.Namespace,
    by_topic: bool = False,
    s3: SlowS3 | None = None,
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"lance-sink-scale-{partitions}-"))
    topic = f"scale-{partitions}-{uuid.uuid4().hex[:6]}"
    group = f"scale-{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, topic, partitions)
    produce(bootstrap, topic, partitions, payloads(messages))
    config = workdir / "sink.toml"
    options = s3.storage_options if s3 is not None else None
    uri = f"s3://{s3.bucket}/{topic}.lance" if s3 is not None else str(workdir / "t.lance")
    port = write_config(config, bootstrap, topic, group, uri, by_topic, args.max_age_s, options)
    versions = Versions(uri, options)
    log = (workdir / "sink.log").open("wb")
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sink.cli", "run", "--config", str(config)],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    committed = Committed(bootstrap, group, topic, partitions)
    first: float | None = None
    try:
        deadline = started + args.timeout
        while True:
            assert proc.poll() is None, (workdir / "sink.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no catch-up within the timeout"
            if first is None:
                try:
                    if ingested(scrape(port)) > 0:
                        first = time.monotonic()
                except (urllib.error.URLError, OSError):
                    pass
            elif committed.total() >= messages:
                break
            time.sleep(0.05)
        done = time.monotonic()
        time.sleep(args.settle_s)
        cpu0, _, _ = proc_stat(proc.pid)
        split0 = thread_cpu(proc.pid)
        t0 = time.monotonic()
        time.sleep(args.idle_s)
        cpu1, threads, rss = proc_stat(proc.pid)
        seconds = time.monotonic() - t0
        idle_cpu = (cpu1 - cpu0) / seconds * 100
        split = cpu_split(split0, thread_cpu(proc.pid), seconds)
        t1 = time.monotonic()
        metrics = series(scrape_slowly(port))
        t2 = time.monotonic()
        scrape_slowly(port)
        t3 = time.monotonic()
        versions.stop()
        commits, peak = versions.commits(first)
        # The drain: every partition's memtable flushed (they hold rows unless
        # --max-age-s flushed them), within shutdown.drain_deadline_s (30 s).
        before = int(lance.dataset(uri, storage_options=options).version)
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(300)
        drain_s = time.monotonic() - stopping
        assert code == 0, (workdir / "sink.log").read_text()[-3000:]
        table = lance.dataset(uri, storage_options=options)
        assert table.count_rows() == messages, (table.count_rows(), messages)
        return {
            "drain_steps": drain_steps(workdir / "sink.log"),
            "drain_s": drain_s,
            "drain_commits": int(table.version) - before,
            "commits": commits,
            "commits_peak": peak,
            "partitions": partitions,
            "threads": threads,
            "idle_cpu_pct": idle_cpu,
            "rss_mib": rss / (1 << 20),
            "series": metrics,
            "scrape_s": (t2 - t1, t3 - t2),
            "to_first_row_s": first - started,
            "catchup_s": done - first,
            "rate": messages / (done - first),
            "idle_split": split,
        }
    finally:
        versions.stop()
        committed.close()
        stop_all([proc])


def group_run(
    root: Path,
    bootstrap: str,
    partitions: int,
    messages: int,
    processes: int,
    args: argparse.Namespace,
    s3: SlowS3 | None = None,
) -> dict[str, Any]:
    """`processes` `lance-sink run` processes of one group, started together, on one topic
    of `partitions` partitions: seconds from their start until every partition is ACTIVE
    in exactly one of them, each holds one at least and every /readyz answers 200
    (`ready s`; /readyz alone is ready on an empty assignment), the catch-up rate, then
    idle: CPU summed over them, the most threads and RSS of one; then the drain of all of
    them at once."""
    workdir = Path(tempfile.mkdtemp(prefix=f"lance-sink-scale-{partitions}x{processes}-"))
    topic = f"scale-{partitions}x{processes}-{uuid.uuid4().hex[:6]}"
    group = f"scale-{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, topic, partitions)
    produce(bootstrap, topic, partitions, payloads(messages))
    options = s3.storage_options if s3 is not None else None
    uri = f"s3://{s3.bucket}/{topic}.lance" if s3 is not None else str(workdir / "t.lance")
    ports, logs = [], []
    for i in range(processes):
        config = workdir / f"sink-{i}.toml"
        ports.append(write_config(config, bootstrap, topic, group, uri, False, None, options))
        logs.append(workdir / f"sink-{i}.log")
    versions = Versions(uri, options)
    committed = Committed(bootstrap, group, topic, partitions)
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "sink.cli", "run", "--config", str(workdir / f"sink-{i}.toml")],
            cwd=root,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        for i, log in enumerate(logs)
    ]
    everything = set(range(partitions))
    first: float | None = None
    ready: float | None = None
    try:
        deadline = started + args.timeout
        while True:
            for proc, log in zip(procs, logs, strict=True):
                assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "not caught up and ready within the timeout"
            with contextlib.suppress(urllib.error.URLError, OSError, KeyError, ValueError):
                if first is None and sum(ingested(scrape(port)) for port in ports) > 0:
                    first = time.monotonic()
                if ready is None:
                    answers = [active(port) for port in ports]
                    held = [h for _, h, _ in answers]
                    if (
                        all(ok and h for ok, h, _ in answers)
                        and sum(len(h) for h in held) == partitions
                        and set().union(*held) == everything
                    ):
                        ready = time.monotonic()
            if first is not None and ready is not None and committed.total() >= messages:
                break
            time.sleep(0.1)
        done = time.monotonic()
        time.sleep(args.settle_s)
        before = [proc_stat(proc.pid) for proc in procs]
        t0 = time.monotonic()
        time.sleep(args.idle_s)
        after = [proc_stat(proc.pid) for proc in procs]
        seconds = time.monotonic() - t0
        versions.stop()
        commits, peak = versions.commits(first)
        stopping = time.monotonic()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(300) for proc in procs]
        drain_s = time.monotonic() - stopping
        assert codes == [0] * processes, (codes, logs[0].read_text()[-3000:])
        table = lance.dataset(uri, storage_options=options)
        assert table.count_rows() == messages, (table.count_rows(), messages)
        assert first is not None
        assert ready is not None
        return {
            "partitions": partitions,
            "processes": processes,
            "threads": max(a[1] for a in after),
            "idle_cpu_pct": sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
            / seconds
            * 100,
            "rss_mib": max(a[2] for a in after) / (1 << 20),
            "ready_s": ready - started,
            "to_first_row_s": first - started,
            "rate": messages / (done - first),
            "commits": commits,
            "commits_peak": peak,
            "drain_s": drain_s,
        }
    finally:
        versions.stop()
        committed.close()
        stop_all(procs)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the sink processes still running, all at once; kill one that does not stop
    within 120 s."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def drain_steps(log: Path) -> str:
    """When the drain's flush commits ended, the shards closed and the sink stopped, in
    seconds after it began draining (from the sink's log)."""
    began: datetime | None = None
    commits: list[tuple[float, int]] = []
    stopped = None
    closed: list[float] = []
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        event = orjson.loads(line)
        at = datetime.fromisoformat(str(event.get("timestamp", "")))
        if event.get("event") == "sink_draining":
            began = at
        elif began is not None and event.get("event") == "flush_committed":
            commits.append(((at - began).total_seconds(), int(event.get("shards", 1))))
        elif began is not None and event.get("event") == "shard_closed":
            closed.append((at - began).total_seconds())
        elif began is not None and event.get("event") == "sink_stopped":
            stopped = (at - began).total_seconds()
    if began is None:
        return "no drain in the log"
    rounds = ", ".join(f"{n} shards at {t:.1f} s" for t, n in commits) or "none"
    shards = f"{len(closed)} shards closed by {max(closed):.1f} s; " if closed else ""
    return f"drain: commits {rounds}; {shards}stopped at {stopped or float('nan'):.1f} s"


def fmt(r: dict[str, Any]) -> str:
    return (
        f"{r['threads']:>7} {r['idle_cpu_pct']:>8.1f} {r['rss_mib']:>7.0f} {r['series']:>7} "
        f"{r['to_first_row_s']:>7.1f} {r['rate']:>9,.0f} "
        f"{r['scrape_s'][0]:>8.2f} {r['scrape_s'][1]:>8.2f} "
        f"{r['commits']:>7} {r['commits_peak']:>6} {r['drain_s']:>7.1f} {r['drain_commits']:>6}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--partitions", default="8,64,256,1024")
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--compare", type=Path, default=None, help="another checkout (base)")
    parser.add_argument(
        "--by-topic", action="store_true", help='this checkout again, partition_metrics "topic"'
    )
    parser.add_argument(
        "--max-age-s", type=int, default=None, help="memtable.max_age_s: flush during the run"
    )
    parser.add_argument(
        "--s3-latency-ms",
        type=float,
        default=None,
        help="the table (and its WAL) on moto S3 behind a proxy holding each request this long",
    )
    parser.add_argument(
        "--processes",
        default=None,
        help="e.g. 2,4: then that many processes of one group per partition count, this "
        "checkout only (rows `N procs`)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    counts = [int(p) for p in args.partitions.split(",")]
    roots: list[tuple[str, Path, bool]] = [("base", args.compare, False)] if args.compare else []
    roots.append(("this", ROOT, False))
    if args.by_topic:
        roots.append(("topic", ROOT, True))
    lines: list[str] = []

    def report(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    report(
        f"bench/scale: {args.messages:,} messages of {DIM}-dim vectors per run, one "
        f"`lance-sink run`, idle measured over {args.idle_s:.0f} s after {args.settle_s:.0f} s "
        f"settling; {os.cpu_count()} CPUs"
    )
    header = (
        f"{'checkout':>8} {'parts':>6} {'threads':>7} {'idle%':>8} {'RSS MiB':>7} "
        f"{'series':>7} {'start s':>7} {'msg/s':>9} {'scrape1':>8} {'scrape2':>8} "
        f"{'commits':>7} {'peak/s':>6} {'drain s':>7} {'drain commits':>6}"
    )
    report(header)
    broker, bootstrap = tansu()
    stack = contextlib.ExitStack()
    s3 = None
    if args.s3_latency_ms is not None:
        logs = Path(tempfile.mkdtemp(prefix="lance-sink-scale-s3-"))
        s3 = stack.enter_context(slow_s3(args.s3_latency_ms, logs))
        report(f"table and WAL on moto S3, {args.s3_latency_ms:.0f} ms per request (proxy)")
    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name, _, _ in roots}
    splits: list[str] = []
    try:
        for partitions in counts:
            for name, root, by_topic in roots:
                r = one_run(root, bootstrap, partitions, args.messages, args, by_topic, s3)
                results[name][partitions] = r
                report(f"{name:>8} {partitions:>6} {fmt(r)}")
                print(f"         idle CPU by thread: {r['idle_split']}", flush=True)
                report(f"         {r['drain_steps']}")
                splits.append(f"{name:>8} {partitions:>6}: {r['idle_split']}")
        if args.processes:
            report(
                "several processes of one group (this checkout; started together): idle% "
                "summed over them, threads and RSS of the largest, ready s = every partition "
                "ACTIVE in exactly one and every /readyz 200, drain s = all SIGTERMed at once"
            )
            report(
                f"{'procs':>8} {'parts':>6} {'threads':>7} {'idle%':>8} {'RSS MiB':>7} "
                f"{'ready s':>7} {'start s':>7} {'msg/s':>9} {'commits':>7} {'peak/s':>6} "
                f"{'drain s':>7}"
            )
            for partitions in counts:
                for n in (int(p) for p in args.processes.split(",")):
                    r = group_run(ROOT, bootstrap, partitions, args.messages, n, args, s3)
                    report(
                        f"{n:>8} {partitions:>6} {r['threads']:>7} {r['idle_cpu_pct']:>8.1f} "
                        f"{r['rss_mib']:>7.0f} {r['ready_s']:>7.1f} {r['to_first_row_s']:>7.1f} "
                        f"{r['rate']:>9,.0f} {r['commits']:>7} {r['commits_peak']:>6} "
                        f"{r['drain_s']:>7.1f}"
                    )
    finally:
        broker.terminate()
        broker.wait(30)
        stack.close()
    report("idle CPU by thread group (cores):")
    for line in splits:
        report(f"    {line}")
    for name, by_count in results.items():
        if 8 in by_count and 256 in by_count:
            ratio = by_count[256]["rate"] / by_count[8]["rate"]
            report(f"{name}: catch-up rate at 256 / at 8 partitions = {ratio:.2f} (target >= 0.8)")
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
