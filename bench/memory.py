"""Memory benchmark: does a pod sized by the Helm chart stay inside its memory limit?

    python -m bench.memory [--messages N] [--budget BYTES] [--cache BYTES] [--out FILE]

One run, on tansu (memory storage), of the worst case the chart must hold:

- overload: N pre-produced 384-dim vector JSON messages (~4 KB, with ~200 chars of text)
  consumed from a fresh group, so the sink runs at its backpressure budget the whole time;
- queries at the pool's limit: `query.max_concurrent_queries` clients, each sending vector
  and text queries back to back (with filters and k=10) for the whole run;
- maintenance on, as in production, building the vector, full-text and key indexes,
  optimising and compacting while the sink ingests.

Every 0.25 s it reads the proportional set size (PSS, `/proc/PID/smaps_rollup`) of the sink
and of each of its child processes (the maintenance child): the pod's memory as the kernel
counts it against the cgroup, page cache aside. It reports the peak of each process and of
their sum against the memory limit `helm template` derives for the same settings (the
chart's formula, read from the rendered Deployment), with query p50/p99 and errors.

Target (issue: the pod stays inside its memory limit): peak pod PSS <= 0.9x the limit, and
queries still answered.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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
import yaml

from bench.e2e import PARTITIONS, Committed, free_port, payloads, produce, tansu
from bench.engine import DIM, WORDS

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_S = 0.25


def smaps_bytes(pid: int, field: str = "Pss") -> int:
    """A field of `/proc/PID/smaps_rollup` in bytes (0 if the process is gone): `Pss`, the
    proportional set size, or `Anonymous`."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else 0


def children(pid: int) -> list[int]:
    """Every descendant of a process (children of any of its threads: the maintenance
    child is started from a supervisor thread)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            text = (task / "children").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for child in (int(c) for c in text.split()):
            out.append(child)
            out.extend(children(child))
    return out


def chart_limit_bytes(settings: dict[str, Any]) -> int | None:
    """The memory limit `helm template` derives for these settings (None without helm)."""
    helm = os.environ.get("LANCE_SINK_HELM") or str(ROOT / "build/tools/helm")
    if not Path(helm).exists():
        return None
    # The formula does not depend on where the table is; the chart's default (a Deployment)
    # wants object storage.
    config = json.loads(json.dumps(settings))
    config["table"]["uri"] = "s3://bench/table.lance"
    values = {"config": config}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(values, f)  # JSON is YAML with every string quoted ("n" is no boolean)
    rendered = subprocess.run(
        [helm, "template", "bench", str(ROOT / "helm/lance-sink"), "-f", f.name],
        capture_output=True,
        text=True,
        check=False,
    )
    Path(f.name).unlink()
    if rendered.returncode != 0:
        raise RuntimeError(f"helm template failed: {rendered.stderr.strip()}")
    out = rendered.stdout
    for doc in yaml.safe_load_all(out):
        if doc and doc.get("kind") in ("Deployment", "StatefulSet"):
            limit = doc["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
            return parse_quantity(str(limit["memory"]))
    return None


def parse_quantity(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


#: Gauges of the sink that account for parts of its memory, read at every sample.
PARTS = (
    "lance_sink_budget_used_bytes",
    "lance_sink_arrow_pool_bytes",
    "lance_sink_query_lance_cache_bytes",
    "lance_sink_query_unindexed_cache_bytes",
)


def gauges(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    out = {}
    for name in PARTS:
        m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        if m:
            out[name] = float(m.group(1))
    return out


class Sampler(threading.Thread):
    """Peak PSS of the sink, of its children, and of their sum, every SAMPLE_S; and the
    sink's own accounting of its memory (PARTS) at each new peak of the sink."""

    def __init__(self, pid: int, metrics_port: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.metrics_port = metrics_port
        self.stop = threading.Event()
        self.peak_sink = self.peak_children = self.peak_pod = self.peak_anon = 0
        self.parts_at_peak: dict[str, float] = {}
        self.series: list[tuple[float, int, int]] = []

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.wait(SAMPLE_S):
            sink = smaps_bytes(self.pid)
            kids = sum(smaps_bytes(c) for c in children(self.pid))
            if sink > self.peak_sink:
                self.parts_at_peak = gauges(self.metrics_port) or self.parts_at_peak
            self.peak_sink = max(self.peak_sink, sink)
            self.peak_children = max(self.peak_children, kids)
            self.peak_pod = max(self.peak_pod, sink + kids)
            self.peak_anon = max(self.peak_anon, smaps_bytes(self.pid, "Anonymous"))
            self.series.append((time.monotonic() - start, sink, kids))


class Queries(threading.Thread):
    """One client sending vector and text queries back to back until stopped."""

    def __init__(self, port: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.rng = np.random.default_rng(seed)
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.errors: dict[str, int] = {}

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            if i % 2 == 0:
                body: dict[str, Any] = {
                    "vector": self.rng.standard_normal(DIM).astype(np.float32).tolist(),
                    "k": 10,
                    "columns": ["id", "n"],
                }
            else:
                body = {"text": str(self.rng.choice(WORDS)), "k": 10, "columns": ["id", "n"]}
            if i % 3 == 0:
                body["filter"] = f"n >= {int(self.rng.integers(0, 100_000))}"
            i += 1
            request = urllib.request.Request(
                f"http://127.0.0.1:{self.port}/v1/search",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=60) as resp:  # noqa: S310 - loopback
                    resp.read()
                self.latencies.append(time.perf_counter() - started)
            except urllib.error.HTTPError as exc:
                self.errors[str(exc.code)] = self.errors.get(str(exc.code), 0) + 1
                time.sleep(0.05)
            except (urllib.error.URLError, OSError) as exc:
                key = type(exc).__name__
                self.errors[key] = self.errors.get(key, 0) + 1
                time.sleep(0.2)


def sink_settings(bootstrap: str, topic: str, uri: str, budget: int, cache: int) -> dict[str, Any]:
    """The settings under test, as the chart's `config` values (and the sink's TOML)."""
    return {
        "kafka": {
            "bootstrap_servers": bootstrap,
            "group_id": f"mem-{uuid.uuid4().hex[:6]}",
            "topics": [topic],
            "session_timeout_ms": 10000,
        },
        "backpressure": {"process_budget_bytes": budget},
        "memtable": {"max_bytes": budget // 4},
        "query": {"unindexed_cache_bytes": cache},
        "maintenance": {
            "interval_s": 10,
            "vector_index_min_rows": 50_000,
            "optimize_unindexed_rows": 20_000,
        },
        "table": {
            "uri": uri,
            "columns": [
                {"name": "id", "type": "string", "nullable": False},
                {"name": "n", "type": "int64"},
                {"name": "text", "type": "string"},
            ],
            "vector": {"column": "vec", "dim": DIM, "metric": "cosine"},
            "fts_columns": ["text"],
        },
    }


def toml(settings: dict[str, Any], metrics_port: int, query_port: int) -> str:
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return str(v).lower()
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)

    merged = json.loads(json.dumps(settings))
    merged.setdefault("query", {}).update({"port": query_port, "host": "127.0.0.1"})
    merged["observability"] = {
        "metrics_port": metrics_port,
        "log_format": "json",
        "log_level": "info",
    }
    lines = []
    for section, values in merged.items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {value(v)}" for k, v in values.items())
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--budget", type=int, default=256 << 20)
    parser.add_argument("--cache", type=int, default=256 << 20)
    parser.add_argument("--clients", type=int, default=None, help="default: the pool's size")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    lines: list[str] = []

    def report(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    workdir = Path(tempfile.mkdtemp(prefix="lance-sink-mem-"))
    broker, bootstrap = tansu()
    try:
        topic = f"mem-{uuid.uuid4().hex[:6]}"
        values = payloads("vector", args.messages)
        size = statistics.mean(len(v) for v in values[:1000])
        produce(bootstrap, topic, values)
        del values
        settings = sink_settings(
            bootstrap, topic, str(workdir / "table.lance"), args.budget, args.cache
        )
        limit = chart_limit_bytes(settings)
        metrics_port, query_port = free_port(), free_port()
        config = workdir / "sink.toml"
        config.write_text(toml(settings, metrics_port, query_port))
        log = (workdir / "sink.log").open("wb")
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "sink.cli", "run", "--config", str(config)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        sampler = Sampler(proc.pid, metrics_port)
        sampler.start()
        committed = Committed(bootstrap, settings["kafka"]["group_id"], topic)
        clients = [Queries(query_port, seed) for seed in range(args.clients or 8)]
        for c in clients:
            c.start()
        caught_up = None
        deadline = started + args.timeout
        indexed = False
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(2)
            if caught_up is None and committed.total() >= args.messages:
                caught_up = time.monotonic() - started
            if caught_up is not None:
                text = (workdir / "sink.log").read_text(errors="replace")
                indexed = bool(re.search(r'"task": "vector_index", "outcome": "done"', text)) or (
                    time.monotonic() - started > caught_up + 300
                )
                if indexed:
                    time.sleep(10)  # queries over the indexed table, a maintenance run more
                    break
        for c in clients:
            c.stop.set()
        sampler.stop.set()
        sampler.join()
        exited = proc.poll()
        proc.terminate()
        proc.wait(120)
        committed.close()
        latencies = sorted(x for c in clients for x in c.latencies)
        errors: dict[str, int] = {}
        for c in clients:
            for k, v in c.errors.items():
                errors[k] = errors.get(k, 0) + v

        mib = 1 << 20
        report(
            f"lance-sink memory benchmark (tansu, {PARTITIONS} partitions, {args.messages:,} "
            f"messages of {size / 1024:.1f} KB, {DIM}-dim vectors + text, budget "
            f"{args.budget / mib:.0f} MiB, unindexed cache {args.cache / mib:.0f} MiB, "
            f"{len(clients)} query clients, maintenance on)"
        )
        if exited is not None:
            report(f"THE SINK EXITED EARLY with code {exited} (OOM or crash): see {log.name}")
        report(f"caught up after {caught_up:.0f} s" if caught_up else "did not catch up in time")
        report(f"peak PSS sink process:      {sampler.peak_sink / mib:7,.0f} MiB")
        report(f"peak PSS child processes:   {sampler.peak_children / mib:7,.0f} MiB")
        report(f"peak PSS pod (sum):         {sampler.peak_pod / mib:7,.0f} MiB")
        report(f"peak anonymous, sink:       {sampler.peak_anon / mib:7,.0f} MiB")
        for name, value in sampler.parts_at_peak.items():
            report(f"  at the sink's peak, {name}: {value / mib:,.0f} MiB")
        if limit:
            report(
                f"chart-derived memory limit: {limit / mib:7,.0f} MiB -> peak pod / limit = "
                f"{sampler.peak_pod / limit:.2f} (target <= 0.90)"
            )
        if latencies:
            p50 = latencies[len(latencies) // 2] * 1000
            p99 = latencies[min(int(len(latencies) * 0.99), len(latencies) - 1)] * 1000
            report(f"queries answered: {len(latencies):,}; p50 {p50:.0f} ms, p99 {p99:.0f} ms")
        report(f"query errors: {errors or 'none'}")
        # Where the peak was: the sampled series around the pod's peak.
        if sampler.series:
            t, sink, kids = max(sampler.series, key=lambda s: s[1] + s[2])
            report(
                f"pod peak at {t:.0f} s: sink {sink / mib:,.0f} MiB "
                f"+ children {kids / mib:,.0f} MiB"
            )
    finally:
        broker.terminate()
        broker.wait(30)
        if os.environ.get("BENCH_KEEP") is None:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"kept {workdir}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
