"""A query-only process (`lance-sink serve`): the query API without a consumer.

A writer process (`lance-sink run`) answers queries beside ingestion: both share its cores
and its interpreter lock, so while it catches up its queries wait behind decoding and
puts. A query-only process reads the same table the same way any writer pod's queries do
(docs/reads.md, "Several pods"): the Lance base, and every shard's fresh rows from the
memtables of the pod that holds it (fan-out, the owners read from the shard manifests).
It consumes nothing, claims no shard, advertises no URL and runs no maintenance, so a
Deployment of them scales queries apart from ingestion (the Helm chart's `serve`
Deployment; docs/deploy.md says which topology to use when).

It needs what a writer's queries need: the table, its WAL storage (the shard manifests
name each shard's owner) and the brokers (every partition of the topics, which are the
shards an answer must route: `sink.topic_shards`). Its fan-out answers are as complete as
a writer pod's: a shard whose owner does not answer in time, or advertised no URL, is
named in the answer's `missing` (`partial`).

Lifecycle: `run` serves until `stop` (a signal), then closes the servers, the reader and
the table. Alive while it runs; ready once the brokers listed the topics' partitions.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import structlog

from config.settings import Settings
from engine.engine import Engine
from engine.reader import Reader, ReaderSettings
from engine.reads.owners import ShardOwners
from engine.reads.remote import Fanout
from sink.http import ServerHandle, create_query_app, run_server
from sink.kafka_conf import lag_confs
from sink.metrics import Metrics
from sink.server import create_ops_app
from sink.topic_shards import TopicShards

log = structlog.get_logger("lance_sink")


class QueryService:
    """The query API and the operations endpoints over the table, with no consumer."""

    def __init__(
        self, settings: Settings, *, metrics: Metrics | None = None, engine: Engine | None = None
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.engine = engine or Engine.from_settings(settings, events=self.metrics)
        query = settings.query
        self.topic_shards = TopicShards(
            lag_confs(settings)[0], list(settings.kafka.topics), self.engine.shard_id
        )
        self.reader = Reader(
            self.engine.spec,
            self.engine.table,
            list,  # no shard writer of its own: every shard's fresh rows are another pod's
            ReaderSettings.from_settings(query),
            events=self.metrics,
            fanout=Fanout(
                ShardOwners(self.engine.storage, query.owners_refresh_ms / 1000),
                "",
                query.fanout_timeout_ms / 1000,
                None if query.auth_token is None else query.auth_token.get_secret_value(),
                workers=2 * query.max_concurrent_queries,
                expected=self.topic_shards.current,
            ),
        )
        self.servers: list[ServerHandle] = []
        self._stop = threading.Event()
        self._started = time.monotonic()

    def run(self) -> int:
        """Serve until `stop`; returns the exit code (0)."""
        self.topic_shards.start()
        self.start_servers()
        log.info("serve_started", topics=list(self.settings.kafka.topics))
        try:
            while not self._stop.wait(1.0):
                self.refresh_metrics()
        finally:
            self.close()
        return 0

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start_servers(self) -> None:
        """The query API, and /metrics, /healthz, /readyz, /v1/status (one server when
        both ports are the same, as `SinkService.start_servers`)."""
        obs, query = self.settings.observability, self.settings.query
        queries = create_query_app(self.reader, query)
        if query.port == obs.metrics_port and query.port != 0:
            self.servers.append(run_server(create_ops_app(self, queries), query.host, query.port))
            return
        ops = create_ops_app(self, auth_token=query.auth_token)
        self.servers.append(run_server(ops, obs.metrics_host, obs.metrics_port))
        self.servers.append(run_server(queries, query.host, query.port))

    def close(self) -> None:
        log.info("serve_stopping")
        for server in self.servers:
            server.stop(timeout=5.0)
        self.topic_shards.close(timeout=1.0)
        self.reader.close(timeout=1.0)
        self.engine.close(flush=False, timeout=1.0)
        log.info("serve_stopped", seconds=round(time.monotonic() - self._started, 1))

    # ------------------------------------------------------------------ operations

    def refresh_metrics(self) -> None:
        """The reader's gauges (once a second)."""
        reader = self.reader
        self.metrics.lance_cache(reader.lance_cache_bytes)
        vector, text = reader.unindexed, reader.flushed_text
        self.metrics.unindexed_cache(
            reader.unindexed_bytes,
            0 if vector is None else vector.fallbacks,
            0 if text is None else text.fallbacks,
        )

    def exposition(self) -> bytes:
        return self.metrics.exposition()

    def liveness(self) -> tuple[bool, str]:
        return (not self._stop.is_set(), "serving queries")

    def readiness(self) -> tuple[bool, list[str]]:
        """Ready once the brokers listed the topics' partitions (before, every query reads
        the shard manifests first; with no broker, the fresh rows of shards no writer has
        claimed yet could be unnamed in an answer)."""
        reasons = []
        if self.topic_shards.current() is None:
            reasons.append("no partition list from the brokers yet")
        if self._stop.is_set():
            reasons.append("stopping")
        return not reasons, reasons

    def status(self) -> dict[str, Any]:
        shards = self.topic_shards.current()
        return {
            "mode": "serve",
            "table": self.engine.spec.uri,
            "topics": list(self.settings.kafka.topics),
            "shards_routed": None if shards is None else len(shards),
            "uptime_s": round(time.monotonic() - self._started, 1),
        }
