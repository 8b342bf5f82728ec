"""The shard of every partition of the topics a sink consumes: what fan-out must route.

A query to any pod routes other shards' fresh rows by the owners it reads from the shard
manifests (`engine.reads.owners`), a copy refreshed in the background. A shard claimed
after that copy was read is not in it, so its committed rows would be in no answer and
reported missing by none. The brokers know every partition: `TopicShards` lists them
(topic metadata, through an admin client of the sink's own connection properties) and
maps each to its shard id (`Engine.shard_id`), and a query whose owners copy lacks one of
them reads the owners again first (`engine.reads.remote.Fanout`, DESIGN.md I18).

Lifecycle: `start` begins a daemon thread that lists the partitions at once and then every
`refresh_s` (every `RETRY_S` after a failure, keeping the last list), and at once after
`refresh_soon`; `current` is None until the first list arrives, which makes queries read
the owners every time until then; `close` stops the thread. A partition added to a topic is
routed from the next list on: the sink asks for one at every rebalance of its group
(`SinkService._on_assign`, the rebalance callback, which runs on every member, with no
partition when it gets none new), and a new partition reaches a pod of the group (which then
claims its shard) only through a rebalance, so the list is mostly there first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog
from confluent_kafka.admin import AdminClient

from sink.log import librdkafka_logger

log = structlog.get_logger("lance_sink.sink")

#: Seconds between partition lists; after a failed one, until the next try.
REFRESH_S = 10.0
RETRY_S = 1.0
LIST_TIMEOUT_S = 10.0


class TopicShards:
    """The shard ids of every partition of `topics`, listed in the background."""

    def __init__(
        self,
        admin_conf: dict[str, Any],
        topics: list[str],
        shard_id: Callable[[str, int], str],
        refresh_s: float = REFRESH_S,
    ) -> None:
        self._conf = admin_conf
        self._topics = list(topics)
        self._shard_id = shard_id
        self._refresh_s = refresh_s
        self._ids: dict[tuple[str, int], str] = {}  # a partition's id never changes
        self._current: frozenset[str] | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by `refresh_soon` and `close`
        self._thread = threading.Thread(target=self._run, name="topic-shards", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def current(self) -> frozenset[str] | None:
        """The shard of every partition the last list found; None before the first."""
        return self._current

    def refresh_soon(self) -> None:
        """List the partitions again now rather than at the next interval (no wait)."""
        self._wake.set()

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def refresh(self, admin: AdminClient) -> frozenset[str]:
        """List the topics' partitions now (see the module docstring).

        Raises:
            confluent_kafka.KafkaException: the brokers did not answer.
            PersistenceError: the WAL storage did not answer (a new partition's shard id).
        """
        metadata = admin.list_topics(timeout=LIST_TIMEOUT_S)
        shards = set()
        for topic in self._topics:
            meta = metadata.topics.get(topic)
            if meta is None or meta.error is not None:
                continue  # not created yet: no partition, no row
            for partition in meta.partitions:
                key = (topic, partition)
                if key not in self._ids:
                    self._ids[key] = self._shard_id(topic, partition)
                shards.add(self._ids[key])
        self._current = frozenset(shards)
        return self._current

    def _run(self) -> None:
        conf: dict[str, Any] = {**self._conf, "logger": librdkafka_logger()}
        admin = AdminClient(conf)
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.refresh(admin)
            except Exception as exc:  # noqa: BLE001 - keep the last list, try again soon
                log.warning("topic_partitions_list_failed", error=str(exc))
                self._wake.wait(RETRY_S)
                continue
            self._wake.wait(self._refresh_s)
