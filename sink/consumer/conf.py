"""The consumer's librdkafka properties: typed settings, sink-owned keys, pass-through."""

from __future__ import annotations

from typing import Any, Final

from config.settings import Settings
from sink.kafka_conf import kafka_security_conf

# The consumer's topic.metadata.refresh.interval.ms (see `consumer_conf`): the longest a
# topic created after the start, or a partition added, waits to be assigned. The same as
# `sink.topic_shards.REFRESH_S`, so fan-out reads and consumption learn of it alike.
METADATA_REFRESH_MS: Final = 10_000
# How long the broker may hold an empty fetch. A broker that answers only when the wait ends,
# not when data arrives (tansu does), adds up to this much to every row's freshness:
# librdkafka's 500 ms default was all of it; at 100 ms the "fetched" stage alone had a p99
# of 75-134 ms in bench/e2e, most of the 150 ms target. Kafka answers as soon as data
# arrives (fetch.min.bytes 1), where this only bounds how often an idle consumer asks: 20
# small fetch requests a second per broker. `kafka.librdkafka` may override it.
FETCH_WAIT_MS: Final = 50
# The consumer's heartbeat.interval.ms (librdkafka: 3 s), or a third of a shorter session
# timeout. A member learns of a rebalance from its next heartbeat's answer, so each
# rebalance waits on it; six heartbeats per default session (6 s) ride out a lost one.
# `kafka.librdkafka` may override it.
HEARTBEAT_MS: Final = 1_000


def consumer_conf(settings: Settings) -> dict[str, Any]:
    """The consumer's librdkafka properties: typed settings, sink-owned keys, pass-through."""
    k = settings.kafka
    conf = kafka_security_conf(settings)
    conf.update(
        {
            "group.id": k.group_id,
            # The sink starts a partition without offsets at kafka.auto_offset_reset itself
            # (`sink.consumer.lifecycle.START_AT`); an offset the broker no longer has is
            # reported to it, never replaced silently (`sink.consumer.out_of_range`).
            "auto.offset.reset": "error",
            "isolation.level": k.isolation_level,
            "session.timeout.ms": k.session_timeout_ms,
            "heartbeat.interval.ms": min(HEARTBEAT_MS, max(k.session_timeout_ms // 3, 1)),
            "max.poll.interval.ms": k.max_poll_interval_ms,
            # Owned by the sink: offsets are stored and committed only once durable (I1).
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": False,
            "partition.assignment.strategy": "cooperative-sticky",
            "statistics.interval.ms": settings.observability.kafka_statistics_interval_ms,
            "fetch.wait.max.ms": FETCH_WAIT_MS,
            # Up to 16 MiB per partition per fetch (librdkafka: 1 MiB): a few hundred
            # 4 KB vector messages per round trip would keep the loop waiting on the broker.
            "max.partition.fetch.bytes": 16 << 20,
            # The prefetch queue (librdkafka: 64 MiB for all partitions). With 16 MiB fetches
            # a 64 MiB queue stops fetching whenever four partitions have one response
            # queued, and the loop then waits on the broker; 256 MiB keeps fetches in flight
            # while the decoders work. Part of the sink's fixed memory overhead.
            "queued.max.messages.kbytes": 256 << 10,
            # How often the subscribed topics' metadata is read again (librdkafka: 300 s).
            # Only a refresh shows a subscribed topic created after the start, or partitions
            # added to a topic, and so triggers the rebalance that assigns them: with the
            # default they went unconsumed for up to five minutes. 10 s, as often as
            # `sink.topic_shards` lists the topics' partitions for fan-out reads; one small
            # metadata request per consumer every 10 s. `kafka.librdkafka` may override it.
            "topic.metadata.refresh.interval.ms": METADATA_REFRESH_MS,
        }
    )
    if k.group_instance_id:
        conf["group.instance.id"] = k.group_instance_id
    conf.update(k.librdkafka)
    return conf
