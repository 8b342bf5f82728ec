"""Consumer-group lag without running the sink: committed offsets from the group coordinator
(AdminClient), log end offsets from fetch responses.

The log end offset is read from the high watermark a fetch response carries, not from a
ListOffsets request: some Kafka-protocol brokers (tansu) answer ListOffsets "latest"
wrongly, while every broker reports the high watermark in fetches correctly. The probe
consumer assigns the partitions itself (it never joins the group and never commits).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import confluent_kafka
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """Lag of one topic-partition for a group. `committed` is None when the group never
    committed there (lag then counts from the log start)."""

    topic: str
    partition: int
    start: int
    end: int
    committed: int | None

    @property
    def lag(self) -> int:
        base = self.committed if self.committed is not None else self.start
        return max(self.end - base, 0)


def group_lag(
    conf: dict[str, Any], group: str, topics: list[str], timeout: float = 30.0
) -> list[PartitionLag]:
    """Per-partition end, committed and lag of `group` on `topics`, sorted.

    Raises:
        confluent_kafka.KafkaException: the brokers or the group coordinator did not answer.
        TimeoutError: no watermark arrived for some partition within `timeout`.
    """
    admin = AdminClient(dict(conf))
    metadata = admin.list_topics(timeout=timeout)
    partitions = []
    for topic in topics:
        meta = metadata.topics.get(topic)
        if meta is None or meta.error is not None:
            raise confluent_kafka.KafkaException(f"topic {topic!r} does not exist")
        partitions += [TopicPartition(topic, p) for p in sorted(meta.partitions)]
    request = [ConsumerGroupTopicPartitions(group, partitions)]
    result = admin.list_consumer_group_offsets(request, request_timeout=timeout)
    committed: dict[tuple[str, int], int] = {}
    for tp in result[group].result(timeout).topic_partitions or []:
        if tp.error is None and tp.offset >= 0:
            committed[(tp.topic, tp.partition)] = tp.offset
    watermarks = fetch_watermarks(conf, partitions, committed, timeout)
    return [
        PartitionLag(
            tp.topic,
            tp.partition,
            watermarks[(tp.topic, tp.partition)][0],
            watermarks[(tp.topic, tp.partition)][1],
            committed.get((tp.topic, tp.partition)),
        )
        for tp in partitions
    ]


def fetch_watermarks(
    conf: dict[str, Any],
    partitions: list[TopicPartition],
    near: dict[tuple[str, int], int],
    timeout: float,
) -> dict[tuple[str, int], tuple[int, int]]:
    """(low, high) watermarks of each partition, from fetch responses.

    Fetches start at `near` (the committed offset) or the log end, with tiny fetch sizes:
    the probe reads at most a few messages per partition.
    """
    probe = confluent_kafka.Consumer(
        {
            **conf,
            "group.id": f"lance-sink-lag-probe-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "max.partition.fetch.bytes": 1024,
        }
    )
    try:
        probe.assign(
            [
                TopicPartition(
                    tp.topic,
                    tp.partition,
                    near.get((tp.topic, tp.partition), confluent_kafka.OFFSET_END),
                )
                for tp in partitions
            ]
        )
        out: dict[tuple[str, int], tuple[int, int]] = {}
        deadline = time.monotonic() + timeout
        while len(out) < len(partitions):
            if time.monotonic() > deadline:
                missing = [
                    f"{tp.topic}[{tp.partition}]"
                    for tp in partitions
                    if (tp.topic, tp.partition) not in out
                ]
                raise TimeoutError(f"no watermark from a fetch for {', '.join(missing)}")
            probe.consume(100, 0.2)
            for tp in partitions:
                low, high = probe.get_watermark_offsets(tp, cached=True)
                if high >= 0:
                    out[(tp.topic, tp.partition)] = (max(low, 0), high)
        return out
    finally:
        probe.close()
