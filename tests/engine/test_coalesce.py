"""Flush coalescing (`engine.coalesce`): the shards of one table that flush in the same round
share one Lance commit, paced by `flush.max_commits_per_s`, and each finds its own flush
mark in it (I3). Real Lance, real files, several shard writers on one table and one
`Flusher`.

Shards are made to wait together the way they do under load: a warm-up flush commits
first, so the pacing holds the next round back while the shards seal."""

from __future__ import annotations

import math
import time
from typing import Any

import lance
import pytest

import engine.table
from engine.coalesce import CoalesceLimits
from engine.errors import Fenced, Poisoned
from engine.manifest import ManifestStore
from engine.shard import ShardWriter
from engine.table import (
    PROP_SHARD,
    PROP_SHARDS,
    FlushRecord,
    commit_properties,
    commit_records,
    flush_commits,
    flush_properties,
    holds_generation,
    transaction_properties,
)
from tests.engine.conftest import MakeHarness
from tests.support.engine import Harness, make_batch, source, writer_config

pytestmark = pytest.mark.timeout(120)


def shard_of(p: int) -> str:
    return f"t-{p}-test"


def open_shards(h: Harness, count: int, **overrides: Any) -> list[ShardWriter]:
    return [h.open(shard=shard_of(p), **overrides) for p in range(count)]


def shards_with_rows(h: Harness, count: int, rows: int) -> list[ShardWriter]:
    """`count` open shards, `rows` rows in each (partition p: offsets 0 .. rows - 1)."""
    writers = open_shards(h, count)
    for p, w in enumerate(writers):
        put_rows(h, w, p, 0, rows)
    return writers


def put_rows(
    h: Harness, writer: ShardWriter, partition: int, first: int, count: int, **kw: Any
) -> None:
    batch = make_batch(h.spec, first, count, partition=partition, **kw)
    writer.put(batch, source(first, count, partition=partition)).result(10)


def warm_up(h: Harness) -> None:
    """One flush commit of a shard of its own: the next round waits for the pacing."""
    w = h.open(shard="warm-up")
    put_rows(h, w, 99, 0, 1)
    w.close(flush=True)


def records_above(h: Harness, version: int) -> list[dict[str, FlushRecord]]:
    """The flush records of each flush commit above `version`, oldest first."""
    ds = h.table.dataset()
    return [commit_records(p) for _, p in reversed(list(flush_commits(ds, version)))]


def test_shards_flushing_together_share_commits_within_the_rate(
    local_harness: MakeHarness,
) -> None:
    rate = 2.0
    h = local_harness(coalesce=CoalesceLimits(max_commits_per_s=rate))
    writers = shards_with_rows(h, 8, 20)
    warm_up(h)
    before = h.table.latest_version()
    started = time.monotonic()
    for w in writers:
        w.seal()
    for w in writers:
        assert w.wait_flushed(30)
    elapsed = time.monotonic() - started
    commits = h.table.latest_version() - before
    assert 1 <= commits < len(writers)  # today: one commit per shard
    assert commits <= math.floor(elapsed * rate) + 1  # the pacing bounds them
    flushed = [r for rec in records_above(h, before) for r in rec]
    assert sorted(flushed) == sorted(shard_of(p) for p in range(8))  # each shard once
    # Every shard's mark is found, and its manifest records the coalesced commit.
    for p, w in enumerate(writers):
        mark = h.table.find_flush(shard_of(p), before)
        assert mark is not None
        assert mark.offsets == {f"t:{p}": 19}
        assert mark.epoch == w.epoch
        assert w.manifests.latest().lance_version == mark.version
        assert holds_generation(h.table.dataset(), shard_of(p), mark.generation, before)
        w.close(flush=False)
    rows = h.base_rows().select(["_partition", "_offset"]).to_pylist()
    pairs = sorted((r["_partition"], r["_offset"]) for r in rows if r["_partition"] != 99)
    assert pairs == [(p, o) for p in range(8) for o in range(20)]  # exactly once


def test_a_shard_alone_commits_at_once(local_harness: MakeHarness) -> None:
    """Nothing else waits and the pacing allows: no wait for a round."""
    h = local_harness(coalesce=CoalesceLimits(max_commits_per_s=0.01))  # one per 100 s
    writer = h.open()
    put_rows(h, writer, 0, 0, 10)
    started = time.monotonic()
    writer.seal()
    assert writer.wait_flushed(10)
    assert time.monotonic() - started < 5
    writer.close(flush=False)


def test_a_fenced_shard_does_not_fail_the_others(local_harness: MakeHarness) -> None:
    h = local_harness(coalesce=CoalesceLimits(max_commits_per_s=1))
    writers = shards_with_rows(h, 3, 10)
    newer = h.open(shard=shard_of(1))  # claims shard 1: writers[1] is fenced
    warm_up(h)
    before = h.table.latest_version()
    for w in writers:
        w.seal()
    for w in (writers[0], writers[2]):
        assert w.wait_flushed(30)
    deadline = time.monotonic() + 10
    while writers[1].poisoned is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert isinstance(writers[1].poisoned, Fenced)
    commits = records_above(h, before)
    assert [sorted(c) for c in commits] == [[shard_of(0), shard_of(2)]]  # one commit, no 1
    for w in writers:
        w.close(flush=False)
    # The newer writer replayed shard 1's rows: it flushes them, once.
    newer.close(flush=True)
    rows = h.base_rows().select(["_partition", "_offset"]).to_pylist()
    pairs = sorted((r["_partition"], r["_offset"]) for r in rows if r["_partition"] != 99)
    assert pairs == [(p, o) for p in range(3) for o in range(10)]


def test_a_failed_coalesced_commit_is_retried_by_every_shard(
    local_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = writer_config(flush_retry_initial_s=0.05, flush_max_attempts=100)
    h = local_harness(config=config, coalesce=CoalesceLimits(max_commits_per_s=1))
    writers = shards_with_rows(h, 3, 10)
    warm_up(h)
    real = h.table.commit_flush
    failures = [2]

    def failing(*args: Any, **kwargs: Any) -> int:
        if failures[0]:
            failures[0] -= 1
            raise OSError("injected commit failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(h.table, "commit_flush", failing)
    before = h.table.latest_version()
    for w in writers:
        w.seal()
    for w in writers:
        assert w.wait_flushed(30)
    assert [w.stats().flush_failures_total for w in writers] == [2, 2, 2]
    assert [sorted(c) for c in records_above(h, before)] == [[shard_of(p) for p in range(3)]]
    for w in writers:
        w.close(flush=False)


def test_a_coalesced_commit_failing_for_good_poisons_every_shard(
    local_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = writer_config(flush_retry_initial_s=0.01, flush_max_attempts=3)
    h = local_harness(config=config, coalesce=CoalesceLimits(max_commits_per_s=1))
    writers = shards_with_rows(h, 3, 10)
    warm_up(h)

    def failing(*args: Any, **kwargs: Any) -> int:
        raise OSError("injected commit failure")

    monkeypatch.setattr(h.table, "commit_flush", failing)
    for w in writers:
        w.seal()
    deadline = time.monotonic() + 30
    while any(w.poisoned is None for w in writers) and time.monotonic() < deadline:
        time.sleep(0.02)
    for w in writers:
        assert isinstance(w.poisoned, Poisoned)
        assert w.stats().flush_failures_total == 3
        assert w.stats().frozen_count == 1  # kept for the next owner's replay (I8)
        w.close(flush=False)


def test_upsert_shards_with_overlapping_keys_commit_apart(local_harness: MakeHarness) -> None:
    """merge_insert of a source holding a key twice is ambiguous: a shard whose keys (upserts
    or deletes) overlap a shard's already in the round waits for the next commit."""
    h = local_harness(mode="upsert", coalesce=CoalesceLimits(max_commits_per_s=2))
    seed, a, b, c = open_shards(h, 4)

    def keyed(name: str) -> Any:
        return lambda o: name

    for i in range(5):  # k0..k4 in the base
        put_rows(h, seed, 0, i, 1, key_of=keyed(f"k{i}"))
    seed.close(flush=True)
    warm_up(h)
    before = h.table.latest_version()
    put_rows(h, a, 1, 0, 1, key_of=keyed("k1"))  # n = 0
    put_rows(h, a, 1, 1, 1, key_of=keyed("k5"))
    put_rows(h, b, 2, 10, 1, key_of=keyed("k1"))  # n = 10: the same key as a's
    put_rows(h, b, 2, 11, 1, key_of=keyed("k2"), deletes={11})
    put_rows(h, c, 3, 20, 1, key_of=keyed("k0"), deletes={20})  # a delete of a base key
    put_rows(h, c, 3, 21, 1, key_of=keyed("k7"))
    for w in (a, b, c):
        w.seal()
    for w in (a, b, c):
        assert w.wait_flushed(30)
    commits = [sorted(r) for r in records_above(h, before)]
    assert commits == [[shard_of(1), shard_of(3)], [shard_of(2)]]
    live = {r["id"]: r["n"] for r in h.base_rows().select(["id", "n"]).to_pylist()}
    ids = h.base_rows().column("id").to_pylist()
    assert len(ids) == len(set(ids))  # no key twice
    assert {k: v for k, v in live.items() if k.startswith("k")} == {
        "k1": 10,  # b's, committed after a's
        "k3": 3,
        "k4": 4,
        "k5": 1,
        "k7": 21,
    }
    for w in (a, b, c):
        w.close(flush=False)


def test_upsert_shards_with_disjoint_keys_and_deletes_share_a_commit(
    local_harness: MakeHarness,
) -> None:
    h = local_harness(mode="upsert", coalesce=CoalesceLimits(max_commits_per_s=2))
    seed, a, b = open_shards(h, 3)
    for i in range(4):
        put_rows(h, seed, 0, i, 1, key_of=lambda o: f"k{o}")
    seed.close(flush=True)
    warm_up(h)
    before = h.table.latest_version()
    put_rows(h, a, 1, 0, 2, key_of=lambda o: f"k{o}", deletes={1})  # k0 updated, k1 deleted
    put_rows(h, b, 2, 2, 2, key_of=lambda o: f"k{o}", deletes={2})  # k2 deleted, k3 updated
    for w in (a, b):
        w.seal()
    for w in (a, b):
        assert w.wait_flushed(30)
    assert [sorted(r) for r in records_above(h, before)] == [[shard_of(1), shard_of(2)]]
    live = {r["id"]: r["n"] for r in h.base_rows().select(["id", "n"]).to_pylist()}
    assert {k: v for k, v in live.items() if k.startswith("k")} == {"k0": 0, "k3": 3}
    for w in (a, b):
        w.close(flush=False)


def test_crash_between_a_coalesced_commit_and_the_manifests(local_harness: MakeHarness) -> None:
    """The multi-shard commit landed, no manifest recorded it: each shard's open finds its
    own mark in it, so nothing is replayed into a second commit (I3)."""
    h = local_harness()
    writers = shards_with_rows(h, 3, 10)
    for w in writers:
        w.close(flush=False)
    records = []
    upserts = []
    for p, w in enumerate(writers):
        wal_end = max(w.wal.positions())
        records.append(FlushRecord(shard_of(p), w.epoch, 1, wal_end, {f"t:{p}": 9}))
        upserts.append(h.spec.to_table_batch(make_batch(h.spec, 0, 10, partition=p)))
    h.table.commit_flush(upserts, None, commit_properties(records))
    for p in range(3):
        assert ManifestStore(h.storage, shard_of(p)).latest().flushed_position == 0
    for p in range(3):
        reopened = h.open(shard=shard_of(p))
        assert reopened.stats().replayed_rows == 0  # the commit covers it
        assert reopened.durable_offsets == {("t", p): 9}
        reopened.close(flush=True)
    rows = h.base_rows().select(["_partition", "_offset"]).to_pylist()
    pairs = sorted((r["_partition"], r["_offset"]) for r in rows)
    assert pairs == [(p, o) for p in range(3) for o in range(10)]


# ---------------------------------------------------------------- the two encodings


def test_single_shard_commits_keep_the_earlier_encoding() -> None:
    one = FlushRecord("s1", 3, 7, 42, {"t:0": 99})
    props = commit_properties([one])
    assert props == flush_properties("s1", 3, 7, 42, {"t:0": 99})  # readable by older builds
    assert commit_records(props) == {"s1": one}
    two = FlushRecord("s2", 1, 2, 5, {"t:1": 4})
    many = commit_properties([one, two])
    assert set(many) == {PROP_SHARDS}
    assert commit_records(many) == {"s1": one, "s2": two}
    with pytest.raises(ValueError, match="one record per shard"):
        commit_properties([one, one])


def test_undecodable_shard_properties_count_as_no_record() -> None:
    assert commit_records({}) == {}
    assert commit_records({"other.writer": "x"}) == {}
    assert commit_records({PROP_SHARDS: "not json"}) == {}
    assert commit_records({PROP_SHARDS: '{"s1": {"epoch": 1}}'}) == {}
    assert commit_records({PROP_SHARD: "s1"}) == {}  # fields missing


def test_earlier_and_coalesced_commits_are_both_found(local_harness: MakeHarness) -> None:
    """A table written by an earlier build (single-shard properties) and then by this one."""
    h = local_harness()
    batch = h.spec.to_table_batch(make_batch(h.spec, 0, 5))
    old = h.table.commit_flush([batch], None, flush_properties("s1", 1, 4, 10, {"t:0": 4}))
    records = [
        FlushRecord("s2", 2, 8, 20, {"t:1": 9}),
        FlushRecord("s3", 1, 1, 3, {"t:2": 2}),
    ]
    batch2 = h.spec.to_table_batch(make_batch(h.spec, 5, 5))
    new = h.table.commit_flush([batch2], None, commit_properties(records))
    ds = h.table.dataset()
    assert PROP_SHARD in (transaction_properties(ds, old) or {})
    mark = h.table.find_flush("s1", 0)
    assert mark is not None
    assert (mark.version, mark.wal_end, mark.epoch, mark.generation) == (old, 10, 1, 4)
    assert mark.offsets == {"t:0": 4}
    mark = h.table.find_flush("s2", 0)
    assert mark is not None
    assert (mark.version, mark.wal_end, mark.epoch, mark.generation) == (new, 20, 2, 8)
    assert h.table.find_flush("s3", new) is None  # only above the version asked
    assert holds_generation(ds, "s1", 4, old - 1)
    assert holds_generation(ds, "s3", 1, new - 1)
    assert not holds_generation(ds, "s3", 2, 0)
    assert [v for v, _ in flush_commits(ds, 0)] == [new, old]
    assert int(lance.dataset(h.spec.uri).version) == new


def test_a_round_reads_each_table_version_once(
    local_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every shard of a round checks the table versions above the one it checked last for
    a stale writer's flush (I3): the table keeps the transactions read, so a round of 16
    shards reads each version once, not 16 times (on S3, a round trip each)."""
    h = local_harness(coalesce=CoalesceLimits(max_commits_per_s=1))
    writers = shards_with_rows(h, 16, 5)
    for i in range(3):  # versions above every shard's claim
        w = h.open(shard=f"other-{i}")
        put_rows(h, w, 90 + i, 0, 1)
        w.close(flush=True)
    reads: list[int] = []
    real = engine.table.transaction_properties

    def counted(ds: lance.LanceDataset, version: int) -> dict[str, str] | None:
        reads.append(version)
        return real(ds, version)

    monkeypatch.setattr(engine.table, "transaction_properties", counted)
    before = h.table.latest_version()
    for w in writers:
        w.seal()
    for w in writers:
        assert w.wait_flushed(30)
        assert w.poisoned is None
    assert len(records_above(h, before)) <= 2
    assert reads, "the round read no transaction"
    assert max(reads.count(v) for v in set(reads)) == 1, sorted(reads)
    for w in writers:
        w.close(flush=False)


def test_a_round_of_many_shards_flushes_them_all(any_harness: MakeHarness) -> None:
    """32 shards sealed together: their fence checks and manifest updates run on several
    threads (the flush marks are read on the round's own thread: a Lance dataset is used
    by one thread at a time), and every shard flushes, none poisoned, each finding its
    mark."""
    h = any_harness(coalesce=CoalesceLimits(max_commits_per_s=1))
    writers = shards_with_rows(h, 32, 3)
    warm_up(h)
    before = h.table.latest_version()
    for w in writers:
        w.seal()
    for w in writers:
        assert w.wait_flushed(60)
        assert w.poisoned is None
    assert 1 <= len(records_above(h, before)) <= 3
    for p, w in enumerate(writers):
        mark = h.table.find_flush(shard_of(p), before)
        assert mark is not None
        assert w.manifests.latest().lance_version == mark.version
        w.close(flush=True)
        assert w.wal.positions() == []  # trimmed: every entry flushed
    rows = h.base_rows().select(["_partition", "_offset"]).to_pylist()
    pairs = sorted((r["_partition"], r["_offset"]) for r in rows if r["_partition"] != 99)
    assert pairs == [(p, o) for p in range(32) for o in range(3)]
