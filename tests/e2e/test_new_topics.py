"""A subscribed topic created while the sink runs is consumed within seconds.

librdkafka learns of a topic created after the start (and of partitions added to a topic)
only when it reads the subscribed topics' metadata again: every
`topic.metadata.refresh.interval.ms`, 300 s by default, which left such a topic unconsumed
for about five minutes. The sink reads it every 10 s (`sink.consumer.conf.METADATA_REFRESH_MS`).
On tansu: librdkafka's mock cluster answers no CreateTopics (neither broker answers
CreatePartitions, so the added-partition case rests on the same refresh, untested here).
Small consume batches and memtables: the sink flushes several times, and maintenance (on,
as in production) indexes and compacts the table while the new topic is taken on.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from tests.support.brokers import Broker
from tests.support.kafka import produce
from tests.support.maintenance import assert_maintained_without_flush_failures, wait_maintained
from tests.support.sink import SinkProcess, messages, sink_config, table_rows, wait_caught_up

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(180)]

# The refresh (10 s), a cooperative rebalance and opening two shards, with room for a busy
# machine; the old default needed up to 300 s.
CONSUMED_WITHIN_S = 40


def test_a_topic_created_after_the_start_is_consumed_within_seconds(
    tansu_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """The sink consumes `topic` (so it is in the group, assigned, steady) and is subscribed
    to `later` too, which does not exist yet. (While none of its topics exists, librdkafka
    retries the metadata every second or so until one does: that case was never slow.)"""
    later = f"{topic}-later"
    admin = AdminClient({"bootstrap.servers": tansu_broker.bootstrap})
    for future in admin.create_topics([NewTopic(topic, 1)]).values():
        future.result(30)
    produce(tansu_broker.bootstrap, topic, list(messages(0, 20)))
    config, table = sink_config(
        tmp_path,
        tansu_broker.bootstrap,
        [topic, later],
        group,
        # A flush every 10 rows of a partition: 2 of `topic`'s, 8 of `later`'s.
        extra={"kafka": {"consume_batch_size": 10}, "memtable": {"max_rows": 10}},
    )
    sink = SinkProcess(config, tmp_path / "sink.log")
    try:
        wait_caught_up(tansu_broker.bootstrap, group, topic, timeout=60, procs=[sink])
        time.sleep(1)
        for future in admin.create_topics([NewTopic(later, 2)]).values():
            future.result(30)
        created = time.monotonic()
        produce(tansu_broker.bootstrap, later, list(messages(20, 40)), partition=0)
        produce(tansu_broker.bootstrap, later, list(messages(60, 40)), partition=1)
        ends = wait_caught_up(
            tansu_broker.bootstrap, group, later, timeout=CONSUMED_WITHIN_S, procs=[sink]
        )
        took = time.monotonic() - created
        wait_maintained([sink])
    finally:
        assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    assert ends == {0: 40, 1: 40}
    assert took < CONSUMED_WITHIN_S
    assert sorted(r["n"] for r in table_rows(table)) == list(range(100))
    assert_maintained_without_flush_failures([sink])
