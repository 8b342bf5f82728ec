"""The sink service: one consumer loop feeding one shard writer per assigned topic-partition.

Lifecycle:

- `SinkService(settings)` builds the engine (opens or creates the Lance table: a schema
  mismatch raises here), the consumer, the dead-letter producer and the metrics facade.
- `run()` (the CLI's `lance-sink run`) subscribes and loops until `stop()` (SIGTERM/SIGINT)
  or a fatal error, then drains: it stops fetching, lets in-flight appends finish, commits,
  flushes or leaves the rest to replay, and closes, all within `shutdown.drain_deadline_s`.
  It returns the process exit code (see `sink.cli`).
- Rebalance callbacks run inside `consume()` on the loop thread:
  assign → open the shard writers (claim + replay, in parallel) and start each partition at
  max(committed offset, durable offset + 1) (I3); revoke → stop feeding, let in-flight
  appends finish (bounded), commit synchronously, close the writer leaving its WAL to the
  next owner (the next owner replays it; handing over is then a matter of milliseconds);
  lost → close without committing.

The loop never blocks on storage or on decoding: each partition's consumed messages are
decoded on `source.decode_workers` threads (each in a worker process of its own with
`source.decode_processes`) and put in offset order as their decoding ends;
puts return futures that are checked on each iteration; `consume()` is called every
`kafka.consume_timeout_ms` whatever the writers do, so commits follow durability closely.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import confluent_kafka
import pyarrow as pa
import structlog
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._listoffsets import OffsetSpec  # not re-exported for typing

from config.settings import Settings
from engine.backpressure import BudgetController
from engine.engine import Engine
from engine.errors import Backpressure, Fenced, InvalidRecord, LanceSinkError, Poisoned
from engine.maintenance import Maintenance, MaintenanceProcess
from engine.malloc import release_free_memory
from engine.periodic import PeriodicThread
from engine.reader import Fanout, Reader, ReaderSettings
from engine.reads.owners import ShardOwners
from engine.shard import PutResult, ShardWriter
from engine.threads import name_os_thread
from engine.wal import SourceRange
from sink.base_status import BaseTableStatus
from sink.decode import Decoder, freeze_gc
from sink.decode_process import ProcessDecoder
from sink.decoded import Decoded
from sink.dlq import DeadLetterBatch, DeadLetterProducer
from sink.dlq import producer_conf as dlq_producer_conf
from sink.formats import RegistryUnavailable, SchemaCheckMode, SchemaEvolution
from sink.http import ServerHandle, create_query_app, run_server
from sink.kafka_conf import kafka_security_conf, lag_confs
from sink.lag import PartitionOffsets, PausedEnds, unindexed_rows
from sink.log import configure_logging, librdkafka_logger
from sink.maintenance_role import MaintenanceRole
from sink.metrics import Metrics, memory_limit_bytes, resident_bytes
from sink.refused import split_refused
from sink.server import create_ops_app
from sink.topic_shards import TopicShards

log = structlog.get_logger("lance_sink.sink")

# Where a partition with neither a committed offset nor WAL state starts
# (`kafka.auto_offset_reset`): the sink assigns it there itself, as librdkafka's own
# auto.offset.reset is "error" (see `out_of_range_action`).
START_AT: Final = {
    "earliest": confluent_kafka.OFFSET_BEGINNING,
    "latest": confluent_kafka.OFFSET_END,
}
# Longest wait for a partition's log range after the broker refused a fetch offset.
LOG_RANGE_TIMEOUT_S = 10.0
# An offset past the log end stops its partition only when the broker keeps refusing it
# for this long (asked again every `OUT_OF_RANGE_RETRY_S`): a broker that just restarted
# may report its log end late, which no truncation explains.
OUT_OF_RANGE_GRACE_S = 10.0
OUT_OF_RANGE_RETRY_S = 1.0
METRICS_INTERVAL_S = 1.0  # how often gauges are refreshed: matches a typical scrape
RECOVERY_BACKOFF_S = 1.0  # wait before reopening a poisoned writer (doubles per failure)
# Longest wait between two attempts to open a shard that keeps failing: long enough not to
# hammer a failing store, short enough that a fixed cause is noticed within half a minute.
RECOVERY_BACKOFF_MAX_S = 30.0
# Committed-offset look-ups on assign (a broker round trip; bounded by the drain deadline
# while stopping).
COMMITTED_TIMEOUT_S = 30.0
# What the drain keeps for the steps after the partitions and the maintenance child
# (closing the reader, the engine and the servers): the maintenance child may use the
# drain deadline less this (see `_drain`).
DRAIN_RESERVE_S = 2.0
# How often free malloc memory is given back (`engine.malloc.release_free_memory`): queries
# and flushes free hundreds of MiB in bursts; a pass takes milliseconds.
MALLOC_TRIM_INTERVAL_S = 5.0
# The status's ingest rate averages this many metrics refreshes (10 s at 1 s): long enough
# to smooth consume batches, short enough to show a stall within seconds.
INGEST_WINDOW_SAMPLES = 11
# Consumed messages waiting for (or in) decoding, in consume() batches: a bound on what the
# loop takes from librdkafka before the decode workers catch up (a fixed memory overhead).
DECODE_QUEUE_BATCHES = 2
# One consume() call takes about this many payload bytes (at most kafka.consume_batch_size
# messages): creating the message objects is the loop's own work, and a 10k batch of 4 KB
# vector messages kept it from noticing durable puts and committing for tens of ms.
CONSUME_TARGET_BYTES = 8 << 20
# `run()`'s exit code when a writer schema needs the derived table evolved first: the CLI
# then restarts the process (EX_TEMPFAIL), which evolves the table as it opens it.
EXIT_RESTART_TO_EVOLVE = 75
# The consumer's topic.metadata.refresh.interval.ms (see `consumer_conf`): the longest a
# topic created after the start, or a partition added, waits to be assigned. The same as
# `sink.topic_shards.REFRESH_S`, so fan-out reads and consumption learn of it alike.
METADATA_REFRESH_MS = 10_000


class FatalSinkError(LanceSinkError):
    """The service cannot continue (fatal Kafka error, authentication failure, ...)."""


def consumer_conf(settings: Settings) -> dict[str, Any]:
    """The consumer's librdkafka properties: typed settings, sink-owned keys, pass-through."""
    k = settings.kafka
    conf = kafka_security_conf(settings)
    conf.update(
        {
            "group.id": k.group_id,
            # The sink starts a partition without offsets at kafka.auto_offset_reset itself
            # (`START_AT`); an offset the broker no longer has is reported to it, never
            # replaced silently (`out_of_range_action`).
            "auto.offset.reset": "error",
            "isolation.level": k.isolation_level,
            "session.timeout.ms": k.session_timeout_ms,
            "max.poll.interval.ms": k.max_poll_interval_ms,
            # Owned by the sink: offsets are stored and committed only once durable (I1).
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": False,
            "partition.assignment.strategy": "cooperative-sticky",
            "statistics.interval.ms": settings.observability.kafka_statistics_interval_ms,
            # How long the broker may hold an empty fetch. librdkafka's 500 ms default adds
            # that much to freshness on brokers that do not answer early when data arrives.
            "fetch.wait.max.ms": 100,
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


@dataclass
class _InFlight:
    """A put on its way to durability, covering source offsets up to `last`."""

    last: int
    future: Future[PutResult] | None
    rows: int
    nbytes: int
    first_timestamp_ms: int | None


@dataclass
class _Decoding:
    """Consumed messages of one partition on their way through a decode worker."""

    messages: list[Any]
    future: Future[Decoded]


@dataclass
class _Held:
    """A decoded batch that could not be put yet (dead letters unacknowledged, or
    backpressure). While a batch is held its partition is paused; messages fetched
    meanwhile are dropped and fetched again from `position` on resume."""

    decoded: Decoded
    messages: list[Any]
    dead_letters: DeadLetterBatch | None = None


@dataclass
class PartitionState:
    """One assigned topic-partition and its shard writer.

    Offsets follow Kafka's convention: `position`, `done` and `committed` are each the next
    offset to read. `done` only advances over offsets whose rows are durable (or whose
    dead letters were acknowledged, or that carry no rows: tombstones, and the control
    records and aborted messages the consumer skips, see `_skip_records_without_data`),
    so committing `done` keeps I1.
    """

    topic: str
    partition: int
    writer: ShardWriter | None
    position: int | None
    done: int | None
    committed: int
    decoding: deque[_Decoding] = field(default_factory=deque)  # offset order
    parked: list[Any] = field(default_factory=list)  # consumed while the decoders were full
    inflight: deque[_InFlight] = field(default_factory=deque)
    durable_at: deque[tuple[int, float]] = field(default_factory=deque)  # (done, when)
    held: _Held | None = None
    paused: bool = False
    fenced: bool = False  # a newer writer owns the shard: wait to lose the partition
    fenced_at: float | None = None
    stopped: str | None = None  # why the partition stopped for good (see `_stop_partition`)
    # The broker refused to fetch from this offset (out of range): the partition's log
    # range, being looked up on the open pool (`_offset_out_of_range`); the offset and when
    # to fetch it again; since when the broker has refused it (reset by any message).
    out_of_range: tuple[int, Future[tuple[int, int]]] | None = None
    out_of_range_retry: tuple[int, float] | None = None
    out_of_range_since: float | None = None
    recover_at: float = 0.0
    # Opening the shard writer (on assign, or to recover it) on the open pool; while it
    # fails, `open_error` says why and `open_failures` counts the attempts in a row.
    opening: Future[tuple[ShardWriter, int | None]] | None = None
    open_error: str | None = None
    open_failures: int = 0
    committed_known: bool = True  # False: the committed-offset look-up failed; retried
    # The schema registry could not be asked while decoding (`_registry_failed`): paused,
    # decoded again from `position` at `registry_retry_at`; failures in a row, last error.
    registry_retry_at: float | None = None
    registry_failures: int = 0
    registry_error: str | None = None
    # The first message of batches dropped before they were put, as (offset, timestamp
    # ms): a registry outage or a schema evolution rewound `position` to it. Consumed, not
    # durable, fetched again: the lag in seconds counts from it (nothing in flight or held
    # says so meanwhile) until `done` passes it.
    rewound: tuple[int, int | None] | None = None
    assigned: bool = True  # handed to the consumer (incremental_assign) already
    # The shard of the writer last opened for the partition (its series are removed on
    # release), and what that writer last reported as durable and flushed (1 + offset)
    # when it was dropped: the offsets shown while the partition has no writer.
    shard: str | None = None
    writer_durable: int = 0
    writer_flushed: int = 0

    @property
    def fetched(self) -> bool:
        """Whether the sink's consumer fetches the partition (so librdkafka's cached high
        watermark is current): assigned to it, not paused, with a shard writer."""
        return self.assigned and not self.paused and self.writer is not None

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)


class SinkService:
    """See the module docstring for the lifecycle."""

    def __init__(
        self,
        settings: Settings,
        *,
        metrics: Metrics | None = None,
        engine: Engine | None = None,
        derived_columns: bool = False,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.engine = engine or Engine.from_settings(settings, events=self.metrics)
        schema_check: SchemaCheckMode = (
            "off" if not derived_columns else "evolve" if settings.table.evolve else "warn"
        )
        self.decoder: Decoder | ProcessDecoder = (
            ProcessDecoder(
                self.engine.spec,
                settings.source,
                schema_check=schema_check,
                workers=settings.source.decode_workers,
                log_config=(settings.observability.log_level, settings.observability.log_format),
            )
            if settings.source.decode_processes
            else Decoder(self.engine.spec, settings.source, schema_check=schema_check)
        )
        # Set when a writer schema needs the table evolved: `run` drains and returns
        # EXIT_RESTART_TO_EVOLVE (see `_evolution_needed`).
        self.evolution: SchemaEvolution | None = None
        self.dlq = (
            DeadLetterProducer(
                dlq_producer_conf(kafka_security_conf(settings), settings),
                settings.dlq.topic_template,
                self.metrics,
                table_uri=settings.dlq.lance_table_uri,
                storage_options=self.engine.spec.storage_options,
                retention_s=settings.maintenance.cleanup_retention_s,
            )
            if settings.dlq.enabled
            else None
        )
        query = settings.query
        # Every partition's shard, so no query routes by an owners copy that lacks one.
        self.topic_shards = TopicShards(
            lag_confs(settings)[0], list(settings.kafka.topics), self.engine.shard_id
        )
        self.reader = Reader(
            self.engine.spec,
            self.engine.table,
            self.writers,
            ReaderSettings.from_settings(query),
            events=self.metrics,
            # Fresh rows of the shards other pods hold, from their memtables (fan-out).
            fanout=Fanout(
                ShardOwners(self.engine.storage, query.owners_refresh_ms / 1000),
                query.advertised_url or "",
                query.fanout_timeout_ms / 1000,
                None if query.auth_token is None else query.auth_token.get_secret_value(),
                workers=2 * query.max_concurrent_queries,
                expected=self.topic_shards.current,
            )
            if query.enabled
            else None,
        )
        # Started standing by: one pod of the group runs it, the holder of the maintenance
        # partition (`sink.maintenance_role`, switched from the loop's `_tick`).
        self.maintenance: Maintenance | MaintenanceProcess
        if settings.maintenance.process:
            obs = settings.observability
            self.maintenance = MaintenanceProcess(
                self.engine.spec,
                self.engine.storage.uri,
                settings.maintenance,
                events=self.metrics,
                init=functools.partial(configure_logging, obs.log_level, obs.log_format),
                active=False,
            )
        else:
            self.maintenance = Maintenance(
                self.engine.spec,
                self.engine.table,
                self.engine.storage,
                settings.maintenance,
                events=self.metrics,
                active=False,
            )
        self.maintenance_role = MaintenanceRole(
            list(settings.kafka.topics),
            self.maintenance,
            self.metrics,
            enabled=settings.maintenance.enabled,
        )
        self.servers: list[ServerHandle] = []
        self._trim = PeriodicThread(
            "malloc-trim", MALLOC_TRIM_INTERVAL_S, release_free_memory, "malloc_trim_failed"
        )
        self.partitions: dict[tuple[str, int], PartitionState] = {}
        self.end_offsets: dict[tuple[str, int], int] = {}
        self.brokers_up = 0
        self._last_stats = 0.0
        self._last_tick = time.monotonic()
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._stop_at: float | None = None  # when the drain was asked for (monotonic)
        self._fatal: str | None = None
        # Asks the brokers for log ranges (`_offset_out_of_range`); made when first needed.
        self._admin: AdminClient | None = None
        self._open_pool = ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="open", initializer=name_os_thread
        )
        self._decode_pool = ThreadPoolExecutor(
            max_workers=settings.source.decode_workers,
            thread_name_prefix="decode",
            initializer=name_os_thread,
        )
        self._decoding_messages = 0  # handed to the decode workers, not yet fed
        self._parked_messages = 0  # consumed while the decode queue was full
        self._decode_queue_limit = DECODE_QUEUE_BATCHES * settings.kafka.consume_batch_size
        self._consume_size = settings.kafka.consume_batch_size
        registry = settings.source.schema_registry
        self._registry_backoff_max_s = (
            registry.unreachable_backoff_max_s if registry is not None else RECOVERY_BACKOFF_MAX_S
        )
        self._last_commit = 0.0
        self._last_metrics = 0.0
        self._lock = threading.Lock()  # guards `partitions` for readers on other threads
        # One snapshot's gauges are set (and exposed) together; watermarks are read under it.
        self._offsets_lock = threading.RLock()
        self._consumer_closed = False
        # The status's base table figures, read at most one at a time and waited for briefly.
        self._base_figures = BaseTableStatus(self._read_base_figures)
        # (monotonic time, rows ingested) once a second: the ingest rate over the last 10 s
        self._ingest_window: deque[tuple[float, int]] = deque(maxlen=INGEST_WINDOW_SAMPLES)
        conf = consumer_conf(settings)
        conf.update(
            {
                "logger": librdkafka_logger(),
                "error_cb": self._on_error,
                "stats_cb": self._on_stats,
                "on_commit": self._on_commit,
            }
        )
        self.consumer = confluent_kafka.Consumer(conf)
        # End offsets of partitions paused for a while (the consumer does not fetch them).
        self._paused_ends = PausedEnds(conf)

    # ------------------------------------------------------------------ control

    def stop(self) -> None:
        """Ask the loop to drain and return (signal handlers call this). The drain deadline
        (`shutdown.drain_deadline_s`) counts from the first call."""
        if self._stop_at is None:
            self._stop_at = time.monotonic()
        self._stop.set()

    def _drain_left(self) -> float | None:
        """Seconds left until the drain deadline (None while not stopping)."""
        if self._stop_at is None:
            return None
        deadline = self._stop_at + self.settings.shutdown.drain_deadline_s
        return max(deadline - time.monotonic(), 0.0)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def writers(self) -> list[ShardWriter]:
        """The open shard writers (readers and the query layer use these)."""
        with self._lock:
            return [s.writer for s in self.partitions.values() if s.writer is not None]

    # ------------------------------------------------------------------ main loop

    def start_servers(self) -> None:
        """Serve /metrics, /healthz, /readyz, /v1/status and (if enabled) the query API."""
        obs, query = self.settings.observability, self.settings.query
        if query.enabled and query.port == obs.metrics_port and query.port != 0:
            app = create_ops_app(self, create_query_app(self.reader, query))
            self.servers.append(run_server(app, query.host, query.port))
            return
        ops = create_ops_app(self, auth_token=query.auth_token)
        self.servers.append(run_server(ops, obs.metrics_host, obs.metrics_port))
        if query.enabled:
            self.servers.append(
                run_server(create_query_app(self.reader, query), query.host, query.port)
            )

    def run(self) -> int:
        """Consume until stopped; returns the exit code (0 clean, 1 fatal)."""
        k = self.settings.kafka
        if self.reader.ctx.fanout is not None:
            self.topic_shards.start()
        self.start_servers()
        self._trim.start()
        if self.settings.maintenance.enabled:
            self.maintenance.start()
        self.consumer.subscribe(
            list(k.topics),
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        log.info("sink_started", topics=list(k.topics), group=k.group_id)
        freeze_gc()
        timeout = k.consume_timeout_ms / 1000
        code = 0
        try:
            while not self._stop.is_set():
                self._last_tick = time.monotonic()
                messages = []
                if self._decoding_messages < self._decode_queue_limit:
                    messages = self.consumer.consume(self._consume_size, timeout)
                else:
                    # Decoding is behind: take at most one message (parked) per iteration,
                    # which still serves librdkafka's callbacks (commit results, rebalances)
                    # that only consume() delivers; stop taking any once parking is full.
                    if self._parked_messages < self._decode_queue_limit:
                        messages = self.consumer.consume(1, 0)
                    self._wait_decoded(timeout)
                if messages:
                    self._handle(messages)
                self._tick()
                if self._fatal is not None:
                    log.error("sink_fatal", reason=self._fatal)
                    code = 1
                    break
                if self.evolution is not None:
                    code = EXIT_RESTART_TO_EVOLVE
                    break
        except LanceSinkError as exc:
            log.error("sink_fatal", reason=str(exc), error_type=type(exc).__name__)
            code = 1
        finally:
            self._drain()
            gc.unfreeze()
        return code

    def _wait_decoded(self, timeout: float) -> None:
        """The decode queue is full: wait (bounded) until some partition's oldest batch is
        decoded (only that lets batches be fed, in offset order)."""
        heads: list[Future[Any]] = [
            s.decoding[0].future for s in self.partitions.values() if s.decoding
        ]
        if heads:
            # A put that becomes durable meanwhile ends the wait too: its offsets are then
            # committed in this iteration, not after the decoding.
            heads += [
                s.inflight[0].future
                for s in self.partitions.values()
                if s.inflight and s.inflight[0].future is not None
            ]
            wait(heads, timeout, return_when=FIRST_COMPLETED)

    def _tick(self) -> None:
        """Everything a loop iteration does besides consuming."""
        self._collect_decoded()
        if self.dlq is not None:
            self.dlq.poll()
        self._service_held()
        self._service_out_of_range()
        self._advance()
        self.maintenance_role.update(self.partitions)
        now = time.monotonic()
        # The interval runs from the last commit sent: an offset that becomes durable later
        # than that is committed at once, not at the next multiple of the interval.
        interval = self.settings.kafka.commit_interval_ms / 1000
        if now - self._last_commit >= interval and self._commit(asynchronous=True):
            self._last_commit = now
        if now - self._last_metrics >= METRICS_INTERVAL_S:
            self._last_metrics = now
            self._check_writers()
            self.refresh_metrics()
            self._check_fenced_everywhere(now)

    def _check_writers(self) -> None:
        """Notice writers poisoned or fenced between puts (a fence found by the writer's
        own manifest probe, a flush that kept failing)."""
        for state in list(self.partitions.values()):
            writer = state.writer
            if writer is not None and writer.poisoned is not None:
                self._writer_failed(state, writer.poisoned)

    def _check_fenced_everywhere(self, now: float) -> None:
        """Every assigned partition fenced by newer writers, for longer than the group needs
        to take them away: this process is a zombie (its session expired while it was alive)
        and stops, so its orchestrator restarts it into the group."""
        states = list(self.partitions.values())
        grace = 2 * self.settings.kafka.session_timeout_ms / 1000
        if states and all(s.fenced_at is not None and now - s.fenced_at > grace for s in states):
            self._fatal = "every assigned partition is fenced by a newer writer"

    def _handle(self, messages: list[Any]) -> None:
        self._size_next_consume(messages)
        groups: dict[tuple[str, int], list[Any]] = {}
        for m in messages:
            err = m.error()
            if err is not None:
                if err.code() == confluent_kafka.KafkaError._AUTO_OFFSET_RESET:
                    self._offset_out_of_range(m.topic(), m.partition(), m.offset(), err)
                else:
                    self._on_message_error(err)
                continue
            groups.setdefault((m.topic(), m.partition()), []).append(m)
        for key, batch in groups.items():
            state = self.partitions.get(key)
            if state is None or state.held is not None or state.paused or state.writer is None:
                continue  # not ours, or paused: fetched again from `position` on resume
            if state.position is None:
                state.position = state.done = batch[0].offset()
            position = state.position
            fresh = (
                batch
                if batch[0].offset() >= position
                else [m for m in batch if m.offset() >= position]
            )
            if fresh:
                state.out_of_range_since = None
                state.position = fresh[-1].offset() + 1
                state.parked.extend(fresh)
                self._parked_messages += len(fresh)
                if self._decoding_messages < self._decode_queue_limit:
                    self._submit_parked(state)

    def _size_next_consume(self, messages: list[Any]) -> None:
        """Size the next consume() to about CONSUME_TARGET_BYTES, from this batch's
        message sizes (its first and last message: no per-message work)."""
        sample = (messages[0].value(), messages[-1].value())
        nbytes = max(sum(len(v) for v in sample if v is not None) // 2, 1)
        limit = self.settings.kafka.consume_batch_size
        self._consume_size = max(min(CONSUME_TARGET_BYTES // nbytes, limit), min(100, limit))

    def _submit_parked(self, state: PartitionState) -> None:
        """Hand a partition's consumed messages to a decode worker as one batch."""
        messages, state.parked = state.parked, []
        self._parked_messages -= len(messages)
        self._decoding_messages += len(messages)
        future = self._decode_pool.submit(self.decoder.decode, messages)
        state.decoding.append(_Decoding(messages, future))

    def _collect_decoded(self) -> None:
        """Feed each partition's decoded batches to its writer, oldest first, as far as
        their decoding has ended (a held batch stops the rest: see `_hold`)."""
        for state in list(self.partitions.values()):
            while state.decoding and state.decoding[0].future.done():
                job = state.decoding.popleft()
                self._decoding_messages -= len(job.messages)
                try:
                    decoded = job.future.result()
                except RegistryUnavailable as exc:
                    self._registry_failed(state, job.messages, exc)
                    break
                except SchemaEvolution as exc:
                    self._evolution_needed(state, job.messages, exc)
                    break
                if state.registry_failures:
                    state.registry_failures, state.registry_error = 0, None
                    self.metrics.registry_paused(state.topic, state.partition, False)
                self._feed(state, job.messages, decoded)
        if self._decoding_messages < self._decode_queue_limit:
            for state in list(self.partitions.values()):
                if state.parked and state.held is None:
                    self._submit_parked(state)

    def _registry_failed(
        self, state: PartitionState, messages: list[Any], exc: RegistryUnavailable
    ) -> None:
        """Decoding needed the schema registry and it could not answer: not the messages'
        fault, so nothing is dead-lettered. Pause the partition, forget this batch and the
        ones after it (nothing of them is durable), and decode them again from their first
        offset after a backoff (`_service_held`)."""
        delay = min(
            RECOVERY_BACKOFF_S * 2**state.registry_failures,
            self._registry_backoff_max_s,
        )
        state.registry_failures += 1
        state.registry_error = str(exc)
        state.registry_retry_at = time.monotonic() + delay
        state.position = messages[0].offset()
        _rewind(state, messages[0])
        self._drop_decoding(state)
        self._pause(state)
        self.metrics.registry_paused(state.topic, state.partition, True)
        log.warning(
            "registry_unavailable",
            topic=state.topic,
            partition=state.partition,
            offset=state.position,
            error=state.registry_error,
            attempt=state.registry_failures,
            retry_in_s=delay,
        )

    def _evolution_needed(
        self, state: PartitionState, messages: list[Any], exc: SchemaEvolution
    ) -> None:
        """A batch was written with a schema whose fields the derived table lacks: nothing
        of it is put; the loop drains (what is durable is committed) and the process
        restarts to evolve the table, then reads the batch again from its first offset."""
        state.position = messages[0].offset()
        _rewind(state, messages[0])
        self._drop_decoding(state)
        self._pause(state)
        if self.evolution is None:
            self.evolution = exc
            log.warning(
                "schema_evolution_restart",
                topic=state.topic,
                partition=state.partition,
                offset=state.position,
                reason=exc.message,
                schema_ids=list(exc.schema_ids),
            )

    def _drop_decoding(self, state: PartitionState) -> None:
        """Forget batches not yet fed (nothing of them is durable or committed): they are
        fetched again from `position` (or by the partition's next owner)."""
        for job in state.decoding:
            job.future.cancel()
            self._decoding_messages -= len(job.messages)
        state.decoding.clear()
        self._parked_messages -= len(state.parked)
        state.parked = []

    def _feed(self, state: PartitionState, messages: list[Any], decoded: Decoded) -> None:
        held = _Held(decoded, messages)
        if decoded.dead_letters:
            if errors := sum(d.reason == "decode_error" for d in decoded.dead_letters):
                self.metrics.decode_failed(state.topic, errors)
            if self.dlq is None:
                # Without a dead-letter destination a bad message stops its partition:
                # nothing is dropped silently.
                first = decoded.dead_letters[0]
                log.error(
                    "partition_stopped_on_bad_message",
                    topic=state.topic,
                    partition=state.partition,
                    offset=first.offset,
                    reason=first.reason,
                    detail=first.detail,
                )
                self._hold(state, held)
                self._stop_partition(state, f"bad message at offset {first.offset}: {first.reason}")
                return
            held.dead_letters = self.dlq.send(list(decoded.dead_letters))
            self._hold(state, held)
            return
        if not self._submit(state, held):
            self._hold(state, held)

    def _submit(self, state: PartitionState, held: _Held) -> bool:
        """Put a decoded batch. False = refused by backpressure (the caller holds it)."""
        decoded = held.decoded
        batch = decoded.batch
        first_ts = _timestamp_ms(held.messages[0]) if held.messages else None
        if batch is None or batch.num_rows == 0:
            state.inflight.append(_InFlight(decoded.last_offset, None, 0, 0, first_ts))
            return True
        assert state.writer is not None
        source = SourceRange(
            state.topic, state.partition, decoded.first_offset, decoded.last_offset
        )
        try:
            future = state.writer.put(batch, source)
        except Backpressure:
            return False
        except InvalidRecord as exc:
            # The table refused a batch the decoder accepted: dead-letter every message
            # of it with the reason, rather than stop the partition.
            log.error(
                "batch_rejected_by_table",
                topic=state.topic,
                partition=state.partition,
                first_offset=decoded.first_offset,
                error=str(exc),
            )
            if self.dlq is None:
                self._stop_partition(state, f"batch rejected by the table: {exc}")
                return False
            # The refused rows' messages are dead letters; the other rows are put once
            # those are acknowledged (`_service_held`).
            held.decoded, letters = split_refused(
                decoded, held.messages, exc, self.engine.spec.validate
            )
            held.dead_letters = self.dlq.send(letters)
            return False
        except (Fenced, Poisoned) as exc:
            if held.messages:  # consumed, dropped: the lag in seconds counts from it
                _rewind(state, held.messages[0])
            self._writer_failed(state, exc)
            return True
        nbytes = batch.nbytes
        state.inflight.append(
            _InFlight(decoded.last_offset, future, batch.num_rows, nbytes, first_ts)
        )
        return True

    def _hold(self, state: PartitionState, held: _Held) -> None:
        state.held = held
        # Batches consumed after the held one are dropped and fetched again on resume.
        state.position = held.decoded.last_offset + 1
        self._drop_decoding(state)
        self._pause(state)

    def _service_held(self) -> None:
        for state in list(self.partitions.values()):
            if state.registry_retry_at is not None:
                if state.writer is None or state.fenced or state.stopped:
                    state.registry_retry_at = None  # recovery or revocation takes over
                elif time.monotonic() >= state.registry_retry_at:
                    state.registry_retry_at = None
                    self._resume(state)  # decoded again from `position`
                continue
            held = state.held
            if held is None or state.fenced or state.stopped or state.writer is None:
                if state.writer is None and not state.fenced:
                    self._maybe_recover(state)
                continue
            if held.dead_letters is not None and not held.dead_letters.acked:
                continue
            if not self._submit(state, held):
                continue
            state.held = None
            self._resume(state)

    def _pause(self, state: PartitionState) -> None:
        """Stop fetching the partition (if it is not paused already); `_resume` undoes it."""
        if state.paused:
            return
        self.consumer.pause([state.tp])
        state.paused = True
        self.metrics.partition_paused(state.topic, state.partition, True)
        log.info("partition_paused", topic=state.topic, partition=state.partition)

    def _resume(self, state: PartitionState) -> None:
        if state.position is not None:
            self.consumer.seek(TopicPartition(state.topic, state.partition, state.position))
        self.consumer.resume([state.tp])
        state.paused = False
        self.metrics.partition_paused(state.topic, state.partition, False)
        log.info(
            "partition_resumed",
            topic=state.topic,
            partition=state.partition,
            position=state.position,
        )

    def _advance(self) -> None:
        """Move each partition's `done` over puts that became durable, in order."""
        for state in list(self.partitions.values()):
            while state.inflight:
                head = state.inflight[0]
                if head.future is not None:
                    if not head.future.done():
                        break
                    exc = head.future.exception()
                    if exc is not None:
                        if isinstance(exc, (Fenced, Poisoned)):
                            self._writer_failed(state, exc)
                            break
                        raise FatalSinkError(f"unexpected put failure: {exc}") from exc
                    result = head.future.result()
                    durable_at = result.durable_at
                    self.metrics.ingested(state.topic, state.partition, head.rows, head.nbytes)
                    if head.first_timestamp_ms is not None:
                        visible_age = time.monotonic() - durable_at
                        self.metrics.visible(
                            time.time() - visible_age - head.first_timestamp_ms / 1000
                        )
                else:
                    durable_at = time.monotonic()
                state.done = head.last + 1
                state.durable_at.append((state.done, durable_at))
                state.inflight.popleft()
            rewound = state.rewound
            if rewound is not None and state.done is not None and state.done > rewound[0]:
                state.rewound = None  # durable now (or passed as row-less)

    # ------------------------------------------------------------------ failures

    def _writer_failed(self, state: PartitionState, exc: BaseException) -> None:
        """A fenced or poisoned writer: drop what it did not acknowledge, and either
        recover (close, reopen, replay, seek back) or, when fenced, wait to lose the
        partition to its new owner."""
        if state.writer is None:
            return
        self.metrics.partition_poisoned(state.topic, state.partition, True)
        _keep_writer_offsets(state, state.writer)
        state.writer.close(flush=False, timeout=5)
        with self._lock:
            state.writer = None
        # What was consumed and is not durable is dropped, to be fetched again from `done`
        # after the reopen (or by the partition's next owner): as after a rewind, the lag
        # in seconds counts from its oldest message until `done` passes it.
        dropped = _oldest_unsettled_timestamp_ms(state)
        if state.done is not None and dropped is not None:
            _rewind_to(state, state.done, dropped)
        state.position = state.done
        state.inflight.clear()
        state.held = None
        self._drop_decoding(state)
        if isinstance(exc, Fenced):
            self._pause(state)
            state.fenced = True
            state.fenced_at = time.monotonic()
            log.error(
                "partition_fenced", topic=state.topic, partition=state.partition, error=str(exc)
            )
            return
        log.error(
            "partition_poisoned", topic=state.topic, partition=state.partition, error=str(exc)
        )
        # Recover: take the partition out of the consumer's assignment (nothing is fetched
        # meanwhile), reopen the shard (replay), and assign it again at the resume offset.
        self._unassign(state)
        self._open_failed(state, exc, event=None)

    def _unassign(self, state: PartitionState) -> None:
        if not state.assigned:
            return
        try:
            self.consumer.incremental_unassign([state.tp])
        except confluent_kafka.KafkaException as exc:
            log.warning(
                "unassign_failed", topic=state.topic, partition=state.partition, error=str(exc)
            )
        state.assigned = False
        state.paused = False

    def _open_failed(self, state: PartitionState, exc: BaseException, event: str | None) -> None:
        """Opening (or keeping) the partition's shard writer failed: retry with backoff
        (`_maybe_recover`), visible meanwhile in /readyz, /v1/status, the writer-poisoned
        gauge, a counter and a log event. Never fatal: a cause that goes away (a store
        outage, a bug in reading a table version) must not become a crash loop."""
        delay = min(RECOVERY_BACKOFF_S * 2**state.open_failures, RECOVERY_BACKOFF_MAX_S)
        state.open_failures += 1
        state.open_error = _brief(exc)
        state.recover_at = time.monotonic() + delay
        self.metrics.partition_poisoned(state.topic, state.partition, True)
        if event is not None:
            self.metrics.shard_open_failed(state.topic, state.partition)
            log.error(
                event,
                topic=state.topic,
                partition=state.partition,
                error=f"{type(exc).__name__}: {exc}",
                attempt=state.open_failures,
                retry_in_s=delay,
            )

    def _maybe_recover(self, state: PartitionState) -> None:
        """Reopen the shard writer of a partition that has none (poisoned, or its open
        failed), on the open pool, once its backoff has passed; install it when done."""
        if state.opening is not None:
            if state.opening.done():
                self._take_opened(state)
            return
        if time.monotonic() < state.recover_at or self._stop.is_set():
            return
        state.opening = self._open_pool.submit(
            self._open_partition, state.topic, state.partition, not state.committed_known
        )

    def _open_partition(
        self, topic: str, partition: int, look_up_committed: bool
    ) -> tuple[ShardWriter, int | None]:
        """Open pool: claim and replay the shard; with `look_up_committed`, also fetch the
        group's committed offset (-1: none), which a failed look-up on assign left unknown."""
        writer = self.engine.open_shard(topic, partition)
        if not look_up_committed:
            return writer, None
        try:
            found = self.consumer.committed(
                [TopicPartition(topic, partition)], timeout=COMMITTED_TIMEOUT_S
            )
        except BaseException:
            self.engine.close_shard(writer, flush=False, timeout=5)
            raise
        return writer, max(found[0].offset, -1)

    def _take_opened(
        self, state: PartitionState, assign: list[TopicPartition] | None = None
    ) -> bool:
        """Install the writer `state.opening` opened and assign the partition at the
        resume offset (now, or by adding it to `assign` for the caller's one
        `incremental_assign`), or record why the open failed (retried). True if installed."""
        future, state.opening = state.opening, None
        assert future is not None
        try:
            writer, committed = future.result()
        except Exception as exc:  # noqa: BLE001 - any failure is retried, none is fatal
            self._open_failed(state, exc, event="partition_open_failed")
            return False
        if committed is not None:
            state.committed, state.committed_known = committed, True
        key = (state.topic, state.partition)
        durable = writer.durable_offsets.get(key)
        # Resume after the last durable offset, or at the committed one if later (I3).
        start = state.done
        if start is None and state.committed >= 0:
            start = state.committed
        if durable is not None:
            start = max(start or 0, durable + 1)
        with self._lock:
            state.writer = writer
        state.shard = writer.shard
        state.position = state.done = start
        if state.open_error is not None:
            log.info(
                "partition_recovered",
                topic=state.topic,
                partition=state.partition,
                attempts=state.open_failures,
            )
        state.open_error, state.open_failures = None, 0
        self.metrics.partition_poisoned(state.topic, state.partition, False)
        log.info(
            "partition_assigned",
            topic=state.topic,
            partition=state.partition,
            shard=writer.shard,
            epoch=writer.epoch,
            committed=state.committed if state.committed >= 0 else None,
            durable=durable,
            start=start,
        )
        if not state.assigned:
            first = START_AT[self.settings.kafka.auto_offset_reset] if start is None else start
            tp = TopicPartition(state.topic, state.partition, first)
            if assign is not None:
                assign.append(tp)
            else:
                self.consumer.incremental_assign([tp])
                # A partition paused before it was taken out of the assignment may keep
                # its pause in librdkafka.
                self.consumer.resume([state.tp])
            state.assigned = True
        return True

    def _stop_partition(self, state: PartitionState, why: str) -> None:
        """Stop consuming the partition for good (until it is assigned again): `why` shows
        in /readyz and /v1/status, and `lance_sink_partition_stopped` is 1."""
        state.stopped = why
        self.metrics.partition_stopped(state.topic, state.partition)

    def _offset_out_of_range(
        self, topic: str, partition: int, offset: int, err: confluent_kafka.KafkaError
    ) -> None:
        """The broker has no message at `offset`, the partition's fetch position, and
        librdkafka stopped fetching it: look its log range up on the open pool (a round
        trip to the broker) and act on it in `_service_out_of_range`."""
        state = self.partitions.get((topic, partition))
        if state is None or state.out_of_range is not None or state.stopped:
            return
        if state.out_of_range_since is None:  # the first refusal in a row (see below)
            log.warning(
                "offset_out_of_range",
                topic=topic,
                partition=partition,
                offset=offset,
                error=err.str(),
            )
        if offset < 0:
            # A logical start (`START_AT`) the broker could not resolve: asked again after
            # a while, as an offset back in the log is (not at once, in a loop with it).
            now = time.monotonic()
            if state.out_of_range_since is None:
                state.out_of_range_since = now
            state.out_of_range_retry = (offset, now + OUT_OF_RANGE_RETRY_S)
            return
        if self._admin is None:
            self._admin = AdminClient(lag_confs(self.settings)[0])
        lookup = self._open_pool.submit(_log_range, self._admin, topic, partition)
        state.out_of_range = (offset, lookup)

    def _service_out_of_range(self) -> None:
        """Act on the log ranges looked up for refused fetch offsets (`out_of_range_action`)
        and fetch again those whose wait is over."""
        now = time.monotonic()
        for state in list(self.partitions.values()):
            retry = state.out_of_range_retry
            if retry is not None and now >= retry[1]:
                state.out_of_range_retry = None
                if not state.stopped:
                    self._fetch_from(state, retry[0])
            pending = state.out_of_range
            if pending is None or not pending[1].done():
                continue
            state.out_of_range = None
            offset, lookup = pending
            try:
                low, high = lookup.result()
            except confluent_kafka.KafkaException as exc:
                # Fetching again asks the broker again; a refusal that stands comes back.
                log.warning(
                    "log_range_lookup_failed",
                    topic=state.topic,
                    partition=state.partition,
                    error=str(exc),
                )
                state.out_of_range_retry = (offset, now + OUT_OF_RANGE_RETRY_S)
                continue
            self._resolve_out_of_range(state, offset, low, high)

    def _resolve_out_of_range(
        self, state: PartitionState, offset: int, low: int, high: int
    ) -> None:
        """The broker refused `offset` of a partition whose log spans [`low`, `high`)."""
        action = out_of_range_action(offset, low, high)
        where = {"topic": state.topic, "partition": state.partition, "offset": offset}
        if action == "retry":  # asked again after a while: ListOffsets and fetches disagree
            log.info("offset_in_range_again", **where, log_start=low, log_end=high)
            state.out_of_range_retry = (offset, time.monotonic() + OUT_OF_RANGE_RETRY_S)
        elif action == "skip":
            log.error("offsets_deleted_before_read", **where, log_start=low, skipped=low - offset)
            self.metrics.offsets_skipped(state.topic, state.partition, low - offset)
            # Nothing of them can become durable: `done` steps over them as over offsets
            # without rows, after the messages consumed before them (still parked or
            # decoding), as one more decoded batch of none.
            if state.parked:
                self._submit_parked(state)
            none: Future[Decoded] = Future()
            none.set_result(Decoded(None, [], [], offset, low - 1))
            state.decoding.append(_Decoding([], none))
            state.position = low
            self._fetch_from(state, low)
        else:
            now = time.monotonic()
            if state.out_of_range_since is None:
                state.out_of_range_since = now
                log.warning(
                    "offset_past_log_end", **where, log_end=high, grace_s=OUT_OF_RANGE_GRACE_S
                )
            if now - state.out_of_range_since < OUT_OF_RANGE_GRACE_S:
                state.out_of_range_retry = (offset, now + OUT_OF_RANGE_RETRY_S)
                return
            log.error("partition_stopped_offset_out_of_range", **where, log_end=high)
            self._stop_partition(
                state,
                f"offset {offset} is past the log end {high}: the partition's log was "
                "truncated or its topic created again",
            )
            self._pause(state)

    def _fetch_from(self, state: PartitionState, offset: int) -> None:
        """Fetch the partition from `offset` again after the broker refused an offset.
        librdkafka refuses to seek a partition in that state ("Erroneous state"): it is
        taken out of the assignment and put back at `offset`."""
        if not state.assigned or state.writer is None:
            return  # fetched from `position` when it is assigned again
        tp = TopicPartition(state.topic, state.partition)
        try:
            self.consumer.incremental_unassign([tp])
            tp.offset = offset
            self.consumer.incremental_assign([tp])
            if state.paused:
                self.consumer.pause([tp])  # an assignment starts unpaused
        except confluent_kafka.KafkaException as exc:
            log.warning(
                "fetch_restart_failed",
                topic=state.topic,
                partition=state.partition,
                offset=offset,
                error=str(exc),
            )
            state.out_of_range_retry = (offset, time.monotonic() + OUT_OF_RANGE_RETRY_S)

    def _on_message_error(self, err: confluent_kafka.KafkaError) -> None:
        if err.fatal():
            self._fatal = f"fatal consumer error: {err.str()}"
        else:
            log.warning("consumer_error", code=err.name(), error=err.str())

    def _on_error(self, err: confluent_kafka.KafkaError) -> None:
        """librdkafka's error callback (called from consume/poll on this thread)."""
        auth = err.code() in (
            confluent_kafka.KafkaError._AUTHENTICATION,
            confluent_kafka.KafkaError.SASL_AUTHENTICATION_FAILED,
        )
        if err.fatal() or auth:
            self._fatal = f"{'authentication failed' if auth else 'fatal Kafka error'}: {err.str()}"
        else:
            log.warning("kafka_error", code=err.name(), error=err.str())

    # ------------------------------------------------------------------ offsets

    def _commit(self, *, asynchronous: bool, states: list[PartitionState] | None = None) -> bool:
        """Commit each partition's `done` offset (the commit protocol's last step, data
        path step 7 in DESIGN.md):

        1. Step `done` past offsets that carry no data (`_skip_records_without_data`).
        2. Commit every partition whose `done` is past its committed offset and that no
           newer writer fenced; a synchronous commit records the result at once, an
           asynchronous one in `_on_commit`.

        Returns:
            Whether a commit was sent, or tried and refused by the client (nothing is sent
            when no `done` moved).
        """
        states = states if states is not None else list(self.partitions.values())
        self._skip_records_without_data(states)
        targets = [
            s for s in states if s.done is not None and s.done > s.committed and not s.fenced
        ]
        if not targets:
            return False
        offsets = [TopicPartition(s.topic, s.partition, s.done or 0) for s in targets]
        try:
            if asynchronous:
                self.consumer.commit(offsets=offsets, asynchronous=True)
                return True
            result = self.consumer.commit(offsets=offsets, asynchronous=False)
        except confluent_kafka.KafkaException as exc:
            self.metrics.commit_failed()
            log.warning("commit_failed", error=str(exc), partitions=len(offsets))
            return True
        for tp in result or []:
            self._committed(tp)
        return True

    def _skip_records_without_data(self, states: list[PartitionState]) -> None:
        """Move `done` (and `position`) of idle partitions up to the consumer's position.

        librdkafka never hands out a transaction's commit or abort marker (a control record)
        nor, with `isolation.level=read_committed`, an aborted transaction's messages, but
        its consumer position moves past them as it reads them. Without this step a
        partition that ends in a commit marker would keep a commit lag of 1 for good.

        A partition is idle when everything it consumed is durable (or acknowledged by the
        dead-letter topic) and nothing is on its way: nothing parked, decoding, held or in
        flight, not paused, assigned with a healthy writer. Every message librdkafka
        delivered since the partition was last assigned or sought then went through
        `_handle` and moved `position`: only a paused, held or writerless partition drops
        messages, and it is sought back to `position` (`Consumer.seek` returns once
        librdkafka has reset its position) or unassigned and assigned again at its resume
        offset before it takes messages again. So the offsets between `position` and the
        consumer's position carry no data: `done` may pass them, and I1 holds. Partitions
        whose log end (from the statistics) is not past `done` are not asked about:
        nothing is left to skip there.
        """
        idle = []
        for s in states:
            if (
                s.writer is None
                or s.opening is not None
                or not s.assigned
                or s.paused
                or s.fenced
                or s.stopped
                or s.held is not None
                or s.inflight
                or s.decoding
                or s.parked
                or s.done != s.position
            ):
                continue
            end = self.end_offsets.get((s.topic, s.partition))
            if end is not None and s.done is not None and end <= s.done:
                continue
            idle.append(s)
        if not idle:
            return
        try:
            positions = self.consumer.position([s.tp for s in idle])
        except confluent_kafka.KafkaException as exc:
            log.warning("position_lookup_failed", error=str(exc), partitions=len(idle))
            return
        for state, tp in zip(idle, positions, strict=True):
            if tp.error is not None or tp.offset < 0:
                continue
            if state.done is None or tp.offset > state.done:
                state.position = state.done = tp.offset

    def _on_commit(
        self, err: confluent_kafka.KafkaError | None, partitions: list[TopicPartition]
    ) -> None:
        if err is not None:
            self.metrics.commit_failed()
            log.warning("commit_failed", error=str(err))
            return
        for tp in partitions:
            if tp.error is None:
                self._committed(tp)
            else:
                self.metrics.commit_failed()
                log.warning(
                    "commit_failed", topic=tp.topic, partition=tp.partition, error=str(tp.error)
                )

    def _committed(self, tp: TopicPartition) -> None:
        state = self.partitions.get((tp.topic, tp.partition))
        if state is None or tp.offset < 0:
            return
        state.committed = max(state.committed, tp.offset)
        now = time.monotonic()
        while state.durable_at and state.durable_at[0][0] <= tp.offset:
            _, durable_since = state.durable_at.popleft()
            self.metrics.committed(now - durable_since)

    # ------------------------------------------------------------------ rebalance

    def _on_assign(
        self, consumer: confluent_kafka.Consumer, partitions: list[TopicPartition]
    ) -> None:
        # Every rebalance may bring partitions added to a topic, which another pod may be
        # about to claim: list them for fan-out now (`sink.topic_shards`).
        self.topic_shards.refresh_soon()
        if not partitions:
            consumer.incremental_assign([])
            self.ready.set()
            return
        self._assign(consumer, partitions)

    def _assign(self, consumer: confluent_kafka.Consumer, partitions: list[TopicPartition]) -> None:
        if self._stop.is_set():
            # Draining: a shard opened now would be claimed and replayed only to be closed
            # again, holding the drain up. The group takes the partitions back on close.
            consumer.incremental_assign(partitions)
            log.info("assignment_ignored_while_draining", count=len(partitions))
            return
        committed, known = self._committed_offsets(consumer, partitions)
        # Each shard is claimed and replayed on the open pool, and its partition handed to
        # the consumer at its resume offset once it is (`_maybe_recover`, `_take_opened`):
        # the loop keeps polling and serving its other partitions meanwhile (a replay from
        # object storage can take minutes). A failed look-up of the committed offsets is
        # made again by each open.
        for tp in partitions:
            key = (tp.topic, tp.partition)
            state = PartitionState(
                tp.topic,
                tp.partition,
                None,
                None,
                None,
                committed.get(key, -1),
                opening=self._open_pool.submit(
                    self._open_partition, tp.topic, tp.partition, not known
                ),
                committed_known=known,
                assigned=False,
            )
            with self._lock:
                self.partitions[key] = state
        # Nothing is handed to the consumer yet; an incremental_assign of none all the same:
        # a callback that assigns nothing would have the client assign every partition.
        consumer.incremental_assign([])
        self.metrics.rebalance("assigned", len(partitions))
        self.ready.set()
        log.info("partitions_opening", count=len(partitions))

    def _committed_offsets(
        self, consumer: confluent_kafka.Consumer, partitions: list[TopicPartition]
    ) -> tuple[dict[tuple[str, int], int], bool]:
        """The group's committed offsets of `partitions` (bounded by the drain deadline
        while stopping), and whether the look-up succeeded."""
        left = self._drain_left()
        timeout = COMMITTED_TIMEOUT_S if left is None else min(COMMITTED_TIMEOUT_S, left)
        try:
            found = consumer.committed(partitions, timeout=max(timeout, 0.1))
        except confluent_kafka.KafkaException as exc:
            log.error("committed_offsets_failed", partitions=len(partitions), error=str(exc))
            return {}, False
        return {(tp.topic, tp.partition): tp.offset for tp in found if tp.offset >= 0}, True

    def _close_abandoned(self, future: Future[tuple[ShardWriter, int | None]]) -> None:
        """A shard open abandoned (its partition revoked or lost, or the sink draining):
        close its writer when it ends (its rows stay in the WAL for the next owner)."""
        if future.cancelled() or future.exception() is not None:
            return
        writer, _ = future.result()
        self.engine.close_shard(writer, flush=False, timeout=5)

    def _on_revoke(
        self, consumer: confluent_kafka.Consumer, partitions: list[TopicPartition]
    ) -> None:
        states = [s for tp in partitions if (s := self.partitions.get((tp.topic, tp.partition)))]
        if states:
            left = self._drain_left()
            deadline = self.settings.shutdown.drain_deadline_s if left is None else left
            self._wait_inflight(states, deadline)
            self._commit(asynchronous=False, states=states)
            for state in states:
                self._release(state, flush=False)
        consumer.incremental_unassign(self._locally_assigned(partitions, states))
        self.metrics.rebalance("revoked", len(partitions))
        for tp in partitions:
            log.info("partition_revoked", topic=tp.topic, partition=tp.partition)

    def _on_lost(
        self, consumer: confluent_kafka.Consumer, partitions: list[TopicPartition]
    ) -> None:
        states = []
        for tp in partitions:
            state = self.partitions.get((tp.topic, tp.partition))
            if state is not None:
                states.append(state)
                self._release(state, flush=False)
            log.warning("partition_lost", topic=tp.topic, partition=tp.partition)
        consumer.incremental_unassign(self._locally_assigned(partitions, states))
        self.metrics.rebalance("lost", len(partitions))

    @staticmethod
    def _locally_assigned(
        partitions: list[TopicPartition], states: list[PartitionState]
    ) -> list[TopicPartition]:
        """Those of `partitions` in the consumer's own assignment: a partition whose shard
        writer has not opened (yet, or again) was never handed to it, or was taken back."""
        unassigned = {(s.topic, s.partition) for s in states if not s.assigned}
        return [tp for tp in partitions if (tp.topic, tp.partition) not in unassigned]

    def _release(self, state: PartitionState, *, flush: bool, timeout: float = 30.0) -> None:
        with self._lock:
            self.partitions.pop((state.topic, state.partition), None)
        self._drop_decoding(state)
        if state.opening is not None:  # an open (or reopen) still running: close it after
            if not state.opening.done():
                log.warning(
                    "partition_open_abandoned", topic=state.topic, partition=state.partition
                )
            state.opening.add_done_callback(self._close_abandoned)
            state.opening = None
        if state.writer is not None:
            self.engine.close_shard(state.writer, flush=flush, timeout=timeout)
            state.writer = None
        # Every series of the partition, and of its shard even when its writer was dropped
        # (poisoned, fenced) before: none is left behind at its last value.
        self.metrics.forget_partition(state.topic, state.partition, state.shard)

    def _wait_inflight(self, states: list[PartitionState], timeout: float) -> None:
        """Let in-flight puts finish (bounded), advancing `done` as they complete."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._advance()
            if not any(s.inflight for s in states):
                return
            time.sleep(0.005)
        log.warning("inflight_drain_timeout", partitions=len(states))

    # ------------------------------------------------------------------ shutdown

    def _drain(self) -> None:
        """Stop fetching, finish in-flight appends, commit, flush, close: all within
        `shutdown.drain_deadline_s` of the stop request.

        The maintenance child is asked to stop first and finishes its current task (each
        is one or a few atomic Lance commits) concurrently with the partitions' drain; it
        may use the whole deadline less DRAIN_RESERVE_S, and is killed then (an index build
        not finished by then is lost and rebuilt by the next run: raise the deadline to
        keep long builds). Each later step gets what is left; queries still running when
        the servers stop are abandoned (`lance-sink run` exits without waiting for them).
        """
        if self._stop_at is None:  # a fatal error, not a signal: the deadline starts now
            self._stop_at = time.monotonic()
        deadline = self._stop_at + self.settings.shutdown.drain_deadline_s

        def left(reserve: float = 0.0) -> float:
            return max(deadline - reserve - time.monotonic(), 0.0)

        states = list(self.partitions.values())
        log.info("sink_draining", partitions=len(states), deadline_s=round(left(), 1))
        self.maintenance.request_stop(left(DRAIN_RESERVE_S))
        if states:
            try:
                self.consumer.pause([s.tp for s in states])
            except confluent_kafka.KafkaException as exc:
                log.warning("pause_failed", error=str(exc))
        self._wait_inflight(states, left(DRAIN_RESERVE_S) / 2)
        self._commit(asynchronous=False, states=states)
        for state in states:
            self._release(state, flush=True, timeout=max(left(DRAIN_RESERVE_S), 0.1))
        self._paused_ends.close(timeout=min(left(), 1.0))
        self.topic_shards.close(timeout=min(left(), 1.0))
        with self._offsets_lock:  # no scrape reads a watermark from a closing consumer
            self._consumer_closed = True
        try:
            self.consumer.close()
        except (RuntimeError, confluent_kafka.KafkaException) as exc:
            log.warning("consumer_close_failed", error=str(exc))
        if self.dlq is not None:
            undelivered = self.dlq.close(max(left(DRAIN_RESERVE_S), 0.1))
            if undelivered:
                log.warning("dlq_undelivered_at_shutdown", messages=undelivered)
        self.maintenance.stop(timeout=max(left(DRAIN_RESERVE_S), 0.1))
        self._trim.close(timeout=0.1)
        self.reader.close(timeout=min(left(), 1.0))
        self.engine.close(flush=False, timeout=min(left(), 1.0))
        self._open_pool.shutdown(wait=False, cancel_futures=True)
        self._decode_pool.shutdown(wait=False, cancel_futures=True)
        if isinstance(self.decoder, ProcessDecoder):
            self.decoder.close(timeout=min(left(), 1.0))
        for server in self.servers:
            server.stop(timeout=max(min(left() / 2, 5.0), 0.1))
        log.info(
            "sink_stopped",
            seconds=round(time.monotonic() - self._stop_at, 3),
            deadline_s=self.settings.shutdown.drain_deadline_s,
        )

    # ------------------------------------------------------------------ metrics

    def _on_stats(self, stats_json: str) -> None:
        """librdkafka statistics: the high watermark of every assigned partition (the lag
        source; it comes from fetch responses, which is right on every broker)."""
        try:
            stats = json.loads(stats_json)
        except ValueError:
            return
        self._last_stats = time.monotonic()
        self.brokers_up = sum(
            1
            for b in stats.get("brokers", {}).values()
            if b.get("state") == "UP" and b.get("nodeid", -1) >= 0
        )
        for topic, t in stats.get("topics", {}).items():
            for pid, p in t.get("partitions", {}).items():
                partition = int(pid)
                if partition < 0:
                    continue
                hi = int(p.get("hi_offset", -1))
                if hi >= 0 and (topic, partition) in self.partitions:
                    self.end_offsets[(topic, partition)] = hi

    def partition_offsets(self, state: PartitionState) -> PartitionOffsets:
        """One consistent snapshot of a partition's offsets (any thread; see `sink.lag`):
        read from the slowest-moving to the fastest, the end offset last and from the
        newest fetch response, so no lag clamps to 0 on an end offset older than what is
        subtracted from it.

        Every assigned partition has one, with a shard writer or without (its open or
        reopen under way or failing, poisoned, fenced): without, durable and flushed are
        what its last writer reported when it was dropped (0 if none opened since the
        assignment: the flush lag then counts from the log start, as `lance-sink lag`'s
        does without a recorded flush), never below `done` and the committed offset; the
        end offset of a partition the consumer does not fetch is the probe's
        (`sink.lag.PausedEnds`)."""
        writer, position = state.writer, state.position
        key = (state.topic, state.partition)
        committed = max(state.committed, 0)
        pending_ts = _oldest_pending_timestamp_ms(state)
        if writer is not None:
            stats = writer.stats()
            writer_durable = stats.durable_offsets.get(key, -1) + 1
            writer_flushed = stats.flushed_offsets.get(key, -1) + 1
        else:
            writer_durable, writer_flushed = state.writer_durable, state.writer_flushed
        durable, flushed = _durable_and_flushed(state.done, writer_durable, writer_flushed)
        durable, flushed = max(durable, committed), max(flushed, 0)
        consumed = max(position or 0, durable)
        high = -1
        with self._offsets_lock:
            if not self._consumer_closed:
                with contextlib.suppress(RuntimeError, confluent_kafka.KafkaException):
                    high = self.consumer.get_watermark_offsets(state.tp, cached=True)[1]
        # A partition the consumer does not fetch (paused, unassigned while its writer
        # opens): the probe's newer end, once it has one.
        high = max(high, self._paused_ends.end(key))
        end = high if high >= 0 else self.end_offsets.get(key)
        return PartitionOffsets(end, consumed, durable, committed, flushed, pending_ts)

    def refresh_offsets(self) -> None:
        """Set every partition's offset, lag, paused and writer-poisoned gauges, the
        offsets from one snapshot each (any thread: the loop once a second, and each
        scrape just before the exposition, so a scrape is current even while the loop is
        busy)."""
        with self._offsets_lock:
            self._set_offsets()

    def _set_offsets(self) -> None:
        for key, state in list(self.partitions.items()):
            self.metrics.partition_offsets(*key, self.partition_offsets(state))
            self.metrics.partition_paused(*key, state.paused)
            self.metrics.partition_poisoned(*key, _writer_unusable(state))
            if self.partitions.get(key) is not state:  # revoked meanwhile
                self.metrics.forget_partition(*key)

    def refresh_metrics(self) -> None:
        """Refresh every gauge from live state (called from the loop once a second)."""
        # End offsets of the partitions the consumer does not fetch come from the probe.
        self._paused_ends.track(key for key, state in self.partitions.items() if not state.fetched)
        self.refresh_offsets()
        self._ingest_window.append((time.monotonic(), self.metrics.rows_total))
        for (topic, partition), state in list(self.partitions.items()):
            letters = _unacked_dead_letters(state)
            self.metrics.dlq_waiting(topic, partition, letters.waiting_s() if letters else 0.0)
            writer = state.writer
            if writer is None:
                continue
            stats = writer.stats()
            self.metrics.shard_memory(
                stats.shard,
                unflushed=stats.bytes + stats.frozen_bytes,
                frozen_count=stats.frozen_count,
                active=stats.bytes,
                index=stats.index_bytes,
            )
        bp = self.engine.controller.stats.snapshot()
        self.metrics.backpressure(
            waits=bp.waits_total,
            wait_seconds=bp.wait_seconds_total,
            active=bp.active_waits,
            rejections=bp.rejections_total,
        )
        controller = self.engine.controller
        if isinstance(controller, BudgetController):
            self.metrics.budget_usage(controller.used_bytes(), controller.budget)
        self.metrics.base_unindexed(self.maintenance.unindexed_rows())
        self.metrics.lance_cache(self.reader.lance_cache_bytes)
        self.metrics.arrow_pool(pa.total_allocated_bytes())
        vector, text = self.reader.unindexed, self.reader.flushed_text
        self.metrics.unindexed_cache(
            self.reader.unindexed_bytes,
            0 if vector is None else vector.fallbacks,
            0 if text is None else text.fallbacks,
        )

    # ------------------------------------------------------------------ observability

    def exposition(self) -> bytes:
        """Prometheus text of every metric, with the offset and lag gauges of this instant."""
        with self._offsets_lock:  # a refresh by the loop cannot interleave
            self._set_offsets()
            return self.metrics.exposition()

    def liveness(self) -> tuple[bool, str]:
        """Alive while the consumer loop iterates (a loop stuck for longer than
        max.poll.interval.ms would be evicted from the group anyway)."""
        stuck = time.monotonic() - self._last_tick
        limit = self.settings.kafka.max_poll_interval_ms / 1000
        if stuck > limit:
            return False, f"consumer loop has not polled for {stuck:.0f} s"
        return True, "consumer loop polling"

    def readiness(self) -> tuple[bool, list[str]]:
        """Ready = joined the group with every assigned partition opened and replayed, a
        broker reachable, and no shard writer poisoned or fenced."""
        reasons = []
        if not self.ready.is_set():
            reasons.append("waiting for the first partition assignment")
        stats_age = time.monotonic() - self._last_stats
        stale = 3 * self.settings.observability.kafka_statistics_interval_ms / 1000 + 1
        if self._last_stats == 0.0 or stats_age > stale:
            reasons.append("no broker statistics yet")
        elif self.brokers_up == 0:
            reasons.append("no broker reachable")
        for (topic, partition), state in list(self.partitions.items()):
            if state.fenced:
                reasons.append(f"{topic}[{partition}]: fenced by a newer writer")
            elif state.stopped:
                reasons.append(f"{topic}[{partition}]: stopped, {state.stopped}")
            elif state.writer is None and state.open_error is None and state.opening is not None:
                reasons.append(f"{topic}[{partition}]: opening and replaying its shard")
            elif state.writer is None:
                why = state.open_error or "shard writer poisoned"
                reasons.append(
                    f"{topic}[{partition}]: no shard writer ({why}), retrying "
                    f"(attempt {state.open_failures + 1})"
                )
            elif (letters := _unacked_dead_letters(state)) is not None and (
                letters.waiting_s() > self.settings.dlq.stalled_after_s
            ):
                reasons.append(
                    f"{topic}[{partition}]: held {letters.waiting_s():.0f} s by {letters.pending}"
                    f" undelivered dead letter(s), last error: {letters.last_error}"
                )
        if self._fatal:
            reasons.append(self._fatal)
        return not reasons, reasons

    def status(self) -> dict[str, Any]:
        """One JSON-able summary of the running sink (`lance-sink status`)."""
        partitions = [self._partition_status(state) for _, state in sorted(self.partitions.items())]
        bp = self.engine.controller.stats.snapshot()
        controller = self.engine.controller
        budget = controller if isinstance(controller, BudgetController) else None
        ready, reasons = self.readiness()
        return {
            "group": self.settings.kafka.group_id,
            "topics": list(self.settings.kafka.topics),
            "table": self.settings.table.uri,
            "ready": ready,
            "not_ready_reasons": reasons,
            "partitions": partitions,
            "backpressure": {
                "controller": type(controller).__name__,
                "budget_bytes": budget.budget if budget else None,
                "used_bytes": budget.used_bytes() if budget else None,
                "waits_total": bp.waits_total,
                "wait_seconds_total": round(bp.wait_seconds_total, 3),
                "active_waits": bp.active_waits,
                "rejections_total": bp.rejections_total,
            },
            "ingest": self._ingest_status(),
            "memory": {
                "resident_bytes": resident_bytes(),
                "budget_bytes": budget.budget if budget else None,
                "limit_bytes": memory_limit_bytes(),
            },
            "base": self._base_status(),
            "maintenance": self.maintenance_role.status(),
        }

    def _ingest_status(self) -> dict[str, Any]:
        """Rows made durable per second over the last `INGEST_WINDOW_SAMPLES` refreshes."""
        now, total = time.monotonic(), self.metrics.rows_total
        window = list(self._ingest_window)
        since, before = window[0] if window else (now, total)
        seconds = now - since
        rate = (total - before) / seconds if seconds > 0 else 0.0
        return {"rows_per_second": round(rate, 1), "window_seconds": round(seconds, 1)}

    def _base_status(self) -> dict[str, Any]:
        """The base table's index lag as it is now (`sink.lag.unindexed_rows`), beside the
        figure of the last maintenance run. Bounded in time whatever table storage does
        (`sink.base_status`): a stalled store makes it unknown, with the reason and the
        last figures read."""
        return {
            "unindexed_rows_at_last_maintenance": self.maintenance.unindexed_rows(),
            **self._base_figures.get(),
        }

    def _read_base_figures(self) -> dict[str, Any]:
        """`BaseTableStatus`'s read (on its own thread): the base table's rows and index lag
        from table storage (manifest metadata only)."""
        ds = self.engine.table.dataset()
        per_index = unindexed_rows(ds)
        rows = int(ds.count_rows())
        # The least complete index: what queries wait on (0 without indexes).
        return {
            "rows": rows,
            "unindexed_rows": max(per_index.values(), default=0),
            "unindexed_by_index": per_index,
        }

    def _partition_status(self, state: PartitionState) -> dict[str, Any]:
        snap = self.partition_offsets(state)
        entry: dict[str, Any] = {
            "topic": state.topic,
            "partition": state.partition,
            "paused": state.paused,
            "fenced": state.fenced,
            "stopped": state.stopped,
            "consumed": state.position,
            "committed": state.committed,
            "end": self.end_offsets.get((state.topic, state.partition)),
            "decoding_batches": len(state.decoding),
            "inflight_puts": len(state.inflight),
            "held": state.held is not None,
        }
        if state.registry_failures:
            retry_at = state.registry_retry_at
            entry["schema_registry"] = {
                "error": state.registry_error,
                "failures": state.registry_failures,
                "retry_in_s": None
                if retry_at is None
                else round(max(retry_at - time.monotonic(), 0.0), 1),
            }
        if state.writer is None and not state.fenced:
            entry["open"] = {
                "error": state.open_error,
                "failures": state.open_failures,
                "retry_in_s": round(max(state.recover_at - time.monotonic(), 0.0), 1),
            }
        if (letters := _unacked_dead_letters(state)) is not None:
            entry["dead_letters"] = {
                "pending": letters.pending,
                "waiting_s": round(letters.waiting_s(), 1),
                "stalled": letters.waiting_s() > self.settings.dlq.stalled_after_s,
                "last_error": letters.last_error,
            }
        # One snapshot (see `partition_offsets`), with a shard writer or without.
        entry.update(
            consumed=snap.consumed,
            committed=snap.committed,
            durable=snap.durable,
            flushed=snap.flushed,
            end=snap.end,
        )
        lags = snap.lags()
        if lags is not None:
            entry["lag"] = {**lags, "seconds": round(snap.lag_seconds(), 3)}
        writer = state.writer
        if writer is not None:
            st = writer.stats()
            entry.update(
                shard=st.shard,
                epoch=st.epoch,
                memtable={
                    "generation": st.generation,
                    "rows": st.rows,
                    "bytes": st.bytes,
                    "index_bytes": st.index_bytes,
                    "frozen_count": st.frozen_count,
                    "frozen_bytes": st.frozen_bytes,
                },
                flush={
                    "flushes": st.flushes_total,
                    "failures": st.flush_failures_total,
                    "rows": st.flushed_rows_total,
                    "position": st.flushed_position,
                },
                poisoned=st.poisoned,
            )
        return entry


def _log_range(admin: AdminClient, topic: str, partition: int) -> tuple[int, int]:
    """A partition's log start and end (high watermark), from ListOffsets through an admin
    client of the sink's own: the consumer's look-up (`get_watermark_offsets`) of a
    partition whose fetch offset it had just been refused took up to 18 s, past its timeout.

    Raises:
        KafkaException: the brokers did not answer within `LOG_RANGE_TIMEOUT_S`.
    """
    tp = TopicPartition(topic, partition)
    specs = (OffsetSpec.earliest(), OffsetSpec.latest())  # type: ignore[no-untyped-call]
    start, end = (
        next(iter(admin.list_offsets({tp: spec}, request_timeout=LOG_RANGE_TIMEOUT_S).values()))
        for spec in specs
    )
    return start.result().offset, end.result().offset


def out_of_range_action(offset: int, low: int, high: int) -> Literal["skip", "stop", "retry"]:
    """What the sink does when the broker refused to fetch `offset` of a partition whose
    log spans [`low`, `high`) (librdkafka's auto.offset.reset is "error", so it never jumps
    silently):

    - "skip": `offset` lies before the log start: its messages were deleted (retention,
      DeleteRecords) before the sink read them. Nothing can bring them back; the sink
      resumes at the log start, counts the skipped offsets
      (``lance_sink_offsets_skipped_total``) and logs ``offsets_deleted_before_read``.
    - "stop": `offset` lies past the log end: the log was truncated (an unclean leader
      election) or the topic deleted and created again, so the offsets now in the log
      are not the ones the sink read. Resuming anywhere could drop rows (offsets below
      the ones already durable are taken for done) or duplicate them: the partition stops
      (``/readyz`` names it, ``lance_sink_partition_stopped`` is 1) until an operator
      resolves it, once the broker has refused the offset for `OUT_OF_RANGE_GRACE_S` (a
      broker that just restarted may report its log end late).
    - "retry": `offset` is in the log now (a transient refusal): fetch it again.
    """
    if offset < low:
        return "skip"
    if offset > high:
        return "stop"
    return "retry"


def _rewind(state: PartitionState, first: Any) -> None:
    """Batches from message `first` on are dropped before they were put and fetched again:
    remember when it was produced for the lag in seconds (`PartitionState.rewound`), unless
    an older message not yet durable is remembered already."""
    _rewind_to(state, first.offset(), _timestamp_ms(first))


def _rewind_to(state: PartitionState, offset: int, timestamp_ms: int | None) -> None:
    """`_rewind` for a dropped message known by its offset and timestamp."""
    rewound = state.rewound
    stale = rewound is not None and state.done is not None and state.done > rewound[0]
    if rewound is None or stale or offset < rewound[0]:
        state.rewound = (offset, timestamp_ms)


def _oldest_unsettled_timestamp_ms(state: PartitionState) -> int | None:
    """The timestamp of the partition's oldest consumed message not yet durable, counting
    the batches still decoding or parked too (what a dropped writer drops with them)."""
    pending = _oldest_pending_timestamp_ms(state)
    if pending is not None:
        return pending
    if state.decoding and state.decoding[0].messages:
        return _timestamp_ms(state.decoding[0].messages[0])
    if state.parked:
        return _timestamp_ms(state.parked[0])
    return None


#: Longest error text a partition's /readyz reason and status entry carry (`_brief`).
BRIEF_ERROR_CHARS: Final = 300


def _brief(exc: BaseException) -> str:
    """An error for /readyz and /v1/status: its type and first line, at most
    `BRIEF_ERROR_CHARS` characters. Lance's errors carry a multi-line Rust Debug dump (~1.5 KB
    per partition, repeated in every reason); the log event keeps the whole text."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip()
    if len(text) > BRIEF_ERROR_CHARS:
        text = text[: BRIEF_ERROR_CHARS - 3] + "..."
    if len(lines) > 1 or text.endswith("..."):
        text += " (the whole error is in the log)"
    return text


def _writer_unusable(state: PartitionState) -> bool:
    """The writer-poisoned gauge: the partition's writer was dropped (poisoned, fenced) or
    its shard failed to open, and no writer replaces it yet. A first open still under way
    is not (it is a readiness reason while it lasts)."""
    if state.fenced or state.open_error is not None:
        return True
    return state.writer is None and state.opening is None


def _keep_writer_offsets(state: PartitionState, writer: ShardWriter) -> None:
    """Remember what `writer` reports as durable and flushed for the partition (1 +
    offset), before it is dropped: the offsets shown until a new writer opens."""
    key = (state.topic, state.partition)
    stats = writer.stats()
    state.writer_durable = max(state.writer_durable, stats.durable_offsets.get(key, -1) + 1)
    state.writer_flushed = max(state.writer_flushed, stats.flushed_offsets.get(key, -1) + 1)


def _oldest_pending_timestamp_ms(state: PartitionState) -> int | None:
    """The timestamp of the partition's oldest consumed message not yet durable (None when
    nothing consumed waits, or that message has no timestamp). In offset order: the oldest
    put in flight, the held batch, then a batch dropped to be fetched again (`rewound`)
    until `done` passes it. Any thread: the loop may pop meanwhile."""
    with contextlib.suppress(IndexError):  # popped by the loop meanwhile
        if state.inflight:
            return state.inflight[0].first_timestamp_ms
        if (held := state.held) is not None and held.messages:
            return _timestamp_ms(held.messages[0])
    rewound, done = state.rewound, state.done
    if rewound is not None and (done is None or done <= rewound[0]):
        return rewound[1]
    return None


def _unacked_dead_letters(state: PartitionState) -> DeadLetterBatch | None:
    """The dead letters holding the partition, while any of them is undelivered."""
    held = state.held
    letters = held.dead_letters if held is not None else None
    return letters if letters is not None and not letters.acked else None


def _durable_and_flushed(done: int | None, durable: int, flushed: int) -> tuple[int, int]:
    """A partition's durable and flushed offsets (next-offset style) as the gauges show them:
    offsets without rows below `done` (control records, aborted transactions, tombstones,
    acknowledged dead letters) count as durable, and as flushed once every durable row is,
    so a caught-up partition shows no durable or flush lag."""
    if done is None:
        return durable, flushed
    if flushed >= durable:
        flushed = max(flushed, done)
    return max(durable, done), flushed


def _timestamp_ms(message: Any) -> int | None:
    kind, ts = message.timestamp()
    return int(ts) if kind != confluent_kafka.TIMESTAMP_NOT_AVAILABLE else None
