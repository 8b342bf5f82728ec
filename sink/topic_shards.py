"""The shard of every partition of the topics a sink consumes: what fan-out must route.

A query to any pod routes other shards' fresh rows by the owners it reads from the shard
manifests (`engine.reads.owners`), a copy refreshed in the background. A shard claimed
after that copy was read is not in it, so its committed rows would be in no answer and
reported missing by none. The brokers know every partition: `TopicShards` lists them
(topic metadata, through an admin client of the sink's own connection properties) and
maps each to its shard id (`Engine.shard_id`; the partitions seen for the first time
together, on `ID_WORKERS` threads), and a query whose owners copy lacks one of
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
from confluent_kafka.admin import AdminClient

from sink.log import librdkafka_logger

log = structlog.get_logger("lance_sink.sink")

#: Seconds between partition lists; after a failed one, until the next try.
REFRESH_S = 10.0
RETRY_S = 1.0
LIST_TIMEOUT_S = 10.0
#: Threads that look up the ids of partitions seen for the first time (storage round trips).
ID_WORKERS = 8


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
        keys: list[tuple[str, int]] = []
        for topic in self._topics:
            meta = metadata.topics.get(topic)
            if meta is None or meta.error is not None:
                continue  # not created yet: no partition, no row
            keys.extend((topic, partition) for partition in meta.partitions)
        new = [key for key in keys if key not in self._ids]
        if new:
            # A partition without state costs its id a few LISTs (legacy and moved ids): on
            # S3 a new topic of 1,024 partitions took minutes one after the other.
            with ThreadPoolExecutor(ID_WORKERS, thread_name_prefix="topic-shards") as pool:
                for key, shard in zip(
                    new, pool.map(lambda k: self._shard_id(*k), new), strict=True
                ):
                    self._ids[key] = shard
        self._current = frozenset(self._ids[key] for key in keys)
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
