"""The one metrics facade: a method per domain event, Prometheus exposition.

Every metric name lives in this module; the consumer loop, the engine (through
`EngineEvents`), maintenance and the query API call methods, never `prometheus_client`.
Names carry their unit (`_bytes`, `_seconds`, `_messages`, `_total`), every metric has HELP
text, and per-partition label sets are bounded by the assignment: series of a revoked
partition are removed (`forget_partition`).

`observability.partition_metrics` chooses the labels of the metrics of a topic-partition and
of its shard. `"partition"` (the default): `topic` and `partition`, or `shard`, one series
per partition and per shard held. `"topic"` (for very wide topics: ~36 series a partition
were 37,000 at 1,024 partitions, issue #39): `topic` alone, so the series do not grow with
the partitions. Each partition's and shard's gauge values are still kept here, and a
topic's series is, at exposition, the sum over its partitions held by this process (offsets,
lags, bytes, and the 0/1 gauges, which then count partitions), or for the ages
`lag_seconds`, `dlq_held_seconds` and `replay_seconds` the largest; counters and histograms
count the topic's events. A shard's topic is what the engine reported when it opened it
(`shard_origin`). A revoked partition's gauge values leave its topic's sums; a topic's
counters and histograms stay (they only grow).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final, Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from sink.lag import PartitionOffsets

# `*_created` series double every counter and histogram for little use; Prometheus does not
# need them to compute rates.
disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus-client

PREFIX = "lance_sink"

# WAL appends on a local disk take ~1-10 ms, on object storage ~10-100 ms.
_APPEND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Flushes write a whole memtable: tens of milliseconds to tens of seconds.
_FLUSH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_QUERY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
# Durable -> committed: the commit interval (20 ms default) plus a broker round trip; fine
# steps around a few flush intervals, where the target of a low-latency sink lies.
_COMMIT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
)
#: The stages of a row's path whose freshness is measured, in order.
FRESHNESS_STAGES: Final = ("fetched", "decoded", "durable", "committed")
#: How many recent samples per stage the status's percentiles use.
RECENT_SAMPLES: Final = 1024


class RecentSamples:
    """The last `RECENT_SAMPLES` values (thread-safe: the loop adds, a status reads)."""

    def __init__(self) -> None:
        self._values: deque[float] = deque(maxlen=RECENT_SAMPLES)

    def add(self, value: float) -> None:
        self._values.append(value)  # one deque append: atomic under the GIL

    def percentiles(self) -> dict[str, float] | None:
        values = sorted(self._values.copy())  # one C call: no append interleaves
        if not values:
            return None
        return {
            "p50": round(values[len(values) // 2], 4),
            "p99": round(values[min(len(values) - 1, len(values) * 99 // 100)], 4),
            "samples": len(values),
        }


# Message timestamp -> visible: the group-commit window (20 ms) up to a backlog of minutes.
_FRESHNESS_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)


#: `observability.partition_metrics`: the labels of per-partition and per-shard metrics.
PartitionMetrics = Literal["partition", "topic"]


class TopicCombined:
    """A gauge of partitions (or shards) exported by topic: each one's value is kept, and
    the topic's series is `combine` (sum, or max) of its values at exposition. Thread-safe
    (the loop and the scrape threads set values)."""

    def __init__(self, gauge: Gauge, combine: Callable[[Iterable[float]], float]) -> None:
        self._gauge = gauge
        self._combine = combine
        self._values: dict[str, dict[object, float]] = {}
        self._lock = threading.Lock()

    def set(self, topic: str, key: object, value: float) -> None:
        with self._lock:
            values = self._values.get(topic)
            if values is None:
                values = self._values[topic] = {}
                self._gauge.labels(topic).set_function(lambda: self._read(values))
            values[key] = value

    def _read(self, values: dict[object, float]) -> float:
        with self._lock:
            return float(self._combine(values.values())) if values else 0.0

    def remove(self, topic: str, key: object) -> None:
        """Drop `key`'s value; the topic's series goes with its last one."""
        with self._lock:
            values = self._values.get(topic)
            if values is None or values.pop(key, None) is None or values:
                return
            del self._values[topic]
            with contextlib.suppress(KeyError):
                self._gauge.remove(topic)


class Metrics:
    """All lance-sink metrics, in their own registry (one per process, or per test).

    `partition_metrics`: the labels of per-partition and per-shard metrics (the module
    docstring)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        partition_metrics: PartitionMetrics = "partition",
    ) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.by_topic = partition_metrics == "topic"
        tp = ["topic"] if self.by_topic else ["topic", "partition"]

        def gauge(name: str, doc: str, labels: list[str] | None = None) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, labels or [], registry=r)

        def counter(name: str, doc: str, labels: list[str] | None = None) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels or [], registry=r)

        # Offsets and lags per topic-partition. An offset here is "the next offset to read"
        # convention of Kafka: durable/committed/flushed = 1 + the last such offset.
        self.log_end_offset = gauge("log_end_offset", "Log end offset (high watermark).", tp)
        self.consumed_offset = gauge(
            "consumed_offset", "Next offset the consumer will hand to the sink (position).", tp
        )
        self.durable_offset = gauge(
            "durable_offset",
            "1 + the last offset whose WAL append is durable, or past it to offsets without rows.",
            tp,
        )
        self.committed_offset = gauge("committed_offset", "Offset committed to Kafka.", tp)
        self.flushed_offset = gauge(
            "flushed_offset",
            "1 + the last offset flushed into the Lance table, or past it to offsets without rows.",
            tp,
        )
        self.consumer_lag = gauge(
            "consumer_lag_messages", "Log end offset minus consumed position.", tp
        )
        self.durable_lag = gauge("durable_lag_messages", "Log end offset minus durable offset.", tp)
        self.commit_lag = gauge("commit_lag_messages", "Log end offset minus committed offset.", tp)
        self.flush_lag = gauge("flush_lag_messages", "Log end offset minus flushed offset.", tp)
        self.lag_seconds = gauge(
            "lag_seconds",
            "Age of the oldest message not yet durable (0 when caught up).",
            tp,
        )
        self.paused = gauge("partition_paused", "1 while the partition is paused.", tp)
        self.writer_poisoned = gauge("writer_poisoned", "1 while the shard writer is poisoned.", tp)
        self.stopped = gauge(
            "partition_stopped",
            "1 once the partition stopped for good (until it is assigned again): a bad message "
            "with no dead-letter topic, a batch the table refused, or an offset past the "
            "partition's log end (/readyz says which).",
            tp,
        )
        self.skipped_offsets = counter(
            "offsets_skipped_total",
            "Offsets the broker deleted (retention, DeleteRecords) before the sink read them: "
            "the sink resumed at the log start, their messages are not in the table.",
            tp,
        )
        self.shard_open_failures = counter(
            "shard_open_failures_total",
            "Failed attempts to open (claim and replay) a partition's shard writer; each is "
            "retried with backoff while the partition consumes nothing.",
            tp,
        )
        self.waiting_for_registry = gauge(
            "registry_paused",
            "1 while the partition is paused because the schema registry cannot be reached "
            "(its messages are decoded again when it answers; none go to the DLQ for it).",
            tp,
        )
        self.registry_failures = counter(
            "registry_failures_total",
            "Batches whose decoding failed because the schema registry could not answer.",
            tp,
        )
        self.rows_ingested = counter("rows_ingested_total", "Rows made durable and visible.", tp)
        self.bytes_ingested = counter(
            "bytes_ingested_total", "Arrow bytes of the rows made durable and visible.", tp
        )
        self.dlq_messages = counter(
            "dlq_messages_total",
            "Messages sent to the dead-letter topic, by reason.",
            ["topic", "reason"],
        )
        self.cdc_truncates = counter(
            "cdc_truncates_total",
            "Truncate events (op t) of Debezium change streams skipped (source.truncate = "
            "skip): the table keeps its rows; a truncate decoded again (a redelivery) counts "
            "again.",
            ["topic"],
        )
        self.decode_errors = counter(
            "decode_errors_total",
            "Messages whose decoding raised (no decode path foresaw the value); each is a "
            "decode_error dead letter.",
            ["topic"],
        )
        self.dlq_failures = counter(
            "dlq_delivery_failures_total",
            "Failed attempts to deliver a dead letter (each is re-sent, or replaced by an "
            "envelope), by source topic and librdkafka error.",
            ["topic", "error"],
        )
        self.dlq_omitted = counter(
            "dlq_payload_omitted_total",
            "Dead letters the dead-letter topic refused in full and got as an envelope "
            "(payload in the dead-letter Lance table if configured, and the source topic).",
            ["topic", "reason"],
        )
        self.dlq_held = gauge(
            "dlq_held_seconds",
            "How long the partition has waited for its dead letters to be acknowledged "
            "(0 when none are pending).",
            tp,
        )
        self.commit_delay = Histogram(
            f"{PREFIX}_commit_delay_seconds",
            "Time from an offset becoming durable to its commit being acknowledged.",
            buckets=_COMMIT_BUCKETS,
            registry=r,
        )
        self.freshness = Histogram(
            f"{PREFIX}_freshness_seconds",
            "Time from a batch's oldest message timestamp to its rows being visible.",
            buckets=_FRESHNESS_BUCKETS,
            registry=r,
        )
        self.freshness_stages = Histogram(
            f"{PREFIX}_freshness_stage_seconds",
            "Time from a batch's oldest message timestamp (its broker append, with the "
            "default timestamp type) to the batch passing each stage of its path: fetched "
            "(consume() returned it), decoded (the loop collected it decoded), durable (WAL "
            "durable and visible to queries), committed (the group acknowledged its offset).",
            ["stage"],
            buckets=_FRESHNESS_BUCKETS,
            registry=r,
        )
        #: The last samples of each stage, for the status's percentiles.
        self.recent_stages = {stage: RecentSamples() for stage in FRESHNESS_STAGES}
        self.commit_failures = counter(
            "commit_failures_total", "Offset commits the broker refused or that failed."
        )
        self.rebalances = counter(
            "rebalance_events_total", "Partitions assigned, revoked or lost.", ["event"]
        )

        # Engine, per shard.
        shard = ["topic"] if self.by_topic else ["shard"]
        self.wal_unflushed = gauge(
            "wal_unflushed_bytes", "Bytes in memtables (active and frozen) not yet flushed.", shard
        )
        self.wal_sealed = gauge(
            "wal_sealed_memtables", "Frozen memtables waiting to be flushed.", shard
        )
        self.memtable_bytes = gauge(
            "memtable_bytes", "Resident bytes of the active memtable.", shard
        )
        self.memtable_index_bytes = gauge(
            "memtable_index_bytes", "Resident bytes of in-memory indexes (all memtables).", shard
        )
        self.wal_append_seconds = Histogram(
            f"{PREFIX}_wal_append_seconds",
            "Duration of one durable WAL append.",
            shard,
            buckets=_APPEND_BUCKETS,
            registry=r,
        )
        self.wal_append_bytes = counter(
            "wal_append_bytes_total", "Bytes appended to the WAL.", shard
        )
        self.flush_seconds = Histogram(
            f"{PREFIX}_flush_seconds",
            "Duration of one memtable flush into Lance.",
            shard,
            buckets=_FLUSH_BUCKETS,
            registry=r,
        )
        self.flush_rows = counter("flush_rows_total", "Rows flushed into the Lance table.", shard)
        self.flush_failures = counter(
            "flush_failures_total", "Failed flush attempts (retried).", shard
        )
        self.replay_seconds = gauge(
            "replay_seconds", "Duration of the last WAL replay of the shard.", shard
        )
        self.replay_rows = counter("replay_rows_total", "Rows replayed from the WAL.", shard)

        # Process-wide.
        self.bp_waits = counter("wal_backpressure_waits_total", "Completed backpressure waits.")
        self.bp_wait_seconds = counter(
            "wal_backpressure_wait_seconds_total", "Seconds spent in completed backpressure waits."
        )
        self.bp_active = gauge("wal_backpressure_active_waits", "Backpressure waits in progress.")
        self.bp_rejections = counter(
            "wal_backpressure_rejections_total", "Puts refused with Backpressure."
        )
        self.ingest_paused = counter(
            "ingest_paused_seconds_total",
            "Seconds the consumer loop paused so that the queries running on this pod get "
            "their share of its time (query.ingest_share).",
        )
        self.budget_used = gauge("budget_used_bytes", "Unflushed bytes counted against the budget.")
        self.budget = gauge("budget_bytes", "The process memory budget for unflushed rows.")
        self.unindexed_rows = gauge(
            "base_unindexed_rows", "Rows of the base table not covered by the vector index."
        )
        self.unindexed_cache_bytes = gauge(
            "query_unindexed_cache_bytes",
            "Bytes of base rows the indexes do not cover yet, held in memory for queries "
            "(vector matrices, flushed memtables kept for text search).",
        )
        self.arrow_pool_bytes = gauge(
            "arrow_pool_bytes",
            "Bytes allocated from Arrow's memory pool now (memtables, decoded batches, query "
            "results; Lance and faiss allocate elsewhere).",
        )
        self.lance_cache_bytes = gauge(
            "query_lance_cache_bytes",
            "Bytes held by the Lance index and metadata caches that queries on the base share "
            "(bounded by query.lance_index_cache_bytes and query.lance_metadata_cache_bytes).",
        )
        self.unindexed_fallbacks = counter(
            "query_unindexed_fallbacks",
            "Queries that read unindexed base rows from storage, by kind: vector (the "
            "fragments not held within query.unindexed_cache_bytes, read by the query), text "
            "(Lance's flat scan; before the first text index, the reader's own tokenising of "
            "the whole base): the rows were not all held within the bound, or failed to load.",
            ["kind"],
        )
        self._fallbacks_seen = {"vector": 0, "text": 0}
        self.fanout_missing_total = counter(
            "query_fanout_missing_shards",
            "Shards whose fresh rows a query lacked (answered partial, or failed) because the "
            "pod listed as their owner did not answer in time (timeout), answered with an error "
            "(error) or does not hold them (unheld: a rebalance in progress), or because their "
            "writer advertised no URL to ask (unadvertised), by cause.",
            ["cause"],
        )
        self.fanout_stale_base_total = counter(
            "query_fanout_stale_base",
            "Queries run again on a newer base version because a pod they asked for fresh rows "
            "had flushed past the base version they read.",
        )
        self.maintenance_runs = counter(
            "maintenance_runs_total",
            "Base-table maintenance tasks run, by outcome.",
            ["task", "outcome"],
        )
        self.maintenance_active_gauge = gauge(
            "maintenance_active",
            "1 while this pod runs base-table maintenance: it holds the group's maintenance "
            "partition (partition 0 of the first topic); 0 while another pod does, or with "
            "maintenance off.",
        )
        self.maintenance_process_exits = counter(
            "maintenance_process_exits_total",
            "Times the maintenance child process exited on its own (crash, OOM kill); each "
            "is restarted with backoff.",
        )
        self.query_seconds = Histogram(
            f"{PREFIX}_query_seconds",
            "Query latency by kind (fresh: this pod's answers to other pods' fan-out requests "
            "for its memtables' rows).",
            ["kind"],
            buckets=_QUERY_BUCKETS,
            registry=r,
        )
        self._bp_seen = (0, 0.0, 0)
        self._lock = threading.Lock()
        self.rows_total = 0  # rows ingested by this process (all partitions, ever)
        #: By topic: the topic of each shard opened (`shard_origin`).
        self._shard_topics: dict[str, str] = {}
        #: By topic: each gauge of partitions or shards, combined by topic (keyed by id).
        self._combined: dict[int, TopicCombined] = {}
        if self.by_topic:
            largest = (self.lag_seconds, self.dlq_held, self.replay_seconds)
            for g in (*self._partition_gauges(), *self._shard_gauges()):
                self._combined[id(g)] = TopicCombined(g, max if g in largest else sum)

    def _partition_gauges(self) -> tuple[Gauge, ...]:
        return (
            self.log_end_offset,
            self.consumed_offset,
            self.durable_offset,
            self.committed_offset,
            self.flushed_offset,
            self.consumer_lag,
            self.durable_lag,
            self.commit_lag,
            self.flush_lag,
            self.lag_seconds,
            self.paused,
            self.writer_poisoned,
            self.stopped,
            self.dlq_held,
            self.waiting_for_registry,
        )

    def _shard_gauges(self) -> tuple[Gauge, ...]:
        return (
            self.wal_unflushed,
            self.wal_sealed,
            self.memtable_bytes,
            self.memtable_index_bytes,
            self.replay_seconds,
        )

    # --- labels ----------------------------------------------------------------------

    def _set(self, gauge: Gauge, topic: str, partition: int, value: float) -> None:
        """Set a partition's gauge (by topic: its value in the topic's sum or max)."""
        if self.by_topic:
            self._combined[id(gauge)].set(topic, partition, value)
        else:
            gauge.labels(topic, str(partition)).set(value)

    def _inc(self, counter: Counter, topic: str, partition: int, amount: float = 1) -> None:
        if self.by_topic:
            counter.labels(topic).inc(amount)
        else:
            counter.labels(topic, str(partition)).inc(amount)

    def _shard(self, shard: str) -> str:
        """The label value of a shard's series: the shard, or by topic its topic."""
        return self._shard_topics.get(shard, "") if self.by_topic else shard

    def _set_shard(self, gauge: Gauge, shard: str, value: float) -> None:
        if self.by_topic:
            self._combined[id(gauge)].set(self._shard(shard), shard, value)
        else:
            gauge.labels(shard).set(value)

    # --- exposition ------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    # --- partitions ------------------------------------------------------------------

    def partition_offsets(self, topic: str, partition: int, offsets: PartitionOffsets) -> None:
        """Offsets of one partition (each 'next offset' style, one snapshot: see
        `sink.lag`) and the lags derived from them."""
        self._set(self.consumed_offset, topic, partition, offsets.consumed)
        self._set(self.durable_offset, topic, partition, offsets.durable)
        self._set(self.committed_offset, topic, partition, offsets.committed)
        self._set(self.flushed_offset, topic, partition, offsets.flushed)
        lags = offsets.lags()
        if offsets.end is not None and lags is not None:
            self._set(self.log_end_offset, topic, partition, offsets.end)
            self._set(self.consumer_lag, topic, partition, lags["consumer"])
            self._set(self.durable_lag, topic, partition, lags["durable"])
            self._set(self.commit_lag, topic, partition, lags["commit"])
            self._set(self.flush_lag, topic, partition, lags["flush"])
        self._set(self.lag_seconds, topic, partition, offsets.lag_seconds())

    def partition_paused(self, topic: str, partition: int, paused: bool) -> None:
        self._set(self.paused, topic, partition, 1 if paused else 0)

    def partition_stopped(self, topic: str, partition: int) -> None:
        self._set(self.stopped, topic, partition, 1)

    def offsets_skipped(self, topic: str, partition: int, count: int) -> None:
        self._inc(self.skipped_offsets, topic, partition, count)

    def partition_poisoned(self, topic: str, partition: int, poisoned: bool) -> None:
        self._set(self.writer_poisoned, topic, partition, 1 if poisoned else 0)

    def shard_open_failed(self, topic: str, partition: int) -> None:
        self._inc(self.shard_open_failures, topic, partition)

    def registry_paused(self, topic: str, partition: int, paused: bool) -> None:
        """The partition was paused (a failed registry request) or resumed (decoded) while
        waiting for the schema registry."""
        self._set(self.waiting_for_registry, topic, partition, 1 if paused else 0)
        if paused:
            self._inc(self.registry_failures, topic, partition)

    def ingested(self, topic: str, partition: int, rows: int, nbytes: int) -> None:
        self._inc(self.rows_ingested, topic, partition, rows)
        self.rows_total += rows
        self._inc(self.bytes_ingested, topic, partition, nbytes)

    def committed(self, seconds: float) -> None:
        """An offset commit was acknowledged `seconds` after the offset became durable."""
        self.commit_delay.observe(seconds)

    def visible(self, seconds: float) -> None:
        """Rows became visible `seconds` after their oldest message's timestamp."""
        self.freshness.observe(max(seconds, 0.0))

    def stage_reached(self, stage: str, seconds: float) -> None:
        """A batch passed `stage` (one of `FRESHNESS_STAGES`) `seconds` after its oldest
        message's timestamp."""
        seconds = max(seconds, 0.0)
        self.freshness_stages.labels(stage).observe(seconds)
        self.recent_stages[stage].add(seconds)

    def freshness_percentiles(self) -> dict[str, dict[str, float] | None]:
        """p50 and p99 of each stage over its recent samples (None: no sample yet)."""
        return {stage: recent.percentiles() for stage, recent in self.recent_stages.items()}

    def dead_lettered(self, topic: str, reason: str) -> None:
        self.dlq_messages.labels(topic, reason).inc()

    def cdc_truncates_skipped(self, topic: str, count: int) -> None:
        """`count` truncate events of `topic` were skipped (``source.truncate = "skip"``)."""
        self.cdc_truncates.labels(topic).inc(count)

    def decode_failed(self, topic: str, count: int) -> None:
        """`count` messages of `topic` raised in decoding (decode_error dead letters)."""
        self.decode_errors.labels(topic).inc(count)

    def dlq_delivery_failed(self, topic: str, error: str) -> None:
        self.dlq_failures.labels(topic, error).inc()

    def dlq_payload_omitted(self, topic: str, reason: str) -> None:
        self.dlq_omitted.labels(topic, reason).inc()

    def dlq_waiting(self, topic: str, partition: int, seconds: float) -> None:
        """The partition's oldest unacknowledged dead letters were sent `seconds` ago."""
        self._set(self.dlq_held, topic, partition, seconds)

    def commit_failed(self) -> None:
        self.commit_failures.inc()

    def rebalance(self, event: str, count: int) -> None:
        self.rebalances.labels(event).inc(count)

    def forget_partition(self, topic: str, partition: int, shard: str | None = None) -> None:
        """Remove every series of a partition (and its shard) no longer assigned here (by
        topic: their gauge values leave the topic's sums; counters stay)."""
        if self.by_topic:
            for gauge in self._partition_gauges():
                self._combined[id(gauge)].remove(topic, partition)
            if shard is not None:
                label = self._shard(shard)
                for gauge in self._shard_gauges():
                    self._combined[id(gauge)].remove(label, shard)
            return
        labels = (topic, str(partition))
        for g in (
            *self._partition_gauges(),
            self.skipped_offsets,
            self.shard_open_failures,
            self.registry_failures,
            self.rows_ingested,
            self.bytes_ingested,
        ):
            with contextlib.suppress(KeyError):
                g.remove(*labels)
        if shard is not None:
            for m in (
                *self._shard_gauges(),
                self.wal_append_seconds,
                self.wal_append_bytes,
                self.flush_seconds,
                self.flush_rows,
                self.flush_failures,
                self.replay_rows,
            ):
                with contextlib.suppress(KeyError):
                    m.remove(shard)

    # --- engine (EngineEvents) ---------------------------------------------------------

    def shard_origin(self, shard: str, topic: str, partition: int) -> None:
        """The engine opens `shard`, which carries `topic`'s `partition`."""
        if self.by_topic:
            self._shard_topics[shard] = topic

    def wal_appended(self, shard: str, seconds: float, nbytes: int, rows: int) -> None:
        self.wal_append_seconds.labels(self._shard(shard)).observe(seconds)
        self.wal_append_bytes.labels(self._shard(shard)).inc(nbytes)

    def memtable_sealed(self, shard: str, generation: int, rows: int, nbytes: int) -> None:
        return None  # visible through wal_sealed_memtables (shard_memory)

    def flushed(self, shard: str, seconds: float, rows: int) -> None:
        self.flush_seconds.labels(self._shard(shard)).observe(seconds)
        self.flush_rows.labels(self._shard(shard)).inc(rows)

    def flush_failed(self, shard: str, error: BaseException) -> None:
        self.flush_failures.labels(self._shard(shard)).inc()

    def replayed(self, shard: str, seconds: float, rows: int, nbytes: int) -> None:
        self._set_shard(self.replay_seconds, shard, seconds)
        self.replay_rows.labels(self._shard(shard)).inc(rows)

    def poisoned(self, shard: str, error: BaseException) -> None:
        return None  # per partition: writer_poisoned, set by the sink

    def shard_memory(
        self, shard: str, *, unflushed: int, frozen_count: int, active: int, index: int
    ) -> None:
        self._set_shard(self.wal_unflushed, shard, unflushed)
        self._set_shard(self.wal_sealed, shard, frozen_count)
        self._set_shard(self.memtable_bytes, shard, active)
        self._set_shard(self.memtable_index_bytes, shard, index)

    def backpressure(
        self, *, waits: int, wait_seconds: float, active: int, rejections: int
    ) -> None:
        """Mirror the controller's cumulative counters (counters only move forward)."""
        with self._lock:
            seen_waits, seen_seconds, seen_rejections = self._bp_seen
            if waits > seen_waits:
                self.bp_waits.inc(waits - seen_waits)
            if wait_seconds > seen_seconds:
                self.bp_wait_seconds.inc(wait_seconds - seen_seconds)
            if rejections > seen_rejections:
                self.bp_rejections.inc(rejections - seen_rejections)
            self._bp_seen = (
                max(waits, seen_waits),
                max(wait_seconds, seen_seconds),
                max(rejections, seen_rejections),
            )
        self.bp_active.set(active)

    def budget_usage(self, used: int, budget: int) -> None:
        self.budget_used.set(used)
        self.budget.set(budget)

    # --- maintenance and queries -------------------------------------------------------

    def ran(self, task: str, outcome: str, seconds: float) -> None:
        """A maintenance task ran (MaintenanceEvents)."""
        self.maintenance_runs.labels(task, outcome).inc()

    def process_exited(self, exitcode: int | None) -> None:
        """The maintenance child process exited on its own (MaintenanceEvents)."""
        self.maintenance_process_exits.inc()

    def maintenance_active(self, active: bool) -> None:
        """This pod started (True) or stopped (False) running maintenance
        (`sink.maintenance_role`)."""
        self.maintenance_active_gauge.set(1 if active else 0)

    def base_unindexed(self, rows: int) -> None:
        self.unindexed_rows.set(rows)

    def lance_cache(self, nbytes: int) -> None:
        self.lance_cache_bytes.set(nbytes)

    def arrow_pool(self, nbytes: int) -> None:
        self.arrow_pool_bytes.set(nbytes)

    def unindexed_cache(self, nbytes: int, vector_fallbacks: int, text_fallbacks: int) -> None:
        """The reader's holders of unindexed base rows: bytes held, and each kind's fallbacks
        so far (totals)."""
        self.unindexed_cache_bytes.set(nbytes)
        for kind, total in (("vector", vector_fallbacks), ("text", text_fallbacks)):
            if total > self._fallbacks_seen[kind]:
                self.unindexed_fallbacks.labels(kind).inc(total - self._fallbacks_seen[kind])
                self._fallbacks_seen[kind] = total

    def query(self, kind: str, seconds: float, rows: int = 0) -> None:
        """A query completed (ReaderEvents)."""
        self.query_seconds.labels(kind).observe(seconds)

    def shard_skipped(self, shard: str, error: BaseException) -> None:
        """A query skipped a shard whose writer is poisoned or fenced (ReaderEvents)."""

    def fanout_missing(self, shard: str, cause: str) -> None:
        """A query lacked another pod's fresh rows of a shard (ReaderEvents)."""
        self.fanout_missing_total.labels(cause).inc()

    def fanout_stale_base(self) -> None:
        """A query runs again: an owner pod flushed past its base version (ReaderEvents)."""
        self.fanout_stale_base_total.inc()


def resident_bytes() -> int | None:
    """This process's resident memory (Linux `/proc/self/statm`), or None elsewhere."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def memory_limit_bytes() -> int | None:
    """The memory limit of this process's cgroup (a pod's `resources.limits.memory`): v2
    `memory.max`, else v1 `memory.limit_in_bytes`; None when unlimited or unknown."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit():
            return None
        limit = int(text)
        return None if limit >= 1 << 60 else limit  # v1 reports "unlimited" as ~2^63
    return None
