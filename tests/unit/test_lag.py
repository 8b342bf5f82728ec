"""Lag figures without a broker: flushed watermarks read from table storage (real Lance and
real shard manifests on tmp_path), and the arithmetic and rendering of `lance-sink lag`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from config import load_settings
from config.settings import Settings
from engine.shard_ids import shard_id
from engine.table import flush_properties
from sink.cli import lag_report, render_lag
from sink.kafka_conf import consumer_only_keys, lag_confs
from sink.lag import FlushedReader, PartitionLag, PartitionOffsets
from tests.support.engine import Harness, make_batch, source
from tests.support.sink import write_config


def test_flushed_watermarks_come_from_manifests_and_newer_lance_commits(tmp_path: Path) -> None:
    settings = load_settings(
        write_config(
            tmp_path / "sink.toml",
            bootstrap="127.0.0.1:9",
            topics=["t"],
            group="g",
            table_uri=str(tmp_path / "table.lance"),
        )
    )
    reader = FlushedReader(settings)
    assert reader.read([("t", 0), ("t", 1)]) == {}  # no sink ever wrote: nothing flushed
    h = Harness(settings.table.uri, settings.wal_uri)
    h.shard = shard_id(settings.table.uri, "t", 0)
    try:
        writer = h.open()
        for i in range(3):
            writer.put(make_batch(h.spec, i * 10, 10), source(i * 10, 10)).result(10)
        writer.close(flush=False)  # durable in the WAL only
        assert reader.read([("t", 0), ("t", 1)]) == {}
        # A flush whose Lance commit landed but whose manifest update did not (a writer
        # killed in between): the commit's transaction properties carry the watermark.
        wal_end = max(writer.wal.positions())
        props = flush_properties(h.shard, writer.epoch, 1, wal_end, {"t:0": 29})
        h.table.commit_flush([h.spec.to_table_batch(make_batch(h.spec, 0, 30))], None, props)
        assert writer.manifests.latest().flushed_offsets == {}
        assert reader.read([("t", 0), ("t", 1)]) == {("t", 0): 30}
        # The next owner records it in the manifest, then flushes more.
        again = h.open()
        again.put(make_batch(h.spec, 30, 5), source(30, 5)).result(10)
        again.close(flush=True)
        assert again.manifests.latest().flushed_offsets == {"t:0": 34}
        assert reader.read([("t", 0), ("t", 1)]) == {("t", 0): 35}
    finally:
        h.flusher.shutdown()


def test_partition_lag_levels_and_report() -> None:
    lags = [
        PartitionLag("t", 0, start=0, end=100, committed=90, flushed=40),
        PartitionLag("t", 1, start=5, end=50, committed=None, flushed=None),
        PartitionLag("t", 2, start=0, end=70, committed=60, flushed=65),
    ]
    assert [p.lag for p in lags] == [10, 45, 10]
    assert [p.flush_lag for p in lags] == [60, 45, 5]
    assert [p.unflushed for p in lags] == [50, 0, 0]  # flushed ahead of committed: none
    report = lag_report("g", lags, "flushed", with_flushed=True)
    assert report["total_lag"] == report["total_flush_lag"] == 110
    assert report["total_commit_lag"] == 65
    assert report["total_unflushed"] == 50
    assert report["partitions"][0] == {
        "topic": "t",
        "partition": 0,
        "end": 100,
        "committed": 90,
        "lag": 10,
        "flushed": 40,
        "flush_lag": 60,
        "unflushed": 50,
    }
    plain = lag_report("g", lags, "committed", with_flushed=False)
    assert plain["total_lag"] == 65
    assert "flushed" not in plain["partitions"][0]
    text = render_lag(lags, with_flushed=True)
    assert text.splitlines()[0].split()[-4:] == ["FLUSHED", "FLUSH", "LAG", "UNFLUSHED"]
    assert text.splitlines()[-1].split() == ["TOTAL", "65", "110", "50"]


def test_offsets_snapshot_lags() -> None:
    snap = PartitionOffsets(
        end=100, consumed=95, durable=90, committed=80, flushed=50, oldest_pending_timestamp_ms=0
    )
    assert snap.lags() == {"consumer": 5, "durable": 10, "commit": 20, "flush": 50}
    assert snap.lag_seconds(now=12.5) == 12.5
    assert PartitionOffsets(None, 1, 1, 1, 1).lags() is None
    assert PartitionOffsets(10, 10, 10, 10, 10).lag_seconds() == 0.0


def kafka_settings(tmp_path: Path, kafka: dict[str, Any]) -> Settings:
    """Settings of a sink on t with these `kafka` section values."""
    return load_settings(
        write_config(
            tmp_path / "sink.toml",
            bootstrap="127.0.0.1:9",
            topics=["t"],
            group="g",
            table_uri=str(tmp_path / "table.lance"),
            extra={"kafka": kafka},
        )
    )


def test_lag_clients_take_the_pass_through_properties(tmp_path: Path) -> None:
    """Connection keys of `kafka.librdkafka` go to both of `lag`'s clients; consumer-only
    keys (which librdkafka would ignore on the admin client with a warning) only to the
    probe consumer."""
    passthrough = {
        "socket.timeout.ms": 12345,
        "fetch.min.bytes": 7,
        "queued.max.messages.kbytes": 4096,
    }
    admin, probe = lag_confs(kafka_settings(tmp_path, {"librdkafka": passthrough}))
    assert admin["bootstrap.servers"] == probe["bootstrap.servers"] == "127.0.0.1:9"
    assert admin["socket.timeout.ms"] == probe["socket.timeout.ms"] == 12345
    assert "fetch.min.bytes" not in admin
    assert "queued.max.messages.kbytes" not in admin
    assert probe["fetch.min.bytes"] == 7
    assert probe["queued.max.messages.kbytes"] == 4096


def test_lag_clients_take_keys_valid_only_with_their_companions(tmp_path: Path) -> None:
    """An SSL cluster's keystore pair reaches both of `lag`'s clients: the admin client's
    consumer-only keys are found with the pass-through keys together (a probe of
    ``ssl.keystore.location`` alone is refused by librdkafka: the password is mandatory)."""
    keystore = {"ssl.keystore.location": "client.p12", "ssl.keystore.password": "ks-s3cr3t"}
    kafka = {"security_protocol": "SSL", "librdkafka": {**keystore, "fetch.min.bytes": 7}}
    admin, probe = lag_confs(kafka_settings(tmp_path, kafka))
    for conf in (admin, probe):
        assert conf["security.protocol"] == "SSL"
        assert {k: conf[k] for k in keystore} == keystore
    assert "fetch.min.bytes" not in admin
    assert probe["fetch.min.bytes"] == 7
    assert consumer_only_keys({**keystore, "fetch.min.bytes": 7}) == {"fetch.min.bytes"}
