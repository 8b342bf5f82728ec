"""The sink service: one consumer loop feeding one shard writer per assigned topic-partition.

Lifecycle:

- `SinkService(settings)` builds the engine (opens or creates the Lance table: a schema
  mismatch raises here), the consumer, the dead-letter producer, the metrics facade and
  the loop's parts (`sink.consumer`).
- `run()` (the CLI's `lance-sink run`) subscribes and loops until `stop()` (SIGTERM/SIGINT)
  or a fatal error, then drains (`drain`): it stops fetching, lets in-flight appends
  finish, commits, flushes or leaves the rest to replay, and closes, all within
  `shutdown.drain_deadline_s`. It returns the process exit code (see `sink.cli`).
- Rebalance callbacks run inside `consume()` on the loop thread and hand off to the
  lifecycle (`sink.consumer.lifecycle`): assign -> open the shard writers (claim +
  replay, on the open pool) and start each partition at max(committed offset, durable
  offset + 1) (I3); revoke -> let in-flight appends finish (bounded), commit
  synchronously, close the writer leaving its WAL to the next owner; lost -> close
  without committing.

One loop iteration (`run`, `_tick`), top to bottom: consume a batch (or one message while
the decoders are behind) and park it (`Pipeline.handle`); feed what was decoded, in offset
order per partition; deliver dead letters; put held batches; install opened shards;
act on refused fetch offsets; advance `done` over durable puts; switch the maintenance
role; commit; once a second, notice failed writers and refresh the process-wide gauges
(each scrape sets the partitions' own). The loop never blocks on storage or on decoding,
and `consume()` is called every `kafka.consume_timeout_ms` whatever the writers do, so
commits follow durability closely. A quiet loop (nothing waits but for new messages)
waits for one message and ticks only when something happens or every
`QUIET_TICK_INTERVAL_S` (`_wait_quietly`).
The partitions' phases and their transitions are `sink.consumer.partition`'s.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
from collections.abc import Sequence
from typing import Any, Final

import confluent_kafka
import structlog
from confluent_kafka import TopicPartition

from config.settings import Settings
from engine.engine import Engine
from engine.errors import LanceSinkError
from engine.maintenance import Maintenance, MaintenanceProcess
from engine.malloc import release_free_memory
from engine.periodic import PeriodicThread
from engine.reader import Fanout, Reader, ReaderSettings
from engine.reads.owners import ShardOwners
from sink.consumer.broker_stats import BrokerStats
from sink.consumer.commits import Commits
from sink.consumer.conf import consumer_conf
from sink.consumer.flow import Flow
from sink.consumer.lease import ConsumerLease
from sink.consumer.lifecycle import Lifecycle
from sink.consumer.out_of_range import OutOfRange
from sink.consumer.partition import PartitionCounts, PartitionState, PartitionTable
from sink.consumer.pipeline import Pipeline
from sink.consumer.status import StatusBoard
from sink.decode import Decoder, freeze_gc
from sink.decode_process import ProcessDecoder
from sink.dlq import DeadLetterProducer
from sink.dlq import producer_conf as dlq_producer_conf
from sink.formats import SchemaCheckMode, SchemaEvolution
from sink.http import ServerHandle, create_query_app, run_server
from sink.kafka_conf import kafka_security_conf, lag_confs
from sink.lag import PausedEnds
from sink.log import configure_logging, librdkafka_logger
from sink.maintenance_role import MaintenanceRole
from sink.metrics import Metrics
from sink.query_share import QueryShare
from sink.server import create_ops_app
from sink.topic_shards import TopicShards

log = structlog.get_logger("lance_sink.sink")

# How often the loop notices failed writers and refreshes the process-wide gauges and the
# status's ingest window (the per-partition gauges are set by each scrape).
METRICS_INTERVAL_S: Final = 1.0
# While the loop is quiet (no message consumed in the last iteration, every partition
# ACTIVE and settled with its `done` committed, no fetch offset refused: nothing waits but
# for new messages) it asks consume() for one message in waits of this length, and runs
# a tick (a pass over every partition) only when one returns, a rebalance or error
# callback ran inside it, a stop is asked for, or QUIET_TICK_INTERVAL_S passed. consume()
# returns as soon as the one message is there, so no message waits for the quiet wait
# (nor a commit: a loop owing one is not quiet). The wait is short because a /metrics
# scrape waits for the consume() in progress before its pass over the consumer
# (`sink.consumer.lease`): 25 ms at most; 40 bare consume() calls a second cost an idle
# consumer well under 1% of a core at 1,024 partitions (measured), the ticks were what
# cost (40 a second over every partition, a tenth of a core; issue #39).
QUIET_CONSUME_TIMEOUT_S: Final = 0.025
# How often a quiet loop ticks all the same: what comes due without a message or a
# callback (a transaction's last marker to step over, `Commits.skip_records_without_data`;
# the views' idle republish, `status.PUBLISH_IDLE_INTERVAL_S`) waits at most this much
# more (a partition opening, recovering or waiting for the registry keeps the loop from
# being quiet). Once a second: a tick is a pass over every partition (its views, `done`,
# the consumer's positions), four a second were a third of the idle loop's CPU at 1,024
# partitions (measured, issue #39). The status's figures that move without the loop
# (writers' statistics, end offsets) are read at each scrape.
QUIET_TICK_INTERVAL_S: Final = 1.0
# What the drain keeps for the steps after the partitions and the maintenance child
# (closing the reader, the engine and the servers): the maintenance child may use the
# drain deadline less this (see `drain`).
DRAIN_RESERVE_S: Final = 2.0
# How often free malloc memory is given back (`engine.malloc.release_free_memory`): queries
# and flushes free hundreds of MiB in bursts; a pass takes milliseconds.
MALLOC_TRIM_INTERVAL_S: Final = 5.0
# `run()`'s exit code when a writer schema needs the derived table evolved first: the CLI
# then restarts the process (EX_TEMPFAIL), which evolves the table as it opens it.
EXIT_RESTART_TO_EVOLVE: Final = 75


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
        self.metrics = metrics or Metrics(
            partition_metrics=settings.observability.partition_metrics
        )
        self.engine = engine or Engine.from_settings(settings, events=self.metrics)
        obs, query = settings.observability, settings.query
        schema_check: SchemaCheckMode = (
            "off" if not derived_columns else "evolve" if settings.table.evolve else "warn"
        )
        self.decoder: Decoder | ProcessDecoder = (
            ProcessDecoder(
                self.engine.spec,
                settings.source,
                schema_check=schema_check,
                workers=settings.source.decode_workers,
                log_config=(obs.log_level, obs.log_format),
            )
            if settings.source.decode_processes
            else Decoder(self.engine.spec, settings.source, schema_check=schema_check)
        )
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
        self.partitions = PartitionTable()
        # Every partition's shard, so no query routes by an owners copy that lacks one.
        self.topic_shards = TopicShards(
            lag_confs(settings)[0], list(settings.kafka.topics), self.engine.shard_id
        )
        self.reader = Reader(
            self.engine.spec,
            self.engine.table,
            self.partitions.writers,
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
        # Queries (and fan-out requests) running here count in it; the loop yields to them.
        self.share = QueryShare(query.ingest_share)
        self._stop = threading.Event()
        self._stop_at: float | None = None  # when the drain was asked for (monotonic)
        self._fatal: str | None = None
        self._last_metrics = 0.0
        # Every partition ACTIVE and settled with `done` committed and no message consumed:
        # the loop waits for one message, ticking every QUIET_TICK_INTERVAL_S (`_wait_quietly`).
        self._quiet = False
        # A rebalance or error callback ran inside consume(): a quiet wait ends.
        self._woken = False
        self._ticked_at = 0.0  # monotonic time of the last tick

        # The consumer and the loop's parts (`sink.consumer`).
        self.broker = BrokerStats(
            self.partitions, settings.observability.kafka_statistics_interval_ms / 1000
        )
        conf = consumer_conf(settings)
        conf.update(
            {
                "logger": librdkafka_logger(),
                "error_cb": self._on_error,
                "stats_cb": self.broker.on_stats,
                "on_commit": self._on_commit,
            }
        )
        self.consumer = confluent_kafka.Consumer(conf)
        # The loop's consume() calls and the status board's passes over the consumer take
        # turns (`sink.consumer.lease`).
        self.lease = ConsumerLease(self.consumer)
        self.flow = Flow(self.consumer, self.metrics)
        self.pipeline = Pipeline(
            settings,
            self.partitions,
            self.decoder,
            self.flow,
            self.dlq,
            self.metrics,
            self.engine.spec.validate,
            failures=self,
            counts=PartitionCounts(),
        )
        self.lifecycle = Lifecycle(
            settings,
            self.engine,
            self.consumer,
            self.partitions,
            self.flow,
            self.metrics,
            draining=self,
            forget=self.broker.forget,
            counts=self.pipeline.counts,
        )
        self.out_of_range = OutOfRange(
            self.partitions,
            self.flow,
            self.pipeline,
            self.metrics,
            self.lifecycle.pool,
            lag_confs(settings)[0],
        )
        # End offsets of partitions paused for a while (the consumer does not fetch them).
        self._paused_ends = PausedEnds(conf)
        self.board = StatusBoard(
            settings,
            self.partitions,
            engine=self.engine,
            consumer=self.consumer,
            lease=self.lease,
            paused_ends=self._paused_ends,
            broker=self.broker,
            metrics=self.metrics,
            reader=self.reader,
            maintenance=self.maintenance,
            role=self.maintenance_role,
            assigned_once=self.lifecycle.ready,
            fatal=lambda: self._fatal,
            counts=self.pipeline.counts,
        )
        self.commits = Commits(
            self.consumer,
            self.partitions,
            self.metrics,
            interval_s=settings.kafka.commit_interval_ms / 1000,
            end_offset=self.broker.end,
            before_send=self.board.publish,
        )

    # ------------------------------------------------------------------ control

    def stop(self) -> None:
        """Ask the loop to drain and return (signal handlers call this). The drain deadline
        (`shutdown.drain_deadline_s`) counts from the first call."""
        if self._stop_at is None:
            self._stop_at = time.monotonic()
        self._stop.set()

    def drain_left(self) -> float | None:
        """Seconds left until the drain deadline (None while not stopping)."""
        if self._stop_at is None:
            return None
        deadline = self._stop_at + self.settings.shutdown.drain_deadline_s
        return max(deadline - time.monotonic(), 0.0)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def evolution(self) -> SchemaEvolution | None:
        """Set when a writer schema needs the table evolved: `run` drains and returns
        EXIT_RESTART_TO_EVOLVE."""
        return self.pipeline.evolution

    # ------------------------------------------------------------------ main loop

    def start_servers(self) -> None:
        """Serve /metrics, /healthz, /readyz, /v1/status and (if enabled) the query API."""
        obs, query = self.settings.observability, self.settings.query
        if query.enabled and query.port == obs.metrics_port and query.port != 0:
            app = create_ops_app(self.board, create_query_app(self.reader, query, self.share))
            self.servers.append(run_server(app, query.host, query.port))
            return
        ops = create_ops_app(self.board, auth_token=query.auth_token)
        self.servers.append(run_server(ops, obs.metrics_host, obs.metrics_port))
        if query.enabled:
            self.servers.append(
                run_server(create_query_app(self.reader, query, self.share), query.host, query.port)
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
        quiet_timeout = max(timeout, QUIET_CONSUME_TIMEOUT_S)
        pipeline = self.pipeline
        code = 0
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                messages = []
                if not pipeline.decoders_behind():
                    if self._quiet:
                        messages = self._wait_quietly(quiet_timeout)
                    else:
                        messages = self.lease.consume(pipeline.consume_size, timeout)
                    if not messages:
                        started = time.monotonic()  # waiting for messages is not ingesting
                else:
                    # Decoding is behind: take at most one message (parked) per iteration,
                    # which still serves librdkafka's callbacks (commit results, rebalances)
                    # that only consume() delivers; stop taking any once parking is full.
                    if not pipeline.parking_full():
                        messages = self.lease.consume(1, 0)
                    pipeline.wait_decoded(timeout)
                if messages:
                    pipeline.handle(messages, self._on_message_error)
                self._tick()
                self._quiet = self._quiet and not messages
                if self._fatal is not None:
                    log.error("sink_fatal", reason=self._fatal)
                    code = 1
                    break
                if self.evolution is not None:
                    code = EXIT_RESTART_TO_EVOLVE
                    break
                self._share_with_queries(time.monotonic() - started)
        except LanceSinkError as exc:
            log.error("sink_fatal", reason=str(exc), error_type=type(exc).__name__)
            code = 1
        finally:
            self.drain()
            gc.unfreeze()
        return code

    def _wait_quietly(self, wait: float) -> list[Any]:
        """A quiet loop's consume(): one message at a time in waits of `wait`, until one
        comes, a rebalance or error callback ran, a stop is asked for, or the next tick is
        due (`QUIET_TICK_INTERVAL_S` after the last)."""
        due = self._ticked_at + QUIET_TICK_INTERVAL_S
        self._woken = False
        while True:
            messages = self.lease.consume(1, wait)
            if (
                messages
                or self._woken
                or self._fatal is not None
                or self._stop.is_set()
                or time.monotonic() >= due
            ):
                return messages

    def _share_with_queries(self, busy_s: float) -> None:
        """While queries run here, pause so ingestion takes at most its share of the loop's
        time (`sink.query_share`); a stop request ends the pause."""
        pause = self.share.pause_after(busy_s)
        if pause > 0:
            self.metrics.ingest_paused.inc(pause)
            self._stop.wait(pause)

    def _tick(self) -> None:
        """Everything a loop iteration does besides consuming."""
        now = self._ticked_at = time.monotonic()
        self.pipeline.collect_decoded()
        if self.dlq is not None:
            self.dlq.poll()
        self.pipeline.service_held()
        self.lifecycle.service()
        self.out_of_range.service()
        self._quiet = self.pipeline.advance() and self.out_of_range.idle()
        self.maintenance_role.update(self.partitions)
        # After the tick's work, so a view shows what it did (a partition stopped, a put
        # advanced); a commit publishes too, before it is sent (`Commits.before_send`).
        self.board.ticked(now)
        self.commits.maybe_commit(now)
        if now - self._last_metrics >= METRICS_INTERVAL_S:
            self._last_metrics = now
            self.lifecycle.check_writers()
            self.board.refresh_metrics(now)
            if self.lifecycle.fenced_everywhere(now):
                # A zombie: it stops, so its orchestrator restarts it into the group.
                self._fatal = "every assigned partition is fenced by a newer writer"

    # ------------------------------------------------------------------ the parts' callbacks

    def writer_failed(self, state: PartitionState, exc: BaseException) -> None:
        """The pipeline found a writer fenced or poisoned (`pipeline.WriterFailures`)."""
        self.lifecycle.writer_failed(state, exc)

    def settle(self, states: Sequence[PartitionState], timeout: float) -> None:
        """Let in-flight puts of `states` finish (bounded), advancing `done` as they
        complete, then commit synchronously (`lifecycle.Settle`: revoke and drain)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for state in states:
                self.pipeline.advance_one(state)
            if not any(s.inflight for s in states):
                break
            time.sleep(0.005)
        else:
            log.warning("inflight_drain_timeout", partitions=len(states))
        self.commits.commit(asynchronous=False, states=states)

    def _on_assign(self, _: confluent_kafka.Consumer, partitions: list[TopicPartition]) -> None:
        started = time.monotonic()
        self._woken = True
        # Every rebalance may bring partitions added to a topic, which another pod may be
        # about to claim: list them for fan-out now (`sink.topic_shards`).
        self.topic_shards.refresh_soon()
        self.lifecycle.assign(partitions)
        self.board.publish()
        _rebalanced("assign", partitions, started)

    def _on_revoke(self, _: confluent_kafka.Consumer, partitions: list[TopicPartition]) -> None:
        started = time.monotonic()
        self._woken = True
        self.lifecycle.revoke(partitions, settle=self)
        self.board.publish()
        _rebalanced("revoke", partitions, started)

    def _on_lost(self, _: confluent_kafka.Consumer, partitions: list[TopicPartition]) -> None:
        started = time.monotonic()
        self._woken = True
        self.lifecycle.lose(partitions)
        self.board.publish()
        _rebalanced("lost", partitions, started)

    def _on_commit(
        self, err: confluent_kafka.KafkaError | None, partitions: list[TopicPartition]
    ) -> None:
        self.commits.on_commit(err, partitions)

    def _on_message_error(self, message: Any) -> None:
        """A consumed message that carries an error instead of data."""
        err = message.error()
        if err.code() == confluent_kafka.KafkaError._AUTO_OFFSET_RESET:
            self.out_of_range.refused(message.topic(), message.partition(), message.offset(), err)
        elif err.fatal():
            self._fatal = f"fatal consumer error: {err.str()}"
        else:
            log.warning("consumer_error", code=err.name(), error=err.str())

    def _on_error(self, err: confluent_kafka.KafkaError) -> None:
        """librdkafka's error callback (called from consume/poll on this thread)."""
        self._woken = True
        auth = err.code() in (
            confluent_kafka.KafkaError._AUTHENTICATION,
            confluent_kafka.KafkaError.SASL_AUTHENTICATION_FAILED,
        )
        if err.fatal() or auth:
            self._fatal = f"{'authentication failed' if auth else 'fatal Kafka error'}: {err.str()}"
        else:
            log.warning("kafka_error", code=err.name(), error=err.str())

    # ------------------------------------------------------------------ shutdown

    def drain(self) -> None:
        """Stop fetching, finish in-flight appends, commit, flush, close: all within
        `shutdown.drain_deadline_s` of the stop request. `run` ends with it; a caller that
        built the service without running it calls it to close the service.

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

        states = self.partitions.states()
        log.info("sink_draining", partitions=len(states), deadline_s=round(left(), 1))
        self.maintenance.request_stop(left(DRAIN_RESERVE_S))
        self.flow.pause_all(states)
        self.settle(states, left(DRAIN_RESERVE_S) / 2)
        # The flushed WAL entries are left to the next owners' first flushes: the drain's
        # storage requests go to its flushes and manifests.
        self.engine.leave_trims()
        # Seal every shard before closing any: their memtables wait for the same flush
        # rounds (engine.coalesce), a few Lance commits for all of them, where a close after
        # another sealed and waited for one commit per shard.
        for state in states:
            if state.writer is not None:
                state.writer.seal(closing=True)
        # Every shard released once flushed, without waiting for WAL trims (left above).
        self.lifecycle.release_all(
            states, flush=True, timeout=max(left(DRAIN_RESERVE_S), 0.1), wait_trims=False
        )
        self.board.publish()
        self._paused_ends.close(timeout=min(left(), 1.0))
        self.topic_shards.close(timeout=min(left(), 1.0))
        self.board.consumer_closing()
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
        self.lifecycle.close()
        self.pipeline.close(timeout=min(left(), 1.0))
        for server in self.servers:
            server.stop(timeout=max(min(left() / 2, 5.0), 0.1))
        log.info(
            "sink_stopped",
            seconds=round(time.monotonic() - self._stop_at, 3),
            deadline_s=self.settings.shutdown.drain_deadline_s,
        )


def _rebalanced(kind: str, partitions: list[TopicPartition], started: float) -> None:
    """One `rebalance` event per rebalance callback (assign, revoke, lost): how many
    partitions and how long the callback held the loop (the group waits on a revoke's)."""
    log.info(
        "rebalance",
        kind=kind,
        count=len(partitions),
        seconds=round(time.monotonic() - started, 3),
    )
