"""One pod of a consumer group maintains the base table: the holder of the maintenance
partition (partition 0 of the first topic). Two real `lance-sink run` processes in one group
on the mock cluster, one real Lance table, maintenance on with every task firing within
seconds; when the maintenance pod stops, the other takes over."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from tests.e2e.test_observability import get, wait_http
from tests.support.brokers import Broker, free_ports
from tests.support.kafka import produce
from tests.support.maintenance import MAINTENANCE_ON
from tests.support.sink import SinkProcess, messages, sink_config, table_rows, wait_caught_up

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

ACTIVE = re.compile(r"^lance_sink_maintenance_active (\S+)$", re.MULTILINE)
RUNS = re.compile(r"^lance_sink_maintenance_runs_total\{[^}]*\} (\S+)$", re.MULTILINE)


def status(port: int) -> dict[str, Any]:
    code, body = get(port, "/v1/status")
    assert code == 200, body
    return body


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def active_gauge(port: int) -> float:
    found = ACTIVE.search(metrics(port))
    assert found is not None, "no lance_sink_maintenance_active gauge"
    return float(found.group(1))


def tasks_run(port: int) -> int:
    """Maintenance tasks this pod ran, whatever their outcome (skipped ones too: a task
    that found the work done by another pod is not logged, but it ran)."""
    return int(sum(float(v) for v in RUNS.findall(metrics(port))))


def ran(proc: SinkProcess) -> list[dict[str, Any]]:
    """The maintenance tasks that did something in this process (its child logs to the
    same file): done, conflict or failed (a task with nothing to do logs nothing)."""
    return [e for e in proc.events() if e.get("event") == "maintenance_ran"]


def create_topic(bootstrap: str, topic: str) -> None:
    """Create `topic` empty: a producer's metadata request creates it on brokers that
    create topics automatically (the mock cluster: 4 partitions), else CreateTopics."""
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap})
    meta = producer.list_topics(topic, timeout=10).topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        admin = AdminClient({"bootstrap.servers": bootstrap})
        for future in admin.create_topics([NewTopic(topic, 4)]).values():
            future.result(30)


def wait_for(predicate: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_one_pod_maintains_and_another_takes_over_when_it_stops(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """Every pod ran every maintenance task on the one table (168 commit conflicts and 9
    failed tasks in 20 minutes with 3 pods): only the holder of partition 0 runs them now,
    and after it stops (SIGTERM) the pod that gains partition 0 does."""
    create_topic(kafka_broker.bootstrap, topic)
    config, table = sink_config(
        tmp_path,
        kafka_broker.bootstrap,
        [topic],
        group,
        extra={"memtable": {"max_rows": 300}, "maintenance": MAINTENANCE_ON},
    )
    ports = free_ports(2)
    procs = [
        SinkProcess(
            config,
            tmp_path / f"sink-{i}.log",
            env={"LANCE_SINK__OBSERVABILITY__METRICS_PORT": str(port)},
        )
        for i, port in enumerate(ports)
    ]
    try:
        for port in ports:
            wait_http(port)
        # Both hold partitions before any row exists (no task has anything to do before).
        wait_for(
            lambda: all(status(port)["partitions"] for port in ports),
            "the two sinks did not share the partitions",
        )
        produce(kafka_broker.bootstrap, topic, messages(0, 3000))
        wait_caught_up(kafka_broker.bootstrap, group, topic, procs=procs)
        wait_for(lambda: any(ran(p) for p in procs), "no maintenance task ran", 60)
        produce(kafka_broker.bootstrap, topic, messages(3000, 1500))
        wait_caught_up(kafka_broker.bootstrap, group, topic, procs=procs)
        time.sleep(4)  # a few more runs (interval 1 s) in whichever pods run them

        counts = [tasks_run(port) for port in ports]
        logged = [len(ran(p)) for p in procs]
        assert min(counts) == 0, f"maintenance tasks run per pod: {counts}, {logged}"
        owner = counts.index(max(counts))
        other = 1 - owner
        assert logged[other] == 0, logged
        holds_p0 = [any(p["partition"] == 0 for p in status(port)["partitions"]) for port in ports]
        assert holds_p0[owner], holds_p0
        roles = [status(port)["maintenance"] for port in ports]
        assert [r["role"] for r in (roles[owner], roles[other])] == ["active", "standby"]
        assert roles[owner]["partition"] == {"topic": topic, "partition": 0}
        assert [active_gauge(ports[owner]), active_gauge(ports[other])] == [1.0, 0.0]

        # The maintenance pod stops: the other gains partition 0, and with it maintenance.
        assert procs[owner].stop() == 0
        survivor = procs[other]
        wait_for(
            lambda: status(ports[other])["maintenance"]["role"] == "active",
            "the remaining pod did not take maintenance over",
        )
        assert active_gauge(ports[other]) == 1.0
        produce(kafka_broker.bootstrap, topic, messages(4500, 1500))
        wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[survivor])
        wait_for(lambda: ran(survivor), "the new maintenance pod ran no task", 60)
        roles_logged = [
            e["role"] for e in survivor.events() if e.get("event") == "maintenance_role"
        ]
        assert roles_logged[-1] == "active", roles_logged
    finally:
        for proc in procs:
            assert proc.stop() == 0, proc.log_path.read_text()[-3000:]
    assert sorted(r["n"] for r in table_rows(table)) == list(range(6000))
