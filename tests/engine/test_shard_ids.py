"""One table, one set of shard ids: every spelling of `table.uri` names the same shards, a
table reopened under another spelling replays its WAL, and shards an older lance-sink wrote
under a non-canonical spelling keep their id; a table moved or copied with its WAL storage
keeps the ids of its old location, which its manifests record (real Lance and real files on
tmp_path)."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import lance
import pytest

from config.settings import Settings
from engine.engine import Engine
from engine.errors import AmbiguousShard
from engine.manifest import ManifestStore, ShardManifest, ShardOrigin
from engine.shard import ShardWriter
from engine.shard_ids import legacy_shard_ids, shard_id
from engine.storage import canonical_uri, open_storage
from tests.support.engine import make_batch, source, table_settings
from tests.support.storage import RecordingStorage

TOPIC = "events.v1"


def legacy_id(uri: str, topic: str = TOPIC, partition: int = 0) -> str:
    """The id lance-sink gave a shard before URIs were normalised: `uri` hashed as written."""
    digest = hashlib.sha256(f"{uri}\0{topic}\0{partition}".encode()).hexdigest()[:12]
    return f"events_v1-{partition}-{digest}"


def settings(table_uri: str, wal_uri: str | None = None) -> Settings:
    raw: dict[str, Any] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "topics": [TOPIC]},
        "table": table_settings(table_uri).model_dump(mode="json"),
        # Seal at 50 rows: the first put flushes, the second stays in the WAL.
        "memtable": {"max_rows": 50},
        "wal": {"max_wal_flush_interval_ms": 5},
    }
    if wal_uri is not None:
        raw["wal"]["uri"] = wal_uri
    return Settings.model_validate(raw)


def open_writer(engine: Engine, shard: str, origin: ShardOrigin | None = None) -> ShardWriter:
    """Open (claim and replay) `shard` of `engine`'s table and WAL storage."""
    return ShardWriter.open(
        shard,
        engine.spec,
        engine.table,
        engine.storage,
        engine.config,
        engine.controller,
        engine.flusher,
        origin=origin,
    )


def write_some(writer: ShardWriter, engine: Engine) -> None:
    """Rows 0..59 flushed (the next put seals their memtable, past 50 rows), 60..89 left in
    the WAL only; the writer is closed without flushing, as a crash would leave it."""
    spec = engine.spec
    writer.put(make_batch(spec, 0, 60, topic=TOPIC), source(0, 60, TOPIC)).result(30)
    writer.put(make_batch(spec, 60, 30, topic=TOPIC), source(60, 30, TOPIC)).result(30)
    deadline = time.monotonic() + 30
    while writer.stats().flushes_total < 1:
        assert time.monotonic() < deadline, writer.stats()
        time.sleep(0.01)
    assert writer.stats().flushed_rows_total == 60
    writer.close(flush=False)


def reopen_and_flush(table_uri: str, wal_uri: str | None = None) -> str:
    """Open the shard of TOPIC[0] as the sink would, check it resumes after offset 89,
    flush everything into the table and return the shard id used."""
    engine = Engine.from_settings(settings(table_uri, wal_uri))
    try:
        writer = engine.open_shard(TOPIC, 0)
        assert writer.durable_offsets[(TOPIC, 0)] == 89
        return writer.shard
    finally:
        engine.close(flush=True)


def table_offsets(path: Path) -> list[int]:
    return sorted(lance.dataset(str(path)).to_table(columns=["n"])["n"].to_pylist())


def test_spellings_of_one_location_give_one_shard_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    absolute = str(tmp_path / "data" / "t.lance")
    local = [
        absolute,
        absolute + "/",
        "./data/t.lance",
        "data/t.lance/",
        "data//t.lance",
        "./data/../data/t.lance",
        f"file://{absolute}",
        f"file://{absolute}/",
    ]
    assert {canonical_uri(u) for u in local} == {absolute}
    assert {shard_id(u, TOPIC, 3) for u in local} == {shard_id(absolute, TOPIC, 3)}
    s3 = ["s3://b/p/t.lance", "s3://b//p/t.lance", "s3://b/p/t.lance/", "s3://b/p//t.lance//"]
    assert {canonical_uri(u) for u in s3} == {"s3://b/p/t.lance"}
    assert {shard_id(u, TOPIC, 3) for u in s3} == {shard_id("s3://b/p/t.lance", TOPIC, 3)}
    # Other tables, topics and partitions stay apart.
    assert shard_id(absolute, TOPIC, 3) != shard_id(absolute + "2", TOPIC, 3)
    assert shard_id(absolute, TOPIC, 3) != shard_id(absolute, TOPIC, 4)
    assert shard_id(absolute, TOPIC, 3) != shard_id(absolute, "events_v1", 3)
    assert shard_id("s3://b/p/t.lance", TOPIC, 3) != shard_id("s3://c/p/t.lance", TOPIC, 3)


def test_canonical_uris_keep_their_legacy_shard_id() -> None:
    # Existing deployments that spelled the table canonically see no change at all.
    for uri in ("/data/events.lance", "s3://bucket/tables/events.lance"):
        assert shard_id(uri, TOPIC, 0) == legacy_id(uri)
        assert legacy_shard_ids(uri, TOPIC, 0) == []
    assert (
        shard_id("s3://bucket/tables/events.lance", TOPIC, 0) == "events_v1-0-323c3f979958"
    )  # as of 2026-12


def test_table_reopened_under_another_spelling_replays_its_wal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    first = Engine.from_settings(settings("./t.lance"))
    try:
        write_some(first.open_shard(TOPIC, 0), first)
    finally:
        first.close(flush=False)
    assert table_offsets(tmp_path / "t.lance") == list(range(60))
    used = reopen_and_flush(f"{tmp_path}/t.lance/")
    assert used == shard_id(str(tmp_path / "t.lance"), TOPIC, 0)
    # Nothing lost (60..89 replayed from the WAL), nothing twice (0..59 found flushed).
    assert table_offsets(tmp_path / "t.lance") == list(range(90))


@pytest.mark.parametrize(
    ("written", "reopened"),
    [
        ("./t.lance", "./t.lance"),  # the same config after the upgrade
        ("./t.lance", "t.lance/"),  # and another spelling of it
        ("t.lance/", "{tmp}/t.lance"),  # now spelled canonically
        ("file://{tmp}/t.lance", "./t.lance"),
    ],
)
def test_shard_of_an_older_version_keeps_its_legacy_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str, reopened: str
) -> None:
    monkeypatch.chdir(tmp_path)
    written, reopened = written.format(tmp=tmp_path), reopened.format(tmp=tmp_path)
    old = legacy_id(written)
    assert old != shard_id(written, TOPIC, 0)
    # What an older lance-sink left: a shard under the id of the URI as written, in the
    # default WAL storage <table.uri>/_lance_sink, one memtable flushed, one only in the WAL.
    engine = Engine.from_settings(settings(written))
    try:
        assert engine.storage.uri == str(tmp_path / "t.lance" / "_lance_sink")
        writer = open_writer(engine, old)
        write_some(writer, engine)
    finally:
        engine.close(flush=False)
    assert reopen_and_flush(reopened) == old
    assert reopen_and_flush(reopened) == old  # and keeps it
    assert table_offsets(tmp_path / "t.lance") == list(range(90))
    assert not (tmp_path / "t.lance" / "_lance_sink" / shard_id(written, TOPIC, 0)).exists()


def test_shared_wal_storage_adopts_only_the_spelling_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With an explicit wal.uri several tables may share the WAL storage, so other spellings
    # are not searched (one could match another table's shard); the config's own is.
    monkeypatch.chdir(tmp_path)
    wal = str(tmp_path / "shared-wal")
    old = legacy_id("./t.lance")
    storage = open_storage(wal)
    engine = Engine.from_settings(settings("./t.lance", wal))
    try:
        writer = ShardWriter.open(
            old,
            engine.spec,
            engine.table,
            storage,
            engine.config,
            engine.controller,
            engine.flusher,
        )
        write_some(writer, engine)
    finally:
        engine.close(flush=False)
    other = Engine.from_settings(settings("t.lance/", wal))
    try:
        assert other.shard_id(TOPIC, 0) == shard_id("t.lance", TOPIC, 0) != old
    finally:
        other.close(flush=False)
    assert reopen_and_flush("./t.lance", wal) == old
    assert table_offsets(tmp_path / "t.lance") == list(range(90))


def test_a_manifest_records_the_origin_of_its_shard_and_old_ones_still_load(
    tmp_path: Path,
) -> None:
    table = tmp_path / "t.lance"
    engine = Engine.from_settings(settings(str(table)))
    try:
        writer = engine.open_shard(TOPIC, 0)
        write_some(writer, engine)
        # The claim and every later version (the flush) carry it.
        manifest = ManifestStore(engine.storage, writer.shard).latest()
        assert manifest.version >= 2
        assert manifest.origin == ShardOrigin(str(table), TOPIC, 0)
    finally:
        engine.close(flush=False)
    # A version written by an earlier build has no "origin" key: it loads without one.
    raw = json.loads(manifest.encode())
    del raw["origin"]
    old = ShardManifest.decode(json.dumps(raw).encode())
    assert old.origin is None
    assert old == replace(manifest, origin=None)


@pytest.mark.parametrize("how", ["moved", "copied"])
def test_a_table_moved_with_its_wal_keeps_its_old_shard_ids(tmp_path: Path, how: str) -> None:
    # Before: the moved table started new shards and replayed nothing of the old ones, so
    # rows 60..89 (WAL only, their offsets committed) were lost.
    before, after = tmp_path / "a" / "t.lance", tmp_path / "b" / "t.lance"
    before.parent.mkdir()
    old = shard_id(str(before), TOPIC, 0)
    engine = Engine.from_settings(settings(str(before)))
    try:
        write_some(engine.open_shard(TOPIC, 0), engine)
    finally:
        engine.close(flush=False)
    (shutil.move if how == "moved" else shutil.copytree)(before.parent, after.parent)
    assert old != shard_id(str(after), TOPIC, 0)
    # The flush markers in the table's commits name the old id: 0..59 are not flushed twice.
    assert reopen_and_flush(str(after)) == old
    assert reopen_and_flush(str(after)) == old  # and keeps it
    assert table_offsets(after) == list(range(90))
    manifest = ManifestStore(open_storage(str(after / "_lance_sink")), old).latest()
    assert manifest.origin == ShardOrigin(str(after), TOPIC, 0)
    if how == "copied":  # the original is untouched and still replays its own WAL
        assert table_offsets(before) == list(range(60))
        assert reopen_and_flush(str(before)) == old
        assert table_offsets(before) == list(range(90))


def test_a_moved_table_with_state_under_several_old_ids_refuses_to_open(tmp_path: Path) -> None:
    table = tmp_path / "t.lance"
    engine = Engine.from_settings(settings(str(table)))
    earlier = [shard_id(str(tmp_path / where), TOPIC, 0) for where in ("x.lance", "y.lance")]
    # A shard of another topic whose id looks alike ("events_v1" spelled as "events.v1")
    # and a shard of another partition are not candidates.
    others = [
        (shard_id(str(tmp_path / "z.lance"), "events_v1", 0), "events_v1", 0),
        (shard_id(str(tmp_path / "z.lance"), TOPIC, 1), TOPIC, 1),
    ]
    try:
        for shard, topic, partition in [*((s, TOPIC, 0) for s in earlier), *others]:
            open_writer(
                engine, shard, ShardOrigin(str(tmp_path / "elsewhere"), topic, partition)
            ).close(flush=False)
        with pytest.raises(AmbiguousShard) as refused:
            engine.open_shard(TOPIC, 0)
        for shard in earlier:
            assert shard in str(refused.value)
        assert all(shard not in str(refused.value) for shard, _, _ in others)
        assert engine.writers() == []
        # The other topic's and partition's shards are adopted by their own.
        assert engine.shard_id("events_v1", 0) == others[0][0]
        assert engine.shard_id(TOPIC, 1) == others[1][0]
    finally:
        engine.close(flush=False)


def test_a_shared_wal_storage_is_not_searched_for_a_moved_table(tmp_path: Path) -> None:
    # With an explicit wal.uri the WAL storage stays where it was and may serve other tables
    # of the same topic: their shards must not be taken for the moved table's.
    wal = str(tmp_path / "shared-wal")
    first = Engine.from_settings(settings(str(tmp_path / "t.lance"), wal))
    try:
        first.open_shard(TOPIC, 0)
    finally:
        first.close(flush=False)
    second = Engine.from_settings(settings(str(tmp_path / "u.lance"), wal))
    try:
        assert second.shard_id(TOPIC, 0) == shard_id(str(tmp_path / "u.lance"), TOPIC, 0)
    finally:
        second.close(flush=False)


def test_the_opens_of_many_new_shards_share_one_listing_of_the_wal_root(
    tmp_path: Path,
) -> None:
    # Each open of a new shard listed the WAL storage root (and looked at every folder in
    # it) for a moved id: opening 1,024 new shards made ~500,000 stats, most of a first
    # start's ~16 s of opens (issue #39). A table moved here keeps its old ids all the same
    # (test above): the folders it brings exist before the first open lists the root.
    engine = Engine.from_settings(settings(str(tmp_path / "t.lance")))
    storage = engine.storage = RecordingStorage(engine.storage)  # type: ignore[assignment]
    try:
        writers = [engine.open_shard(TOPIC, p) for p in range(32)]
        assert [w.shard for w in writers] == [
            shard_id(str(tmp_path / "t.lance"), TOPIC, p) for p in range(32)
        ]
        assert storage.folder_listings.count("") == 1, storage.folder_listings
    finally:
        engine.close(flush=False)


def test_the_ids_of_shards_with_state_come_from_one_listing(tmp_path: Path) -> None:
    # A restart (or `TopicShards`, which maps every partition of the topic) asked each
    # shard's manifest whether its current id has state: a LIST a partition, 1,024
    # sequential LISTs ~50 s on S3. The shared root listing shows the folders.
    first = Engine.from_settings(settings(str(tmp_path / "t.lance")))
    try:
        for p in range(32):
            first.open_shard(TOPIC, p)
    finally:
        first.close(flush=False)
    engine = Engine.from_settings(settings(str(tmp_path / "t.lance")))
    storage = engine.storage = RecordingStorage(engine.storage)  # type: ignore[assignment]
    ids = [engine.shard_id(TOPIC, p) for p in range(32)]
    assert ids == [shard_id(str(tmp_path / "t.lance"), TOPIC, p) for p in range(32)]
    assert storage.listings == []
    # A partition without state still looks for it (its legacy and moved ids).
    assert engine.shard_id(TOPIC, 32) == shard_id(str(tmp_path / "t.lance"), TOPIC, 32)
    assert storage.listings


def test_opens_after_an_assignment_ask_no_id_of_a_new_shard_for_its_manifest(
    tmp_path: Path,
) -> None:
    # A new shard's open LISTed the manifest of its current id and of each legacy id (four
    # LISTs of nothing, ~40% of a first start's requests on S3). A root listing started
    # after the assignment answers for all of them.
    uri = str(tmp_path / "t.lance")
    engine = Engine.from_settings(settings(uri))
    storage = engine.storage = RecordingStorage(engine.storage)  # type: ignore[assignment]
    try:
        assigned_at = time.monotonic()
        writers = [engine.open_shard(TOPIC, p, assigned_at=assigned_at) for p in range(8)]
        assert [w.shard for w in writers] == [shard_id(uri, TOPIC, p) for p in range(8)]
        legacy = {i for p in range(8) for i in legacy_shard_ids(uri, TOPIC, p, spellings=True)}
        assert legacy  # the ids an open without the assignment's time LISTs
        assert not [k for k in storage.listings if k.split("/")[0] in legacy]
        assert storage.folder_listings.count("") == 1, storage.folder_listings
        listed_before = len(storage.listings)
        engine.open_shard(TOPIC, 8)  # no assignment time: every id is LISTed
        asked = {k.split("/")[0] for k in storage.listings[listed_before:]}
        assert set(legacy_shard_ids(uri, TOPIC, 8, spellings=True)) <= asked
    finally:
        engine.close(flush=False)


def test_a_legacy_shard_claimed_after_the_cached_listing_is_still_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The listing an assignment may stand on is one started after it: an older build that
    # claimed the partition under its legacy id after an earlier listing (and lost it to
    # this assignment) left state the open must replay.
    monkeypatch.chdir(tmp_path)
    engine = Engine.from_settings(settings("./t.lance"))
    try:
        engine.shard_id(TOPIC, 5)  # the root listing is cached now, before the claim below
        old = legacy_id("./t.lance")
        write_some(open_writer(engine, old), engine)  # an older build's shard of partition 0
        writer = engine.open_shard(TOPIC, 0, assigned_at=time.monotonic())
        assert writer.shard == old
        assert writer.durable_offsets[(TOPIC, 0)] == 89
    finally:
        engine.close(flush=False)
