"""Rebalance-to-ready: a second `lance-sink run` joins the group of a running one.

As a new user would try it (issue 39): one `lance-sink run` with the default settings
(but the ports) consumes a topic of P partitions holding 40,000 small vector messages,
spread evenly, until everything is committed; then a second process with the same
configuration starts. The clock starts when the second process is started and stops
when both are ready: both /readyz answer 200, and every partition of the topic is
ACTIVE in exactly one of them (/v1/status), the second holding at least one. A process
that took no partition yet is ready by /readyz alone, so /readyz is not enough.

/readyz is asked every `POLL_S`; /v1/status (~50-100 ms of the process's time at 1,024
partitions) when both processes have just become ready, and otherwise every
`STATUS_POLL_S`: asked every `POLL_S`, the bench itself took most of a core of each
process while the joiner opened its shards. The milestones read from /v1/status alone
(first active, gave up first) have that resolution; both ready is seen within `POLL_S`.

The timeline is read from both processes' JSON logs (one line per event, with an ISO
timestamp): the joiner's start-up (`config_loaded`, `sink_started`), each rebalance
callback (`rebalance`, with its kind, count and the seconds the callback took), each
shard's claim and replay (`shard_claimed`, `shard_replayed`), each partition handed to
the consumer (`partition_assigned`, with the seconds its open waited in the open pool
and took), and the end of every partition's revoke (`partition_revoked`).

Usage:

    python -m bench.rebalance [--broker tansu|mock] [--partitions 8 64 256]
        [--messages 40000] [--set kafka.session_timeout_ms=45000 ...] [--keep DIR]

The mock cluster does not answer CreateTopics: there the topic has the mock's 4 partitions.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import confluent_kafka
from confluent_kafka.admin import AdminClient, NewTopic

from tests.support.brokers import Broker, free_ports, start_mock_cluster, start_tansu
from tests.support.kafka import committed_offsets, end_offsets
from tests.support.sink import message, toml_sections

ROOT = Path(__file__).resolve().parents[1]
#: How often both processes' /readyz is asked: the resolution of "both ready".
POLL_S = 0.1
#: How often /v1/status is read while the processes are not both newly ready.
STATUS_POLL_S = 0.5
#: Longest the bench waits for each step (catch-up, ready) before it gives up.
STEP_TIMEOUT_S = 300.0


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions)]).values():
        future.result(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        meta = admin.list_topics(topic, timeout=5)
        if topic in meta.topics and len(meta.topics[topic].partitions) == partitions:
            return
        time.sleep(0.2)
    raise TimeoutError(f"topic {topic} has not {partitions} partitions")


def produce_evenly(bootstrap: str, topic: str, n: int, partitions: int) -> None:
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i in range(n):
        key, value = message(i)
        while True:
            try:
                producer.produce(topic, key=key, value=value, partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(60) == 0


def write_config(
    path: Path,
    bootstrap: str,
    topic: str,
    group: str,
    table: str,
    port: int,
    overrides: dict[str, dict[str, Any]],
) -> None:
    """The sink's defaults but what two processes on one host must differ in (the metrics
    port; the query API off) and info-level JSON logs for the timeline."""
    sections: dict[str, dict[str, Any]] = {
        "kafka": {"bootstrap_servers": bootstrap, "group_id": group, "topics": [topic]},
        "query": {"enabled": False},
        "observability": {"metrics_port": port, "log_format": "json", "log_level": "info"},
    }
    for name, values in overrides.items():
        sections.setdefault(name, {}).update(values)
    lines = toml_sections(sections)
    lines.append(
        f"""[table]
uri = {json.dumps(table)}
columns = [
  {{ name = "id", type = "string", nullable = false }},
  {{ name = "n", type = "int64" }},
  {{ name = "text", type = "string" }},
]
vector = {{ column = "vec", dim = 8, metric = "l2" }}
"""
    )
    path.write_text("\n".join(lines))


def get_json(port: int, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def ready(port: int) -> bool:
    """Whether /readyz answers 200."""
    return get_json(port, "/readyz")[0] == 200


def held(port: int) -> set[int]:
    """The partitions ACTIVE in /v1/status."""
    _, status = get_json(port, "/v1/status")
    return {p["partition"] for p in status["partitions"] if p["phase"] == "active"}


def active(port: int) -> tuple[bool, set[int], list[str]]:
    """/readyz's answer, the partitions ACTIVE in /v1/status, and /readyz's reasons."""
    code, body = get_json(port, "/readyz")
    return code == 200, held(port), body.get("reasons", [])


class Sink:
    def __init__(self, config: Path, log_path: Path, port: int) -> None:
        self.log_path = log_path
        self.port = port
        self._log = log_path.open("wb")
        self.started = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sink.cli", "run", "--config", str(config)],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise SystemExit(f"sink exited: {self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and "timestamp" in event:
                    event["t"] = datetime.datetime.fromisoformat(event["timestamp"]).timestamp()
                    out.append(event)
        return out


def wait_ready_alone(sink: Sink, partitions: int) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while time.monotonic() < deadline:
        sink.check()
        with contextlib.suppress(OSError, KeyError, ValueError):
            ready, held, _ = active(sink.port)
            if ready and len(held) == partitions:
                return
        time.sleep(0.2)
    raise TimeoutError("the first process did not become ready")


def wait_caught_up(bootstrap: str, group: str, topic: str, partitions: int) -> None:
    ends = end_offsets(bootstrap, topic)
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while time.monotonic() < deadline:
        committed = committed_offsets(bootstrap, group, topic, partitions)
        if all(committed.get(p, -1) == end for p, end in ends.items()):
            return
        time.sleep(0.5)
    raise TimeoutError("the first process did not catch up")


def wait_both_ready(a: Sink, b: Sink, partitions: int) -> dict[str, float]:
    """Seconds from b's start to each milestone; raises after `STEP_TIMEOUT_S`."""
    marks: dict[str, float] = {}
    everything = set(range(partitions))
    deadline = time.monotonic() + STEP_TIMEOUT_S
    both_before = False
    status_at = -STATUS_POLL_S
    while time.monotonic() < deadline:
        a.check()
        b.check()
        try:
            ready_a, ready_b = ready(a.port), ready(b.port)
            # After the answers: a call can take a while.
            now = time.time() - b.started
            marks.setdefault("b_http_up", now)
            if ready_b:
                marks.setdefault("b_readyz_200", now)
            both = ready_a and ready_b
            newly, both_before = both and not both_before, both
            if not newly and time.monotonic() - status_at < STATUS_POLL_S:
                time.sleep(POLL_S)
                continue
            status_at = time.monotonic()
            held_a, held_b = held(a.port), held(b.port)
        except (OSError, KeyError, ValueError):
            time.sleep(POLL_S)
            continue
        if held_b:
            marks.setdefault("b_first_active", now)
        if len(held_a) < partitions:
            marks.setdefault("a_gave_up_first", now)
        if ready_a and ready_b and held_b and not held_a & held_b and held_a | held_b == everything:
            marks["both_ready"] = now
            marks["a_partitions"] = len(held_a)
            marks["b_partitions"] = len(held_b)
            marks["partitions"] = partitions
            return marks
        time.sleep(POLL_S)
    raise TimeoutError(f"not both ready within {STEP_TIMEOUT_S}s: {marks}")


def timeline(a: Sink, b: Sink) -> list[tuple[float, str, str]]:
    """(seconds since b started, process, what) for the rebalance's events."""
    t0 = b.started
    rows: list[tuple[float, str, str]] = []
    for name, sink in (("A", a), ("B", b)):
        events = [e for e in sink.events() if e["t"] >= t0 - 0.5]
        by_event: dict[str, list[dict[str, Any]]] = {}
        for e in events:
            by_event.setdefault(e["event"], []).append(e)
        for e in events:
            kind = e["event"]
            if kind in ("config_loaded", "sink_started", "sink_draining"):
                rows.append((e["t"] - t0, name, kind))
            elif kind == "rebalance":
                what = f"rebalance {e['kind']} {e['count']} partition(s), {e['seconds']:.3f} s"
                rows.append((e["t"] - t0, name, what))
            elif kind == "librdkafka_log" and e.get("facility") in ("CGRPJOINSTATE", "REBALANCE"):
                rows.append((e["t"] - t0, name, f"librdkafka {e['message'][:110]}"))
        for kind in ("shard_claimed", "shard_replayed", "partition_assigned", "partition_revoked"):
            group = by_event.get(kind, [])
            if not group:
                continue
            first, last = group[0]["t"] - t0, group[-1]["t"] - t0
            extra = ""
            if kind == "partition_assigned" and "open_s" in group[0]:
                opens = sorted(e["open_s"] for e in group)
                queued = sorted(e["queued_s"] for e in group)
                extra = (
                    f" (open p50 {opens[len(opens) // 2]:.3f} s, max {opens[-1]:.3f} s; "
                    f"queued max {queued[-1]:.3f} s)"
                )
            if kind == "shard_replayed":
                secs = sorted(e["seconds"] for e in group)
                extra = f" (replay max {secs[-1]:.3f} s)"
            rows.append((first, name, f"{kind} x{len(group)} first"))
            rows.append((last, name, f"{kind} x{len(group)} last{extra}"))
    rows.sort()
    return rows


def parse_overrides(pairs: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        section, _, name = key.partition(".")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        out.setdefault(section, {})[name] = value
    return out


def run_one(
    broker: Broker, partitions: int, n: int, work: Path, overrides: dict[str, dict[str, Any]]
) -> tuple[dict[str, float], list[tuple[float, str, str]]]:
    topic = f"rebalance-{partitions}-{uuid.uuid4().hex[:6]}"
    group = f"bench-{uuid.uuid4().hex[:6]}"
    if broker.kind == "mock":
        # The mock cluster does not answer CreateTopics: the topic is created by the first
        # message, with the mock's partition count (4).
        produce_evenly(broker.bootstrap, topic, 1, 1)
        partitions = len(end_offsets(broker.bootstrap, topic))
        n -= 1
    else:
        create_topic(broker.bootstrap, topic, partitions)
    produce_evenly(broker.bootstrap, topic, n, partitions)
    port_a, port_b = free_ports(2)
    table = str(work / f"{topic}.lance")
    config_a, config_b = work / f"{topic}-a.toml", work / f"{topic}-b.toml"
    write_config(config_a, broker.bootstrap, topic, group, table, port_a, overrides)
    write_config(config_b, broker.bootstrap, topic, group, table, port_b, overrides)
    a = Sink(config_a, work / f"{topic}-a.log", port_a)
    b: Sink | None = None
    try:
        wait_caught_up(broker.bootstrap, group, topic, partitions)
        wait_ready_alone(a, partitions)
        time.sleep(2)  # settle: flushes of the catch-up
        b = Sink(config_b, work / f"{topic}-b.log", port_b)
        marks = wait_both_ready(a, b, partitions)
    finally:
        if b is not None:
            b.stop()
        a.stop()
    return marks, timeline(a, b) if b is not None else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=("tansu", "mock"), default="tansu")
    parser.add_argument(
        "--partitions", type=int, nargs="+", default=[8, 64, 256], help="(mock: always 4)"
    )
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--set", action="append", default=[], help="section.key=value")
    parser.add_argument("--keep", type=Path, help="keep the logs and tables in this folder")
    parser.add_argument("--quiet", action="store_true", help="the summary line only")
    args = parser.parse_args()
    overrides = parse_overrides(args.set)
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-rebalance-"))
    work.mkdir(parents=True, exist_ok=True)
    broker = start_tansu(work) if args.broker == "tansu" else start_mock_cluster(work)
    try:
        print(
            f"rebalance-to-ready ({args.broker}, {args.messages} messages, "
            f"settings {overrides or 'default'})"
        )
        for partitions in args.partitions:
            marks, rows = run_one(broker, partitions, args.messages, work, overrides)
            print(
                f"\n{marks['partitions']:.0f} partitions: both ready "
                f"{marks['both_ready']:.1f} s after B started (B up {marks['b_http_up']:.1f} s, "
                f"A gave up its first {marks.get('a_gave_up_first', float('nan')):.1f} s, "
                f"B first active "
                f"{marks['b_first_active']:.1f} s; A {marks['a_partitions']:.0f} / "
                f"B {marks['b_partitions']:.0f} partitions)"
            )
            if not args.quiet:
                for t, name, what in rows:
                    if t <= marks["both_ready"] + 0.5:
                        print(f"  {t:7.3f} s  {name}  {what}")
    finally:
        broker.stop()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
