"""Metric names and help texts are part of the interface: dashboards and alerts use them."""

from __future__ import annotations

import pytest

from sink.lag import PartitionOffsets
from sink.metrics import Metrics

EXPECTED = {
    "lance_sink_base_unindexed_rows": "Rows of the base table not covered by the vector index.",
    "lance_sink_budget_bytes": "The process memory budget for unflushed rows.",
    "lance_sink_budget_used_bytes": "Unflushed bytes counted against the budget.",
    "lance_sink_bytes_ingested": "Arrow bytes of the rows made durable and visible.",
    "lance_sink_commit_delay_seconds": (
        "Time from an offset becoming durable to its commit being acknowledged."
    ),
    "lance_sink_commit_failures": "Offset commits the broker refused or that failed.",
    "lance_sink_commit_lag_messages": "Log end offset minus committed offset.",
    "lance_sink_committed_offset": "Offset committed to Kafka.",
    "lance_sink_consumed_offset": "Next offset the consumer will hand to the sink (position).",
    "lance_sink_consumer_lag_messages": "Log end offset minus consumed position.",
    "lance_sink_cdc_truncates": (
        "Truncate events (op t) of Debezium change streams skipped (source.truncate = skip): "
        "the table keeps its rows; a truncate decoded again (a redelivery) counts again."
    ),
    "lance_sink_decode_errors": (
        "Messages whose decoding raised (no decode path foresaw the value); each is a "
        "decode_error dead letter."
    ),
    "lance_sink_dlq_delivery_failures": (
        "Failed attempts to deliver a dead letter (each is re-sent, or replaced by an "
        "envelope), by source topic and librdkafka error."
    ),
    "lance_sink_dlq_held_seconds": (
        "How long the partition has waited for its dead letters to be acknowledged "
        "(0 when none are pending)."
    ),
    "lance_sink_dlq_messages": "Messages sent to the dead-letter topic, by reason.",
    "lance_sink_dlq_payload_omitted": (
        "Dead letters the dead-letter topic refused in full and got as an envelope "
        "(payload in the dead-letter Lance table if configured, and the source topic)."
    ),
    "lance_sink_durable_lag_messages": "Log end offset minus durable offset.",
    "lance_sink_durable_offset": (
        "1 + the last offset whose WAL append is durable, or past it to offsets without rows."
    ),
    "lance_sink_flush_failures": "Failed flush attempts (retried).",
    "lance_sink_flush_lag_messages": "Log end offset minus flushed offset.",
    "lance_sink_flush_rows": "Rows flushed into the Lance table.",
    "lance_sink_flush_seconds": "Duration of one memtable flush into Lance.",
    "lance_sink_flushed_offset": (
        "1 + the last offset flushed into the Lance table, or past it to offsets without rows."
    ),
    "lance_sink_freshness_seconds": (
        "Time from a batch's oldest message timestamp to its rows being visible."
    ),
    "lance_sink_freshness_stage_seconds": (
        "Time from a batch's oldest message timestamp (its broker append, with the "
        "default timestamp type) to the batch passing each stage of its path: fetched "
        "(consume() returned it), decoded (the loop collected it decoded), durable (WAL "
        "durable and visible to queries), committed (the group acknowledged its offset)."
    ),
    "lance_sink_lag_seconds": "Age of the oldest message not yet durable (0 when caught up).",
    "lance_sink_log_end_offset": "Log end offset (high watermark).",
    "lance_sink_maintenance_active": (
        "1 while this pod runs base-table maintenance: it holds the group's maintenance "
        "partition (partition 0 of the first topic); 0 while another pod does, or with "
        "maintenance off."
    ),
    "lance_sink_maintenance_process_exits": (
        "Times the maintenance child process exited on its own (crash, OOM kill); each is "
        "restarted with backoff."
    ),
    "lance_sink_maintenance_runs": "Base-table maintenance tasks run, by outcome.",
    "lance_sink_memtable_bytes": "Resident bytes of the active memtable.",
    "lance_sink_memtable_index_bytes": "Resident bytes of in-memory indexes (all memtables).",
    "lance_sink_partition_paused": "1 while the partition is paused.",
    "lance_sink_partition_stopped": "1 once the partition stopped for good (until it is "
    "assigned again): a bad message with no dead-letter topic, a batch the table refused, or "
    "an offset past the partition's log end (/readyz says which).",
    "lance_sink_offsets_skipped": "Offsets the broker deleted (retention, DeleteRecords) before "
    "the sink read them: the sink resumed at the log start, their messages are not in the "
    "table.",
    "lance_sink_query_seconds": (
        "Query latency by kind (fresh: this pod's answers to other pods' fan-out requests "
        "for its memtables' rows)."
    ),
    "lance_sink_query_fanout_stale_base": (
        "Queries run again on a newer base version because a pod they asked for fresh rows "
        "had flushed past the base version they read."
    ),
    "lance_sink_query_fanout_missing_shards": (
        "Shards whose fresh rows a query lacked (answered partial, or failed) because the "
        "pod listed as their owner did not answer in time (timeout), answered with an error "
        "(error) or does not hold them (unheld: a rebalance in progress), or because their "
        "writer advertised no URL to ask (unadvertised), by cause."
    ),
    "lance_sink_ingest_paused_seconds": (
        "Seconds the consumer loop paused so that the queries running on this pod get "
        "their share of its time (query.ingest_share)."
    ),
    "lance_sink_query_unindexed_cache_bytes": (
        "Bytes of base rows the indexes do not cover yet, held in memory for queries "
        "(vector matrices, flushed memtables kept for text search)."
    ),
    "lance_sink_query_unindexed_fallbacks": (
        "Queries that read unindexed base rows from storage, by kind: vector (the "
        "fragments not held within query.unindexed_cache_bytes, read by the query), text "
        "(Lance's flat scan; before the first text index, the reader's own tokenising of "
        "the whole base): the rows were not all held within the bound, or failed to load."
    ),
    "lance_sink_rebalance_events": "Partitions assigned, revoked or lost.",
    "lance_sink_replay_rows": "Rows replayed from the WAL.",
    "lance_sink_replay_seconds": "Duration of the last WAL replay of the shard.",
    "lance_sink_rows_ingested": "Rows made durable and visible.",
    "lance_sink_arrow_pool_bytes": "Bytes allocated from Arrow's memory pool now (memtables, "
    "decoded batches, query results; Lance and faiss allocate elsewhere).",
    "lance_sink_query_lance_cache_bytes": "Bytes held by the Lance index and metadata caches "
    "that queries on the base share (bounded by query.lance_index_cache_bytes and "
    "query.lance_metadata_cache_bytes).",
    "lance_sink_registry_failures": "Batches whose decoding failed because the schema registry "
    "could not answer.",
    "lance_sink_registry_paused": "1 while the partition is paused because the schema registry "
    "cannot be reached (its messages are decoded again when it answers; none go to the DLQ for "
    "it).",
    "lance_sink_shard_open_failures": "Failed attempts to open (claim and replay) a partition's "
    "shard writer; each is retried with backoff while the partition consumes nothing.",
    "lance_sink_wal_append_bytes": "Bytes appended to the WAL.",
    "lance_sink_wal_append_seconds": "Duration of one durable WAL append.",
    "lance_sink_wal_backpressure_active_waits": "Backpressure waits in progress.",
    "lance_sink_wal_backpressure_rejections": "Puts refused with Backpressure.",
    "lance_sink_wal_backpressure_wait_seconds": "Seconds spent in completed backpressure waits.",
    "lance_sink_wal_backpressure_waits": "Completed backpressure waits.",
    "lance_sink_wal_sealed_memtables": "Frozen memtables waiting to be flushed.",
    "lance_sink_wal_unflushed_bytes": "Bytes in memtables (active and frozen) not yet flushed.",
    "lance_sink_writer_poisoned": "1 while the shard writer is poisoned.",
}


def test_metric_names_and_help_are_stable() -> None:
    metrics = Metrics()
    found = {m.name: m.documentation for m in metrics.registry.collect()}
    assert found == EXPECTED


def test_counters_end_in_total_and_units_are_named() -> None:
    text = Metrics().exposition().decode()
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            _, _, name, kind = line.split()
            if kind == "counter":
                assert name.endswith("_total"), name
            else:
                assert name.endswith(
                    (
                        "_bytes",
                        "_seconds",
                        "_messages",
                        "_offset",
                        "_rows",
                        "_memtables",
                        "_waits",
                        "_paused",
                        "_poisoned",
                        "_stopped",
                        "_active",
                    )
                ), name


def test_unindexed_cache_gauge_and_fallback_total_follow_the_reader() -> None:
    metrics = Metrics()
    metrics.unindexed_cache(4096, 3, 0)
    metrics.unindexed_cache(1024, 5, 2)
    metrics.unindexed_cache(1024, 5, 2)
    registry = metrics.registry
    assert registry.get_sample_value("lance_sink_query_unindexed_cache_bytes") == 1024
    fallbacks = "lance_sink_query_unindexed_fallbacks_total"
    assert registry.get_sample_value(fallbacks, {"kind": "vector"}) == 5
    assert registry.get_sample_value(fallbacks, {"kind": "text"}) == 2


def feed(metrics: Metrics, topic: str, partitions: int) -> None:
    """Every partition-labelled and shard-labelled metric of `partitions` partitions."""
    for p in range(partitions):
        shard = f"{topic}-{p}-shard"
        metrics.shard_origin(shard, topic, p)
        metrics.partition_offsets(topic, p, PartitionOffsets(100 + p, 90, 80, 70, 60, None))
        metrics.partition_paused(topic, p, p % 2 == 0)
        metrics.partition_poisoned(topic, p, False)
        metrics.partition_stopped(topic, p)
        metrics.offsets_skipped(topic, p, 1)
        metrics.shard_open_failed(topic, p)
        metrics.registry_paused(topic, p, True)
        metrics.ingested(topic, p, 10, 1000)
        metrics.dlq_waiting(topic, p, float(p))
        metrics.wal_appended(shard, 0.01, 100, 10)
        metrics.flushed(shard, 0.5, 10)
        metrics.flush_failed(shard, OSError())
        metrics.replayed(shard, 0.1 * p, 5, 50)
        metrics.shard_memory(shard, unflushed=10, frozen_count=1, active=5, index=2)


def series_count(metrics: Metrics) -> int:
    text = metrics.exposition().decode()
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def test_by_topic_the_series_do_not_grow_with_the_partitions() -> None:
    """`observability.partition_metrics = "topic"`: 8 or 512 partitions of a topic give the
    same series; per partition (the default) they grow with the partitions."""
    counts = {}
    for mode in ("partition", "topic"):
        for partitions in (8, 512):
            metrics = Metrics(partition_metrics=mode)  # type: ignore[arg-type]
            feed(metrics, "wide", partitions)
            counts[(mode, partitions)] = series_count(metrics)
    assert counts[("topic", 8)] == counts[("topic", 512)]
    assert counts[("partition", 512)] > 30 * counts[("partition", 8)]


def test_by_topic_gauges_are_the_sums_of_the_partition_series_and_ages_the_largest() -> None:
    """Each topic series equals `sum by (topic)` of the per-partition series (`max` for the
    ages), counters and histograms count the topic's events, names and help unchanged."""
    per_partition, by_topic = Metrics(), Metrics(partition_metrics="topic")
    for metrics in (per_partition, by_topic):
        feed(metrics, "a", 6)
        feed(metrics, "b", 3)
    assert {m.name: m.documentation for m in by_topic.registry.collect()} == EXPECTED
    largest = {
        "lance_sink_lag_seconds",
        "lance_sink_dlq_held_seconds",
        "lance_sink_replay_seconds",
    }
    expected: dict[tuple[str, str], float] = {}
    shard_topic = {f"{t}-{p}-shard": t for t in ("a", "b") for p in range(6)}
    for metric in per_partition.registry.collect():
        for sample in metric.samples:
            labels = dict(sample.labels)
            topic = labels.pop("topic", None) or shard_topic.get(labels.pop("shard", ""))
            labels.pop("partition", None)
            if topic is None:
                continue
            key = (sample.name + str(sorted(labels.items())), topic)
            if metric.name in largest:
                expected[key] = max(expected.get(key, 0.0), sample.value)
            else:
                expected[key] = expected.get(key, 0.0) + sample.value
    found: dict[tuple[str, str], float] = {}
    for metric in by_topic.registry.collect():
        for sample in metric.samples:
            labels = dict(sample.labels)
            assert "partition" not in labels, sample
            assert "shard" not in labels, sample
            topic = labels.pop("topic", None)
            if topic is not None:
                found[(sample.name + str(sorted(labels.items())), topic)] = sample.value
    assert found == pytest.approx(expected)
    assert by_topic.registry.get_sample_value(
        "lance_sink_commit_lag_messages", {"topic": "a"}
    ) == sum(100 + p - 70 for p in range(6))
    assert by_topic.registry.get_sample_value("lance_sink_partition_paused", {"topic": "a"}) == 3


def test_by_topic_a_revoked_partition_leaves_the_sums_and_the_last_one_the_series() -> None:
    metrics = Metrics(partition_metrics="topic")
    feed(metrics, "a", 2)
    get = metrics.registry.get_sample_value
    metrics.forget_partition("a", 0, "a-0-shard")
    assert get("lance_sink_log_end_offset", {"topic": "a"}) == 101
    assert get("lance_sink_wal_unflushed_bytes", {"topic": "a"}) == 10
    metrics.forget_partition("a", 1, "a-1-shard")
    assert get("lance_sink_log_end_offset", {"topic": "a"}) is None
    assert get("lance_sink_wal_unflushed_bytes", {"topic": "a"}) is None
    assert get("lance_sink_rows_ingested_total", {"topic": "a"}) == 20  # counters stay
