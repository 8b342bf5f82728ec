"""Transactional topics through the real `lance-sink run`: commit lag reaches 0 although every
transaction ends in a control record (its commit or abort marker) that no consumer is handed,
and every committed message is in the table exactly once.

Neither test broker filters aborted transactions for `read_committed` consumers (librdkafka's
mock cluster and tansu both hand their messages out), so the rows are checked against what a
`read_committed` consumer reads from the same broker; against a broker that filters them
(KAFKA_BOOTSTRAP pointing at Kafka) the aborted messages must be absent.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import confluent_kafka
import pytest
from confluent_kafka import TopicPartition

from tests.e2e.test_observability import scrape, sink_config
from tests.support.brokers import Broker, free_port
from tests.support.kafka import consumer_conf, end_offsets
from tests.support.sink import ROOT, SinkProcess, messages, table_rows, wait_caught_up

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

#: A commit the broker makes abortable is tried again this many times in all (`transact`).
TRANSACTION_ATTEMPTS = 3


def transact(
    producer: confluent_kafka.Producer,
    topic: str,
    batch: Iterable[tuple[bytes, bytes]],
    *,
    commit: bool,
) -> None:
    """One transaction of `batch`, committed or aborted (after every message reached the log,
    so an abort leaves aborted messages and an abort marker behind).

    A commit the broker makes abortable (the mock cluster's coordinator once answered a first
    transaction with INVALID_PRODUCER_ID_MAPPING) is aborted and the batch sent again in a
    new transaction, as confluent-kafka's transactional producer pattern does: the aborted
    copy is one more aborted transaction for the sink to skip."""
    sent = list(batch)
    for attempt in range(TRANSACTION_ATTEMPTS):
        producer.begin_transaction()
        for key, value in sent:
            producer.produce(topic, key=key, value=value)
        producer.flush(30)
        if not commit:
            producer.abort_transaction(30)
            return
        try:
            producer.commit_transaction(30)
        except confluent_kafka.KafkaException as exc:
            if not exc.args[0].txn_requires_abort() or attempt == TRANSACTION_ATTEMPTS - 1:
                raise
            producer.abort_transaction(30)
        else:
            return


def read_committed(bootstrap: str, topic: str, ends: dict[int, int]) -> list[int]:
    """The `n` of every message a read_committed consumer of this broker reads, in order."""
    consumer = confluent_kafka.Consumer(
        consumer_conf(bootstrap, "reference", **{"isolation.level": "read_committed"})
    )
    tps = [TopicPartition(topic, p, 0) for p in ends]
    consumer.assign(tps)
    out: list[int] = []
    deadline = time.monotonic() + 60
    try:
        while True:
            out.extend(
                json.loads(m.value())["n"] for m in consumer.consume(1000, 0.2) if m.error() is None
            )
            positions = consumer.position(tps)
            if all(tp.offset >= ends[tp.partition] for tp in positions):
                return out
            assert time.monotonic() < deadline, (positions, ends)
    finally:
        consumer.close()


def wait_lags_zero(port: int, partitions: Iterable[int]) -> dict[str, dict[int, float]]:
    """Wait (bounded) until the sink's gauges show no lag on any partition."""
    names = [f"lance_sink_{k}_lag_messages" for k in ("consumer", "durable", "commit", "flush")]
    deadline = time.monotonic() + 30
    while True:
        metrics = scrape(port)
        if all(metrics.get(name, {}).get(p) == 0 for name in names for p in partitions):
            return metrics
        assert time.monotonic() < deadline, {name: metrics.get(name) for name in names}
        time.sleep(0.5)


@pytest.mark.parametrize("broker_name", ["mock_broker", "tansu_broker"])
def test_transactional_topic_reaches_commit_lag_zero(
    broker_name: str, request: pytest.FixtureRequest, topic: str, group: str, tmp_path: Path
) -> None:
    broker: Broker = request.getfixturevalue(broker_name)
    producer = confluent_kafka.Producer(
        {"bootstrap.servers": broker.bootstrap, "transactional.id": f"tx-{topic}"}
    )
    producer.init_transactions(30)
    transact(producer, topic, messages(0, 200), commit=True)
    transact(producer, topic, messages(200, 60), commit=False)
    transact(producer, topic, messages(260, 140), commit=True)
    committed_n = set(range(200)) | set(range(260, 400))

    port = free_port()
    config = sink_config(tmp_path, broker, topic, group, port, memtable__max_age_s=1)
    table = str(tmp_path / "table.lance")
    sink = SinkProcess(config, tmp_path / "sink.log")
    try:
        # Caught up = committed offset == log end offset (past the last marker) everywhere.
        ends = wait_caught_up(broker.bootstrap, group, topic, timeout=60, procs=[sink])
        # A transaction committed while the sink runs: its marker arrives after its data.
        transact(producer, topic, messages(400, 100), commit=True)
        committed_n |= set(range(400, 500))
        ends = wait_caught_up(broker.bootstrap, group, topic, timeout=60, procs=[sink])
        assert sum(ends.values()) > 500  # the markers take offsets too
        wait_lags_zero(port, ends)
        lag = subprocess.run(
            [
                *(sys.executable, "-m", "sink.cli", "lag", "--bootstrap", broker.bootstrap),
                *("--group", group, "--topic", topic, "--max-lag", "0", "--json"),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
            check=False,
        )
        assert lag.returncode == 0, lag.stdout + lag.stderr
        assert json.loads(lag.stdout)["total_lag"] == 0
    finally:
        code = sink.stop()
    assert code == 0, sink.log_path.read_text()[-3000:]

    # Restarted, the sink resumes at the committed offsets (past the markers): the next
    # transaction's rows arrive once, nothing before them again.
    transact(producer, topic, messages(500, 50), commit=True)
    committed_n |= set(range(500, 550))
    producer.flush(30)
    sink = SinkProcess(config, tmp_path / "sink-2.log")
    try:
        wait_caught_up(broker.bootstrap, group, topic, timeout=60, procs=[sink])
    finally:
        code = sink.stop()
    assert code == 0, sink.log_path.read_text()[-3000:]

    expected = read_committed(broker.bootstrap, topic, end_offsets(broker.bootstrap, topic))
    assert committed_n <= set(expected)
    if len(expected) == len(committed_n):  # the broker filters aborted transactions
        assert set(expected) == committed_n
    rows = sorted(r["n"] for r in table_rows(table))
    assert rows == sorted(expected)  # exactly once: nothing lost, nothing twice


def test_transactions_through_rebalances_and_a_kill(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """Small transactions (every fifth aborted) while a second sink joins and the first is
    SIGKILLed: skipping markers never commits past a row that is not durable (I1), so the
    table ends with every row a read_committed consumer reads, once, at commit lag 0."""
    # Two sinks on one host need two metrics ports, so two config files (one table).
    config_a, config_b = (
        sink_config(tmp_path, kafka_broker, topic, group, free_port(), memtable__max_rows=500)
        for _ in range(2)
    )
    table = str(tmp_path / "table.lance")
    done = threading.Event()

    def produce_transactions() -> None:
        producer = confluent_kafka.Producer(
            {"bootstrap.servers": kafka_broker.bootstrap, "transactional.id": f"tx-{topic}"}
        )
        producer.init_transactions(30)
        for i in range(60):
            transact(producer, topic, messages(i * 100, 100), commit=i % 5 != 4)
            time.sleep(0.2)
        done.set()

    producer = threading.Thread(target=produce_transactions, daemon=True)
    producer.start()
    a = SinkProcess(config_a, tmp_path / "a.log")
    time.sleep(4)
    b = SinkProcess(config_b, tmp_path / "b.log")  # joins mid-stream: a rebalance
    time.sleep(6)
    a.kill()  # its partitions move to b after the session timeout
    producer.join(120)
    assert done.is_set()
    try:
        wait_caught_up(kafka_broker.bootstrap, group, topic, timeout=120, procs=[b])
    finally:
        assert b.stop() == 0, b.log_path.read_text()[-3000:]
    expected = read_committed(
        kafka_broker.bootstrap, topic, end_offsets(kafka_broker.bootstrap, topic)
    )
    committed_n = {n for i in range(60) if i % 5 != 4 for n in range(i * 100, i * 100 + 100)}
    assert committed_n <= set(expected)
    rows = sorted(r["n"] for r in table_rows(table))
    assert rows == sorted(expected)
