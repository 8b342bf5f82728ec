"""`TopicShards` on a real broker: the shard of every partition of the sink's topics,
listed from the brokers' metadata (fan-out routes by it), none for a topic not created yet,
and the partitions of a topic created while the sink runs from the next list on."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from sink.topic_shards import TopicShards
from tests.support.brokers import Broker

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]


def wait_for_list(
    shards: TopicShards, done: Callable[[frozenset[str] | None], bool], deadline: float
) -> None:
    """Until the shards' current list is `done`, failing at `deadline` (monotonic)."""
    while not done(shards.current()):
        assert time.monotonic() < deadline, shards.current()
        time.sleep(0.05)


def test_every_partition_of_the_topics_is_listed(tansu_broker: Broker, topic: str) -> None:
    """On tansu: librdkafka's mock cluster answers no CreateTopics/CreatePartitions."""
    conf = {"bootstrap.servers": tansu_broker.bootstrap}
    admin = AdminClient(conf)
    for future in admin.create_topics([NewTopic(topic, 3)]).values():
        future.result(30)
    calls: list[tuple[str, int]] = []

    def shard_id(t: str, p: int) -> str:
        calls.append((t, p))
        return f"{t}/{p}"

    shards = TopicShards(conf, [topic, f"{topic}-later"], shard_id, refresh_s=0.2)
    assert shards.current() is None  # unknown until the first list
    shards.start()
    try:
        deadline = time.monotonic() + 30
        wait_for_list(shards, lambda now: now is not None, deadline)
        assert shards.current() == {f"{topic}/{p}" for p in range(3)}
        # The second topic is created while the sink runs: its partitions join the list.
        for future in admin.create_topics([NewTopic(f"{topic}-later", 2)]).values():
            future.result(30)
        want = {f"{topic}/{p}" for p in range(3)} | {f"{topic}-later/{p}" for p in range(2)}
        wait_for_list(shards, lambda now: now == want, deadline)
        time.sleep(0.5)  # more lists
        # A partition's shard id is looked up once (it may cost a storage listing).
        assert sorted(calls) == sorted(
            [(topic, p) for p in range(3)] + [(f"{topic}-later", p) for p in range(2)]
        )
    finally:
        shards.close()


def test_a_refresh_asked_for_lists_at_once(tansu_broker: Broker, topic: str) -> None:
    """`refresh_soon` (the sink asks at every rebalance) lists the partitions again without
    waiting for the interval: a topic created after the first list joins at once."""
    conf = {"bootstrap.servers": tansu_broker.bootstrap}
    admin = AdminClient(conf)
    for future in admin.create_topics([NewTopic(topic, 1)]).values():
        future.result(30)
    shards = TopicShards(conf, [topic, f"{topic}-later"], lambda t, p: f"{t}/{p}", refresh_s=3600)
    shards.start()
    try:
        deadline = time.monotonic() + 30
        wait_for_list(shards, lambda now: now is not None, deadline)
        assert shards.current() == {f"{topic}/0"}
        for future in admin.create_topics([NewTopic(f"{topic}-later", 2)]).values():
            future.result(30)
        time.sleep(0.5)
        assert shards.current() == {f"{topic}/0"}  # the next list is an hour away
        shards.refresh_soon()
        want = {f"{topic}/0", f"{topic}-later/0", f"{topic}-later/1"}
        wait_for_list(shards, lambda now: now == want, deadline)
    finally:
        shards.close()


def test_the_ids_of_new_partitions_are_looked_up_together(tansu_broker: Broker, topic: str) -> None:
    # A partition without state costs its id several storage round trips: looked up one
    # after another, a new topic of 1,024 partitions took minutes on S3 before its first
    # list (and queries read every owner until then).
    conf = {"bootstrap.servers": tansu_broker.bootstrap}
    admin = AdminClient(conf)
    for future in admin.create_topics([NewTopic(topic, 16)]).values():
        future.result(30)

    def shard_id(t: str, p: int) -> str:
        time.sleep(0.25)  # a round trip to the WAL storage
        return f"{t}/{p}"

    shards = TopicShards(conf, [topic], shard_id)
    started = time.monotonic()
    shards.start()
    try:
        wait_for_list(shards, lambda now: now is not None, started + 30)
        assert shards.current() == {f"{topic}/{p}" for p in range(16)}
        assert time.monotonic() - started < 16 * 0.25 / 2  # 4 s one after another
    finally:
        shards.close()
