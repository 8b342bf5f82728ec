"""Run the real `lance-sink run` in a child process against a real broker, for e2e tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import lance
import numpy as np

from tests.support.kafka import committed_offsets, end_offsets, produce

ROOT = Path(__file__).resolve().parents[2]
DIM = 8

#: Maintenance as in production (on), with every task firing within seconds during the
#: run: vector, text and scalar indexes, optimize, compaction of indexed fragments (pylance
#: cannot decode those commits; see engine.table.transaction_properties) and cleanup. The
#: default of `write_config`: a feature that is off in the tests is untested in production.
MAINTENANCE_ON: dict[str, Any] = {
    "enabled": True,
    "interval_s": 1,
    "optimize_interval_s": 1,
    "vector_index_min_rows": 1000,
    "optimize_unindexed_rows": 500,
    # 2: flush coalescing puts a catch-up of a few partitions in two or three commits, one
    # fragment each (3 left a test's compaction undone when its flushes shared 2 commits).
    "compact_min_fragments": 2,
    "cleanup_retention_s": 1,
    "scalar_indexes": {"n": "BTREE"},
}
#: Maintenance off, for a test that needs it off (pass it as `extra`'s "maintenance").
MAINTENANCE_OFF: dict[str, Any] = {"enabled": False}


def toml_key(key: str) -> str:
    """`key` as a TOML key: bare when it can be, quoted otherwise (a dotted librdkafka
    property is one key, not a path)."""
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):  # an inline table
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def toml_sections(sections: dict[str, dict[str, Any]]) -> list[str]:
    """`sections` as TOML lines: each a ``[name]`` table of its keys, then an empty line."""
    lines = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in values.items())
        lines.append("")
    return lines


def write_config(
    path: Path,
    *,
    bootstrap: str,
    topics: list[str],
    group: str,
    table_uri: str,
    mode: str = "append",
    extra: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """A sink config for the test table: id, n, text and an 8-dim vector; maintenance on
    (`MAINTENANCE_ON`) unless `extra` turns it off. `extra`'s sections update the defaults
    key by key."""
    sections: dict[str, dict[str, Any]] = {
        "kafka": {
            "bootstrap_servers": bootstrap,
            "group_id": group,
            "topics": topics,
            "session_timeout_ms": 6000,
            "consume_timeout_ms": 50,
            "commit_interval_ms": 200,
        },
        "wal": {"max_wal_flush_interval_ms": 10},
        "memtable": {"max_rows": 2000},
        "backpressure": {"process_budget_bytes": 256 << 20},
        "query": {"enabled": False},
        "maintenance": dict(MAINTENANCE_ON),
        "observability": {"log_format": "json", "metrics_port": 0},
        "shutdown": {"drain_deadline_s": 20},
    }
    for name, values in (extra or {}).items():
        sections.setdefault(name, {}).update(values)
    lines = toml_sections(sections)
    pk = '\nprimary_key = ["id"]' if mode == "upsert" else ""
    lines.append(
        f"""[table]
uri = {json.dumps(table_uri)}
mode = "{mode}"{pk}
fts_columns = ["text"]
columns = [
  {{ name = "id", type = "string", nullable = false }},
  {{ name = "n", type = "int64" }},
  {{ name = "text", type = "string" }},
]
vector = {{ column = "vec", dim = {DIM}, metric = "l2" }}
"""
    )
    path.write_text("\n".join(lines))
    return path


def minimal_config(path: Path, sections: dict[str, dict[str, Any]] | None = None) -> Path:
    """A sink config at `path` that loads but reaches no broker: topic "events" on
    127.0.0.1:1 and the table `t.lance` beside `path`, one string column. `sections` add
    settings (observability, query, ...), as TOML sections."""
    lines = [
        "[kafka]",
        'bootstrap_servers = "127.0.0.1:1"',
        'topics = ["events"]',
        "[table]",
        f"uri = {json.dumps(str(path.parent / 't.lance'))}",
        'columns = [{ name = "id", type = "string" }]',
        *toml_sections(sections or {}),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def sink_config(
    tmp_path: Path,
    bootstrap: str,
    topics: list[str],
    group: str,
    *,
    mode: str = "append",
    extra: dict[str, dict[str, Any]] | None = None,
) -> tuple[Path, str]:
    """`tmp_path/sink.toml` for the test table `tmp_path/table.lance`; returns both."""
    table = str(tmp_path / "table.lance")
    config = write_config(
        tmp_path / "sink.toml",
        bootstrap=bootstrap,
        topics=topics,
        group=group,
        table_uri=table,
        mode=mode,
        extra=extra,
    )
    return config, table


def message(i: int, *, key: str | None = None) -> tuple[bytes, bytes]:
    vec = np.sin(np.arange(DIM, dtype=np.float32) * (i + 1) * 0.01).round(5).tolist()
    body = {"id": key or f"m-{i}", "n": i, "text": f"message number {i}", "vec": vec}
    return (key or f"m-{i}").encode(), json.dumps(body).encode()


def messages(start: int, count: int) -> Iterator[tuple[bytes, bytes]]:
    for i in range(start, start + count):
        yield message(i)


class SinkProcess:
    """`lance-sink run --config FILE` (or another `command`: `serve`) as a child process,
    logs in a file. Every one still running when its test ends is killed then
    (`kill_leftover_sinks`, an autouse fixture): a test that fails before its own stop
    would leave it consuming, and holding a core, through the tests after it."""

    started: ClassVar[list[SinkProcess]] = []

    def __init__(
        self,
        config: Path,
        log_path: Path,
        env: dict[str, str] | None = None,
        command: str = "run",
    ) -> None:
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sink.cli", command, "--config", str(config)],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        SinkProcess.started.append(self)

    @classmethod
    def kill_leftovers(cls) -> None:
        """Kill every sink process started since the last call that still runs."""
        leftovers = [p for p in cls.started if p.alive()]
        cls.started.clear()
        for p in leftovers:
            p.kill()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait for the drain; returns the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        finally:
            self._log.close()
        return code

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(30)
        self._log.close()

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


def wait_caught_up(
    bootstrap: str,
    group: str,
    topic: str,
    timeout: float = 120,
    procs: list[SinkProcess] | None = None,
) -> dict[int, int]:
    """Wait until the group's committed offsets equal the log end offsets."""
    ends = end_offsets(bootstrap, topic)
    deadline = time.monotonic() + timeout
    committed: dict[int, int] = {}
    while time.monotonic() < deadline:
        committed = committed_offsets(bootstrap, group, topic, len(ends))
        # An empty partition has nothing to commit: no committed offset there is caught up.
        if all(
            committed.get(p, -1) == end or (end == 0 and committed.get(p, -1) < 0)
            for p, end in ends.items()
        ):
            return ends
        for p in procs or []:
            assert p.alive(), f"sink exited early: {p.log_path.read_text()[-3000:]}"
        time.sleep(0.5)
    raise TimeoutError(f"committed {committed} != end {ends} after {timeout}s")


def produce_in_steps(
    bootstrap: str,
    topic: str,
    group: str,
    stream: list[tuple[bytes, bytes]],
    step: int,
    procs: list[SinkProcess],
    *,
    partition: int = 0,
    timeout: float = 60,
) -> None:
    """Produce `stream` to `partition`, `step` messages at a time, each step once the group
    committed everything before it (`wait_caught_up`). With `memtable.max_rows = step`, each
    step is a flush of its own: messages produced at once can reach a sink as one batch, one
    memtable whatever its limit."""
    for start in range(0, len(stream), step):
        produce(bootstrap, topic, stream[start : start + step], partition=partition)
        wait_caught_up(bootstrap, group, topic, timeout, procs)


def table_rows(uri: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = lance.dataset(uri).to_table().to_pylist()
    return rows
