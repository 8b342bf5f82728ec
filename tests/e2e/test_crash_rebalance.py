"""Exactly-once across SIGKILLs and rebalances, through the real `lance-sink run`."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from config import load_settings
from engine.engine import Engine
from tests.support.brokers import Broker
from tests.support.kafka import produce
from tests.support.maintenance import MAINTENANCE, assert_maintained_without_flush_failures
from tests.support.sink import SinkProcess, messages, sink_config, table_rows, wait_caught_up

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(600)]


def produce_in_background(
    bootstrap: str, topic: str, total: int, chunk: int, pause: float
) -> threading.Thread:
    """Produce `total` messages in chunks, `pause` seconds apart."""

    def run() -> None:
        for start in range(0, total, chunk):
            produce(bootstrap, topic, messages(start, min(chunk, total - start)))
            time.sleep(pause)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def assert_exactly_once(table: str, n: int) -> None:
    rows = table_rows(table)
    got = sorted(r["n"] for r in rows)
    missing = sorted(set(range(n)) - set(got))
    dupes = len(got) - len(set(got))
    assert not missing, f"missing {missing[:10]}"
    assert not dupes, f"{dupes} duplicates"
    assert len(got) == n


@MAINTENANCE
def test_sigkill_at_random_instants(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path, maintenance: dict[str, object]
) -> None:
    n = 12_000
    config, table = sink_config(
        tmp_path,
        kafka_broker.bootstrap,
        [topic],
        group,
        extra={
            "memtable": {"max_rows": 500},
            "maintenance": maintenance,
            # With maintenance on, one shard per flush commit (as before coalescing): the
            # compaction this test needs wants 3 small fragments, and coalesced commits
            # left only 2 in some runs (1 of 3).
            **({"flush": {"max_commit_rows": 1}} if maintenance["enabled"] else {}),
        },
    )
    procs = []
    # ~25 s of production: every kill below lands mid-stream.
    producer = produce_in_background(kafka_broker.bootstrap, topic, n, 250, 0.5)
    rng = random.Random(11)
    for round_ in range(6):
        sink = SinkProcess(config, tmp_path / f"sink-{round_}.log")
        procs.append(sink)
        # Let it join, replay and make progress, then kill it at a random instant.
        time.sleep(rng.uniform(2.0, 6.0))
        assert sink.alive(), sink.log_path.read_text()[-3000:]
        sink.kill()
    producer.join(120)
    final = SinkProcess(config, tmp_path / "sink-final.log")
    try:
        wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[final])
        if maintenance["enabled"]:
            time.sleep(3)  # a maintenance run or two over the whole table
    finally:
        assert final.stop() == 0
    assert_exactly_once(table, n)
    if maintenance["enabled"]:
        assert_maintained_without_flush_failures([*procs, final])


@MAINTENANCE
def test_rebalance_join_and_kill(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path, maintenance: dict[str, object]
) -> None:
    n = 12_000
    config, table = sink_config(
        tmp_path,
        kafka_broker.bootstrap,
        [topic],
        group,
        extra={"memtable": {"max_rows": 500}, "maintenance": maintenance},
    )
    producer = produce_in_background(kafka_broker.bootstrap, topic, n, 300, 0.4)
    a = SinkProcess(config, tmp_path / "a.log")
    b = SinkProcess(config, tmp_path / "b.log")
    time.sleep(8)
    c = SinkProcess(config, tmp_path / "c.log")  # joins mid-stream
    time.sleep(8)
    a.kill()  # its partitions move to b and c after the session timeout
    producer.join(120)
    try:
        wait_caught_up(kafka_broker.bootstrap, group, topic, timeout=180, procs=[b, c])
        if maintenance["enabled"]:
            time.sleep(3)
    finally:
        assert b.stop() == 0
        assert c.stop() == 0
    assert_exactly_once(table, n)
    if maintenance["enabled"]:
        assert_maintained_without_flush_failures([a, b, c])

    # Each partition was owned by one writer at a time: every claim of a shard took a new,
    # higher epoch, and the epochs of one shard never repeat across processes.
    claims: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    moved = 0
    for name, proc in (("a", a), ("b", b), ("c", c)):
        for e in proc.events():
            if e.get("event") == "partition_assigned":
                claims[e["shard"]].append((e["timestamp"], e["epoch"], name))
    for shard, seen in claims.items():
        seen.sort()
        epochs = [epoch for _, epoch, _ in seen]
        assert epochs == sorted(set(epochs)), f"{shard}: epochs {seen}"
        moved += len({owner for _, _, owner in seen}) > 1
    assert moved >= 1, "no partition changed owner: the rebalance was not exercised"


def test_fenced_everywhere_exits_non_zero(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """A zombie: every shard of a running sink is claimed by newer writers; it stops with
    exit code 1 and says why, acknowledging nothing more."""
    produce(kafka_broker.bootstrap, topic, messages(0, 400))
    config, table = sink_config(
        tmp_path,
        kafka_broker.bootstrap,
        [topic],
        group,
    )
    sink = SinkProcess(config, tmp_path / "sink.log")
    wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
    settings = load_settings(config)
    engine = Engine.from_settings(settings)
    try:
        newer = [engine.open_shard(topic, p) for p in range(4)]  # claims newer epochs
        code = sink.proc.wait(90)
    finally:
        engine.close(flush=True)  # the newer writers flush what they replayed
        sink.kill()
    assert code == 1
    events = sink.events()
    assert sum(e["event"] == "partition_fenced" for e in events) == 4
    fatal = next(e for e in events if e["event"] == "sink_fatal")
    assert "fenced" in fatal["reason"]
    assert all(w.epoch == 2 for w in newer)
    assert sorted(r["n"] for r in table_rows(table)) == list(range(400))
