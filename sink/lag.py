"""Lag, as one consistent snapshot per partition: in a running sink (`PartitionOffsets`) and
without one (`group_lag`, `lance-sink lag`).

Every lag is a difference of two offsets read at different instants; under load each moves
by the production rate, so a difference is only true if both are read together. The rules:

- **The end offset is read last, and from the newest fetch response.** Kafka's high
  watermark in a fetch response is right on every broker, while some Kafka-protocol brokers
  (tansu) answer ListOffsets "latest" wrongly (the last batch's base offset + 1), so the end
  offset always comes from fetch responses. librdkafka keeps the newest one per partition
  (`get_watermark_offsets(cached=True)`, the `hi_offset` its statistics report at their
  interval); reading it at snapshot time instead of taking the last statistics tick (up to
  `observability.kafka_statistics_interval_ms` old) keeps it no older than one fetch round
  (at most `fetch.wait.max.ms`, 50 ms in the sink, when no data arrives).
- **Offsets are read from the slowest-moving to the fastest** - committed, durable and
  flushed, consumed, end - so each is read no earlier than the ones it must be at least
  equal to, and a lag never clamps to 0 because its end offset was older than the offset
  subtracted from it.
- **`lance-sink lag` warms up first, then reads.** A first look-up of the group's committed
  offsets finds its coordinator and where a probe consumer starts (it assigns the
  partitions itself at those offsets: it never joins the group and never commits). Once
  the probe has a high watermark for every partition, the committed offsets are read again
  (one round trip), then each partition's high watermark is taken from a fetch response
  that arrived after that read (the probe fetches every `PROBE_FETCH_WAIT_MS`). The figures
  are then at most a few tens of milliseconds apart; table storage is read meanwhile.
- **Flushed watermarks come from table storage**, not from a sink: the newest shard
  manifest of each partition's shard (`engine.manifest`), raised to a flush committed to
  Lance after it (`BaseTable.find_flush`: a writer killed between its Lance commit and its
  manifest update). An offset below it is in the Lance table; a committed offset above it
  is durable only in the shard's WAL until a writer opens the shard again (replay) and
  flushes. A writer flushing right now is not seen until its commit lands.

A paused partition (backpressure, dead letters in flight, a registry outage) is not
fetched by the sink's consumer, so its end offset there is that of its last fetch; nor is
an assigned partition without a shard writer (its open under way or failing, its writer
poisoned and being reopened: taken out of the consumer's assignment meanwhile, or fenced
and paused). Once a partition has been unfetched for `PAUSED_PROBE_AFTER_S`, `PausedEnds`
fetches it with a probe consumer of its own (outside the group, from the end, 1 KiB per
fetch), so the end offset and every lag keep moving while it waits: a storage incident
that drops or stalls writers shows as a growing commit lag, never as gauges frozen at
their last values. `lance-sink lag` fetches every partition itself.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import confluent_kafka
import structlog
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

if TYPE_CHECKING:
    import lance

    from config.settings import Settings

Level = Literal["committed", "flushed"]

log = structlog.get_logger("lance_sink.lag")

# The probe's longest fetch wait: every fetch response carries a fresh high watermark, so
# this bounds how old the end offset can be after the committed offsets were read (the
# probe waits two rounds). Small, because the probe reads at most a few messages a round.
PROBE_FETCH_WAIT_MS = 10
# Reading manifests (a LIST and a GET each; on S3 tens of ms) and Lance transactions is
# I/O: this many shards at a time.
MANIFEST_READERS = 8


@dataclass(frozen=True, slots=True)
class PartitionOffsets:
    """One partition's offsets in a running sink, taken as one snapshot (see the module
    docstring for the read order). Each is "the next offset" in Kafka's convention.

    Attributes:
        end: log end offset (high watermark of the newest fetch); None before the first.
        consumed: the consumer's position (next offset handed to the sink).
        durable: 1 + the last offset whose WAL append is durable (or whose dead letter the
            DLQ topic acknowledged).
        committed: the offset committed to Kafka (0 before the first commit).
        flushed: 1 + the last offset flushed into the Lance table.
        oldest_pending_timestamp_ms: timestamp of the oldest consumed message not yet
            durable (None when none is pending).
    """

    end: int | None
    consumed: int
    durable: int
    committed: int
    flushed: int
    oldest_pending_timestamp_ms: int | None = None

    def lags(self) -> dict[str, int] | None:
        """Consumer, durable, commit and flush lag in messages (None without an end)."""
        if self.end is None:
            return None
        return {
            "consumer": max(self.end - self.consumed, 0),
            "durable": max(self.end - self.durable, 0),
            "commit": max(self.end - self.committed, 0),
            "flush": max(self.end - self.flushed, 0),
        }

    def lag_seconds(self, now: float | None = None) -> float:
        """Age of the oldest message not yet durable (0 when caught up)."""
        if self.oldest_pending_timestamp_ms is None:
            return 0.0
        now = time.time() if now is None else now
        return max(now - self.oldest_pending_timestamp_ms / 1000, 0.0)


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """Lag of one topic-partition for a group, without a sink.

    `committed` is None when the group never committed there, `flushed` when no flush of
    the partition's shard is recorded in table storage (or it was not read): lags then
    count from the log start.
    """

    topic: str
    partition: int
    start: int
    end: int
    committed: int | None
    flushed: int | None = None

    @property
    def lag(self) -> int:
        """Commit lag: messages after the group's committed offset."""
        base = self.committed if self.committed is not None else self.start
        return max(self.end - base, 0)

    @property
    def flush_lag(self) -> int:
        """Messages not in the Lance table yet (committed or not)."""
        base = self.flushed if self.flushed is not None else self.start
        return max(self.end - base, 0)

    @property
    def unflushed(self) -> int:
        """Committed messages that are not in the Lance table: durable only in the shard's
        WAL until a writer replays and flushes them."""
        committed = self.committed if self.committed is not None else self.start
        flushed = self.flushed if self.flushed is not None else self.start
        return max(committed - flushed, 0)

    def at(self, level: Level) -> int:
        """The lag `--level` selects."""
        return self.lag if level == "committed" else self.flush_lag


def group_lag(
    conf: dict[str, Any],
    group: str,
    topics: list[str],
    timeout: float = 30.0,
    flushed: FlushedReader | None = None,
    probe_conf: dict[str, Any] | None = None,
) -> list[PartitionLag]:
    """Per-partition end, committed (and with `flushed`, flushed) offsets of `group` on
    `topics`, as one snapshot (see the module docstring), sorted.

    `conf` configures the admin client; `probe_conf` (default `conf`) the consumer that
    fetches the end offsets, which may carry consumer-only properties.

    Raises:
        confluent_kafka.KafkaException: the brokers or the group coordinator did not answer,
            or a topic does not exist.
        TimeoutError: no watermark arrived for some partition within `timeout`.
    """
    deadline = time.monotonic() + timeout
    admin = AdminClient(dict(conf))
    metadata = admin.list_topics(timeout=timeout)
    partitions: list[TopicPartition] = []
    for topic in topics:
        meta = metadata.topics.get(topic)
        if meta is None or meta.error is not None:
            raise confluent_kafka.KafkaException(f"topic {topic!r} does not exist")
        partitions += [TopicPartition(topic, p) for p in sorted(meta.partitions)]
    keys = [(tp.topic, tp.partition) for tp in partitions]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="flushed") as pool:
        # Table storage is read meanwhile: it does not move with the broker's offsets.
        flushed_future = pool.submit(flushed.read, keys) if flushed is not None else None
        request = [ConsumerGroupTopicPartitions(group, partitions)]

        def committed_now() -> dict[tuple[str, int], int]:
            future = admin.list_consumer_group_offsets(request, request_timeout=timeout)[group]
            result = future.result(max(deadline - time.monotonic(), 0.1))
            return {
                (tp.topic, tp.partition): tp.offset
                for tp in result.topic_partitions or []
                if tp.error is None and tp.offset >= 0
            }

        # The first look-up finds the group coordinator and where the probe starts.
        with WatermarkProbe(probe_conf or conf, partitions, committed_now()) as probe:
            probe.wait_all(deadline)
            committed = committed_now()
            watermarks = probe.after_now()
        flushed_offsets = flushed_future.result() if flushed_future is not None else {}
    return [
        PartitionLag(
            topic,
            partition,
            watermarks[(topic, partition)][0],
            watermarks[(topic, partition)][1],
            committed.get((topic, partition)),
            flushed_offsets.get((topic, partition)),
        )
        for topic, partition in keys
    ]


class WatermarkProbe:
    """A consumer that assigns `partitions` itself and fetches continuously, so that
    its cached high watermarks are never older than one fetch round. Use as a context
    manager (closes the consumer)."""

    def __init__(
        self,
        conf: dict[str, Any],
        partitions: list[TopicPartition],
        start: dict[tuple[str, int], int],
    ) -> None:
        self.partitions = partitions
        self.consumer = confluent_kafka.Consumer(
            {
                **conf,
                "group.id": f"lance-sink-lag-probe-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "max.partition.fetch.bytes": 1024,
                "fetch.wait.max.ms": PROBE_FETCH_WAIT_MS,
            }
        )
        # At a concrete offset (`start`: the committed one, else the log start), never a
        # logical one: resolving OFFSET_END took half a second, and ListOffsets is what
        # some brokers answer wrongly. The probe reads at most 1 KiB per fetch round.
        self.consumer.assign(
            [
                TopicPartition(tp.topic, tp.partition, start.get((tp.topic, tp.partition), 0))
                for tp in partitions
            ]
        )

    def __enter__(self) -> WatermarkProbe:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.consumer.close()

    def _cached(self) -> dict[tuple[str, int], tuple[int, int]]:
        out = {}
        for tp in self.partitions:
            low, high = self.consumer.get_watermark_offsets(tp, cached=True)
            if high >= 0:
                out[(tp.topic, tp.partition)] = (max(low, 0), high)
        return out

    def wait_all(self, deadline: float) -> None:
        """Wait until a fetch response brought every partition's high watermark.

        Raises:
            TimeoutError: some partition had none by `deadline`.
        """
        while len(self._cached()) < len(self.partitions):
            if time.monotonic() > deadline:
                seen = self._cached()
                missing = [
                    f"{tp.topic}[{tp.partition}]"
                    for tp in self.partitions
                    if (tp.topic, tp.partition) not in seen
                ]
                raise TimeoutError(f"no watermark from a fetch for {', '.join(missing)}")
            self.consumer.consume(1000, 0.02)

    def after_now(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(low, high) watermarks of each partition from fetch responses that arrived after
        this call began (two fetch rounds later)."""
        until = time.monotonic() + 2 * PROBE_FETCH_WAIT_MS / 1000 + 0.005
        while (left := until - time.monotonic()) > 0:
            self.consumer.consume(1000, left)
        return self._cached()


#: How long a partition stays paused (or otherwise unfetched) before `PausedEnds` fetches
#: its end offset itself (backpressure pauses are usually shorter, and cost no probe).
PAUSED_PROBE_AFTER_S: Final = 1.0

#: The paused-partition probe's fetch wait: as the sink's own consumer (it runs as long as
#: a partition stays paused, so not `PROBE_FETCH_WAIT_MS`'s 100 requests a second).
PAUSED_PROBE_FETCH_WAIT_MS: Final = 100

#: Properties of the running sink's consumer that must not reach a probe consumer: it
#: joins no group, commits nothing, and its errors are not the sink's (its own callbacks).
_SINK_ONLY_KEYS: Final = frozenset(
    {
        "group.id",
        "group.instance.id",
        "partition.assignment.strategy",
        "stats_cb",
        "on_commit",
        "error_cb",
    }
)


class PausedEnds:
    """End offsets of the partitions a running sink's consumer does not fetch (paused, or
    without a shard writer), from fetch responses of a probe consumer of its own (see the
    module docstring).

    The sink's loop calls `track` with those partitions about once a second; any thread
    reads `end`. The probe consumer and its thread start at the first partition tracked
    for `after_s`, and are closed by `close`.
    """

    def __init__(self, conf: dict[str, Any], after_s: float = PAUSED_PROBE_AFTER_S) -> None:
        """`conf`: the sink consumer's librdkafka properties (connection, security,
        pass-through, isolation level); group membership is dropped."""
        self._conf = {
            **{k: v for k, v in conf.items() if k not in _SINK_ONLY_KEYS},
            "group.id": f"lance-sink-paused-probe-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "max.partition.fetch.bytes": 1024,
            "fetch.wait.max.ms": PAUSED_PROBE_FETCH_WAIT_MS,
            "queued.max.messages.kbytes": 1024,
        }
        self._after_s = after_s
        self._since: dict[tuple[str, int], float] = {}  # paused partitions, since when
        self._ends: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def track(self, paused: Iterable[tuple[str, int]]) -> None:
        """The partitions unfetched (paused, writerless) now (every other one is dropped)."""
        now = time.monotonic()
        keys = set(paused)
        with self._lock:
            self._since = {k: self._since.get(k, now) for k in keys}
            for key in set(self._ends) - keys:
                del self._ends[key]
            start = self._thread is None and bool(keys) and not self._stop.is_set()
            if start:
                self._thread = threading.Thread(target=self._run, name="paused-ends", daemon=True)
        if start and self._thread is not None:
            self._thread.start()

    def end(self, key: tuple[str, int]) -> int:
        """The newest end offset the probe fetched for `key`; -1 if none (not paused long
        enough, or no fetch answered yet)."""
        with self._lock:
            return self._ends.get(key, -1)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the probe and close its consumer (waits up to `timeout`)."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _due(self) -> set[tuple[str, int]]:
        now = time.monotonic()
        with self._lock:
            return {k for k, since in self._since.items() if now - since >= self._after_s}

    def _run(self) -> None:
        consumer: confluent_kafka.Consumer | None = None
        assigned: set[tuple[str, int]] = set()
        try:
            while not self._stop.is_set():
                due = self._due()
                if due != assigned:
                    if consumer is None:
                        consumer = confluent_kafka.Consumer(self._conf)
                    # From the end (one ListOffsets each): fetches from there carry the
                    # high watermark, whatever the broker answers to ListOffsets.
                    consumer.assign(
                        [TopicPartition(t, p, confluent_kafka.OFFSET_END) for t, p in due]
                    )
                    assigned = due
                if consumer is None or not assigned:
                    self._stop.wait(0.25)
                    continue
                consumer.consume(1000, PAUSED_PROBE_FETCH_WAIT_MS / 1000)
                for topic, partition in assigned:
                    high = consumer.get_watermark_offsets(
                        TopicPartition(topic, partition), cached=True
                    )[1]
                    if high >= 0:
                        with self._lock:
                            if (topic, partition) in self._since:
                                self._ends[(topic, partition)] = high
        except (RuntimeError, confluent_kafka.KafkaException):
            # The figures only stay as stale as without the probe; the sink goes on.
            log.warning("paused_end_probe_failed", exc_info=True)
        finally:
            if consumer is not None:
                with contextlib.suppress(RuntimeError, confluent_kafka.KafkaException):
                    consumer.close()


class FlushedReader:
    """Reads each partition's flushed watermark from table storage (see the module
    docstring), for the table and WAL location of `settings`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def read(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """1 + the last offset in the Lance table per topic-partition, for those with a
        recorded flush.

        Raises:
            engine.errors.PersistenceError: table storage could not be read.
        """
        # Imported here: Lance and the storage clients take a second to import, which the
        # caller spends on the broker round trips instead.
        import lance  # noqa: PLC0415

        from engine.manifest import ManifestStore, ShardManifest  # noqa: PLC0415
        from engine.schema import TableSpec  # noqa: PLC0415
        from engine.shard_ids import shard_id  # noqa: PLC0415
        from engine.storage import is_local, local_path, open_storage  # noqa: PLC0415
        from engine.table import BaseTable  # noqa: PLC0415

        spec = TableSpec.from_settings(self.settings.table)
        wal_uri = self.settings.wal_uri
        if is_local(wal_uri) and not Path(local_path(wal_uri)).is_dir():
            return {}  # no sink ever wrote here (and a read must not create the folder)
        storage = open_storage(wal_uri, spec.storage_options, fsync=False)
        table = BaseTable(spec, sync=False)
        try:
            ds = lance.dataset(spec.uri, storage_options=dict(spec.storage_options) or None)
        except (OSError, ValueError):
            ds = None  # no table yet: nothing flushed

        def manifest(key: tuple[str, int]) -> tuple[str, ShardManifest]:
            shard = shard_id(spec.uri, *key)
            return shard, ManifestStore(storage, shard).latest()

        keys = list(partitions)
        with ThreadPoolExecutor(MANIFEST_READERS, thread_name_prefix="manifest") as pool:
            manifests = list(pool.map(manifest, keys))
        out = {}
        for (topic, partition), (shard, current) in zip(keys, manifests, strict=True):
            name = f"{topic}:{partition}"
            last = current.flushed_offsets.get(name)
            if ds is not None:  # one dataset, one thread: Lance datasets are not shareable
                mark = table.find_flush(shard, current.lance_version, ds)
                if mark is not None and name in mark.offsets:
                    last = max(last if last is not None else -1, mark.offsets[name])
            if last is not None:
                out[(topic, partition)] = last + 1
        return out


def unindexed_rows(ds: lance.LanceDataset) -> dict[str, int]:
    """Index lag of the base table as it is now: per index, the rows of the fragments its
    segments do not cover (flushed since it was built or last optimised). Reads manifest
    metadata only (fragment row counts, index segments), no data: cheap enough for every
    status call."""
    rows = {int(f.fragment_id): int(f.metadata.num_rows) for f in ds.get_fragments()}
    out = {}
    for index in ds.describe_indices():
        covered = {int(f) for segment in index.segments for f in segment.fragment_ids}
        out[str(index.name)] = sum(n for fid, n in rows.items() if fid not in covered)
    return out
