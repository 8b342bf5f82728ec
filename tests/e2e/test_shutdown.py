"""SIGTERM ends `lance-sink run` within `shutdown.drain_deadline_s`, whatever is running:
a shard open (claim + replay) that the drain would wait for, a maintenance child that does
not answer, a query still inside the reader; and an assignment that arrives while draining
opens no shard. Maintenance is on (as in production) and has work to do in the sinks that
are stopped: small consume batches and memtables make several flushes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import lance
import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from config import load_settings
from engine.manifest import ManifestStore
from engine.table import flush_commits
from sink.service import SinkService
from tests.e2e.test_observability import get, sink_config, wait_http
from tests.support.brokers import Broker, free_port
from tests.support.kafka import produce
from tests.support.maintenance import (
    MAINTAINED,
    assert_maintained_without_flush_failures,
    wait_maintained,
)
from tests.support.sink import SinkProcess, messages, table_rows, wait_caught_up

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

DEADLINE_S = 6.0
SLOW = {"backpressure__controller": "tests.support.slow:controller"}
#: Messages per consume and rows per memtable: flushes of about 25 rows (a sink's first
#: batches, consumed while its decoders start, can be larger: one memtable each).
SMALL = {"kafka__consume_batch_size": 25, "memtable__max_rows": 25}


def stop_timed(sink: SinkProcess) -> float:
    """SIGTERM the sink; seconds until it exited (it must exit 0)."""
    started = time.monotonic()
    code = sink.stop(timeout=120)
    elapsed = time.monotonic() - started
    assert code == 0, sink.log_path.read_text()[-3000:]
    return elapsed


def wait_for(predicate: object, what: str, timeout: float = 60) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(what)


def test_stop_during_a_slow_shard_open(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """The stop comes while the assignment's shards are being claimed and replayed (slowed
    to 40 s each): the drain stops waiting for them at its deadline, and the next sink
    takes every partition over with nothing lost. A first sink, maintenance off, left small
    fragments in the table: the slow sink's maintenance indexes and compacts them meanwhile."""
    produce(kafka_broker.bootstrap, topic, messages(0, 400))
    port = free_port()
    unmaintained = sink_config(
        tmp_path, kafka_broker, topic, group, port, maintenance__enabled=False, **SMALL
    )
    first = SinkProcess(unmaintained, tmp_path / "first.log")
    try:
        wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[first])
    finally:
        assert first.stop() == 0, first.log_path.read_text()[-3000:]
    produce(kafka_broker.bootstrap, topic, messages(400, 400))
    port = free_port()
    config = sink_config(
        tmp_path,
        kafka_broker,
        topic,
        group,
        port,
        shutdown__drain_deadline_s=DEADLINE_S,
        **SLOW,
        **SMALL,
    )
    sink = SinkProcess(config, tmp_path / "slow.log", env={"LANCE_SINK_TEST_REPLAY_DELAY_S": "40"})
    wait_http(port)

    def opening() -> bool:
        _, body = get(port, "/readyz")
        return any("opening and replaying" in r for r in body.get("reasons", []))

    wait_for(opening, "the sink never started opening its partitions")
    wait_maintained([sink], timeout=30)  # well within the 40 s of the opens
    assert opening()
    elapsed = stop_timed(sink)
    assert elapsed <= DEADLINE_S + 0.5, f"stopped after {elapsed:.1f} s"
    assert any(e.get("event") == "partition_open_abandoned" for e in sink.events())

    final = SinkProcess(config, tmp_path / "final.log")
    try:
        wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[final])
    finally:
        assert final.stop() == 0
    assert sorted(r["n"] for r in table_rows(str(tmp_path / "table.lance"))) == list(range(800))
    assert_maintained_without_flush_failures([sink])


def test_stop_while_the_maintenance_child_does_not_answer(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """A maintenance child stuck in a task (here: SIGSTOPped) is killed before the deadline,
    leaving the rest of the drain its share."""
    produce(kafka_broker.bootstrap, topic, messages(0, 400))
    port = free_port()
    config = sink_config(
        tmp_path,
        kafka_broker,
        topic,
        group,
        port,
        shutdown__drain_deadline_s=DEADLINE_S,
        maintenance__enabled=True,
        maintenance__interval_s=1,
        **SMALL,
    )
    sink = SinkProcess(config, tmp_path / "sink.log")
    wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
    wait_maintained([sink])  # the child has done work: it is stopped with a table to keep
    started = [e for e in sink.events() if e.get("event") == "maintenance_process_started"]
    assert started, "no maintenance child"
    child = int(started[-1]["pid"])
    os.kill(child, signal.SIGSTOP)
    elapsed = stop_timed(sink)
    assert elapsed <= DEADLINE_S, f"stopped after {elapsed:.1f} s"
    assert any(e.get("event") == "maintenance_process_killed" for e in sink.events())
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_stop_with_a_query_still_running(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """A query still inside the reader (slowed to 60 s) when the sink stops is abandoned:
    the process exits within the deadline, its rows committed."""
    produce(kafka_broker.bootstrap, topic, messages(0, 200))
    port = free_port()
    config = sink_config(
        tmp_path,
        kafka_broker,
        topic,
        group,
        port,
        shutdown__drain_deadline_s=DEADLINE_S,
        query__enabled=True,
        query__port=port,
        **SLOW,
        **SMALL,
    )
    text = config.read_text().replace('mode = "append"', 'mode = "upsert"\nprimary_key = ["id"]')
    config.write_text(text)
    sink = SinkProcess(config, tmp_path / "sink.log", env={"LANCE_SINK_TEST_LOOKUP_DELAY_S": "60"})
    wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
    wait_maintained([sink], MAINTAINED | {"key_index"})  # the lookup reads a maintained base

    def lookup() -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/lookup",
            data=json.dumps({"keys": ["m-1"]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        # The server goes away: that is the point.
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
            urllib.request.urlopen(request, timeout=90).read()  # noqa: S310 - http://127.0.0.1

    client = threading.Thread(target=lookup, daemon=True)
    client.start()
    wait_for(lambda: "TEST_LOOKUP_STARTED" in sink.log_path.read_text(), "no lookup ran")
    elapsed = stop_timed(sink)
    assert elapsed <= DEADLINE_S + 0.5, f"stopped after {elapsed:.1f} s"
    abandoned = [e for e in sink.events() if e.get("event") == "threads_abandoned_at_exit"]
    assert any(name.startswith("query") for name in abandoned[0]["threads"]), abandoned
    assert_maintained_without_flush_failures([sink])


def test_an_assignment_while_draining_opens_no_shard(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """librdkafka can deliver an assignment during the drain's consumer close: it is
    accepted without claiming or replaying the shard, and returns at once."""
    config = sink_config(tmp_path, kafka_broker, topic, group, free_port())
    service = SinkService(load_settings(config))
    try:
        service.stop()
        started = time.monotonic()
        service.lifecycle.assign([TopicPartition(topic, 0)])
        assert time.monotonic() - started < 1.0
        assert dict(service.partitions) == {}
        shard = service.engine.shard_id(topic, 0)
        assert ManifestStore(service.engine.storage, shard).latest().epoch == 0  # not claimed
    finally:
        service.drain()


def test_stop_during_start_up(kafka_broker: Broker, topic: str, group: str, tmp_path: Path) -> None:
    """SIGTERM right after the config is loaded, while the engine is still being built:
    the signal is acted on once the service exists (a drain of nothing) and the exit is 0.
    It used to kill the process (-15) because the handlers came after the start-up."""
    produce(kafka_broker.bootstrap, topic, messages(0, 10))
    config = sink_config(tmp_path, kafka_broker, topic, group, free_port())
    sink = SinkProcess(config, tmp_path / "early.log")

    def loaded() -> bool:
        return any(e.get("event") == "config_loaded" for e in sink.events())

    wait_for(loaded, "the sink never loaded its config", timeout=30)
    assert not any(e.get("event") == "sink_started" for e in sink.events())
    stop_timed(sink)
    assert any(e.get("event") == "shutdown_requested" for e in sink.events())


DRAIN_PARTITIONS = 12


def test_a_drain_flushes_every_partition_in_a_few_commits(
    tansu_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """SIGTERM while 12 partitions' memtables hold rows: the drain seals every shard before
    it closes any, so their flushes share the same flush rounds, one or two Lance commits
    (`engine.coalesce`) for all. Closing one partition after another sealed and waited for
    one commit per partition: 12 (and on S3, a conditional PUT plus manifest writes each)."""
    admin = AdminClient({"bootstrap.servers": tansu_broker.bootstrap})
    for future in admin.create_topics([NewTopic(topic, DRAIN_PARTITIONS)]).values():
        future.result(30)
    for p in range(DRAIN_PARTITIONS):
        produce(tansu_broker.bootstrap, topic, messages(p * 20, 20), partition=p)
    config = sink_config(tmp_path, tansu_broker, topic, group, free_port())
    sink = SinkProcess(config, tmp_path / "drain.log")
    uri = str(tmp_path / "table.lance")
    try:
        wait_caught_up(tansu_broker.bootstrap, group, topic, procs=[sink])
        before = int(lance.dataset(uri).version)
        assert not list(flush_commits(lance.dataset(uri), 0))  # every row in a memtable
    finally:
        stop_timed(sink)
    table = lance.dataset(uri)
    commits = list(flush_commits(table, before))
    assert sorted(r["n"] for r in table_rows(uri)) == list(range(DRAIN_PARTITIONS * 20))
    assert 1 <= len(commits) <= 3, f"{len(commits)} flush commits for the drain"
