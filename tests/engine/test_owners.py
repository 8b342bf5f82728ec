"""Shard owners for fan-out reads: each writer records its advertised URL with its claim,
and any process lists the owners from the shard manifests (local folder and S3)."""

from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.errors import PersistenceError
from engine.manifest import ManifestStore, ShardManifest, list_owners
from engine.reads import owners as owners_module
from engine.reads.owners import Owner, ShardOwners
from engine.storage import LocalStorage, Storage
from tests.engine.conftest import MakeHarness
from tests.support.engine import make_batch, source
from tests.support.fanout import coordinator_fanout
from tests.support.storage import RecordingStorage

pytestmark = pytest.mark.timeout(120)


def test_claims_record_the_owner_url_and_any_process_lists_them(
    any_harness: MakeHarness,
) -> None:
    h = any_harness()
    pod_a = dataclasses.replace(h.config, advertised_url="http://10.0.0.1:8080")
    pod_b = dataclasses.replace(h.config, advertised_url="http://10.0.0.2:8080")
    a0 = h.open(shard="t-0-x", config=pod_a)
    a1 = h.open(shard="t-1-x", config=pod_a)
    quiet = h.open(shard="t-2-x")  # advertises nothing: listed without a URL (unadvertised)
    owners = ShardOwners(h.storage, refresh_s=3600)
    assert owners.current() == {
        "t-0-x": Owner("t-0-x", "http://10.0.0.1:8080", a0.epoch),
        "t-1-x": Owner("t-1-x", "http://10.0.0.1:8080", a1.epoch),
        "t-2-x": Owner("t-2-x", "", quiet.epoch),
    }
    # A rebalance: pod B claims t-1 (a newer epoch fences pod A's writer).
    b1 = h.open(shard="t-1-x", config=pod_b)
    assert b1.epoch == a1.epoch + 1
    assert owners.current()["t-1-x"].url == "http://10.0.0.1:8080"  # cached
    owners.saw_epoch("t-1-x", b1.epoch)  # pod B answered with an epoch not listed
    assert owners.current()["t-1-x"] == Owner("t-1-x", "http://10.0.0.2:8080", b1.epoch)
    # A flush keeps the owner (the manifest advances at the same epoch).
    h2 = h.open(shard="t-0-x", config=pod_b)
    assert list_owners(h.storage)["t-0-x"].owner_url == "http://10.0.0.2:8080"
    for w in (a0, a1, quiet, b1, h2):
        w.close(flush=False, timeout=5)


def test_owners_are_reread_after_the_refresh_interval(any_harness: MakeHarness) -> None:
    """An old copy is re-read in the background: queries meanwhile route by the copy."""
    h = any_harness()
    owners = ShardOwners(h.storage, refresh_s=0.0)
    assert owners.current() == {}
    w = h.open(shard="t-0-x", config=dataclasses.replace(h.config, advertised_url="http://p:1"))
    deadline = time.monotonic() + 10
    while owners.current() != {"t-0-x": Owner("t-0-x", "http://p:1", w.epoch)}:
        assert time.monotonic() < deadline, "the owners were never re-read"
        time.sleep(0.01)
    w.close(flush=False, timeout=5)


def test_a_manifest_written_before_owner_urls_still_reads(local_harness: MakeHarness) -> None:
    h = local_harness()
    store = ManifestStore(h.storage, "old-0-x")
    raw = dataclasses.asdict(ShardManifest(version=1, epoch=3))
    del raw["owner_url"]
    h.storage.put_if_absent(store.key(1), json.dumps(raw).encode())
    assert store.latest() == ShardManifest(version=1, epoch=3)
    assert store.claim("http://p:1").owner_url == "http://p:1"


def test_a_copy_that_lacks_a_needed_shard_is_read_again_first(
    local_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard claimed after the copy was read is routed by the very next query that
    needs it; a needed shard nobody claimed yet costs a read per query, and a failed read
    of one is an error rather than an answer without the shard."""
    h = local_harness()
    owners = ShardOwners(h.storage, refresh_s=3600)
    reads: list[float] = []
    real = owners_module.list_owners

    def counted(storage: Storage) -> dict[str, ShardManifest]:
        reads.append(time.monotonic())
        return real(storage)

    monkeypatch.setattr(owners_module, "list_owners", counted)
    url = dataclasses.replace(h.config, advertised_url="http://p:1")
    w0 = h.open(shard="t-0-x", config=url)
    assert set(owners.current(["t-0-x"])) == {"t-0-x"}
    assert set(owners.current(["t-0-x"])) == {"t-0-x"}
    assert len(reads) == 1
    w1 = h.open(shard="t-1-x", config=url)
    assert set(owners.current()) == {"t-0-x"}  # nothing needed: the cached copy
    assert set(owners.current(["t-0-x", "t-1-x"])) == {"t-0-x", "t-1-x"}
    assert len(reads) == 2
    # A shard that advertises no URL is listed (without one): needing it reads nothing more.
    quiet = h.open(shard="t-2-x")
    assert set(owners.current(["t-1-x", "t-2-x"])) == {"t-0-x", "t-1-x", "t-2-x"}
    assert owners.current()["t-2-x"].url == ""
    assert len(reads) == 3
    assert set(owners.current(["t-2-x"])) == {"t-0-x", "t-1-x", "t-2-x"}
    assert len(reads) == 3
    # Never claimed: each query reads (a copy read after it asked lists all it can).
    for _ in range(2):
        assert set(owners.current(["t-9-x"])) == {"t-0-x", "t-1-x", "t-2-x"}
    assert len(reads) == 5
    # Unknown need (the sink has not listed the partitions yet): a read per query.
    owners.current(None)
    assert len(reads) == 6

    def broken(storage: Storage) -> dict[str, ShardManifest]:
        raise PersistenceError("storage down")

    monkeypatch.setattr(owners_module, "list_owners", broken)
    assert set(owners.current(["t-1-x"])) == {"t-0-x", "t-1-x", "t-2-x"}  # listed: no read
    with pytest.raises(PersistenceError):
        owners.current(["t-9-x"])
    for w in (w0, w1, quiet):
        w.close(flush=False, timeout=5)


def test_queries_waiting_for_the_owners_share_a_read_that_began_after_them(
    local_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = local_harness()
    owners = ShardOwners(h.storage, refresh_s=3600)
    owners.current()
    reads: list[float] = []
    real = owners_module.list_owners

    def slow(storage: Storage) -> dict[str, ShardManifest]:
        reads.append(time.monotonic())
        time.sleep(0.3)
        return real(storage)

    monkeypatch.setattr(owners_module, "list_owners", slow)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: owners.current(["t-9-x"]), range(8)))
    assert all(r == {} for r in results)
    # The first query's read, then at most one more for those that asked while it ran.
    assert len(reads) <= 2, reads


def test_a_clean_close_releases_the_shard_and_fan_out_asks_nobody_for_it(
    any_harness: MakeHarness,
) -> None:
    """A writer that closed with every row in the Lance table records it (the manifest's
    `released`): other pods then answer complete without it (before, its old URL stayed
    listed and every answer named the shard missing until a new claim). A close that
    leaves rows to the next owner's replay (a revoke: no flush) releases nothing."""
    h = any_harness()
    pod = dataclasses.replace(h.config, advertised_url="http://10.0.0.1:8080")
    drained = h.open(shard="t-0-x", config=pod)
    revoked = h.open(shard="t-1-x", config=pod)
    for w in (drained, revoked):
        w.put(make_batch(h.spec, 0, 5), source(0, 5)).result(10)
    drained.close(flush=True, timeout=10)
    revoked.close(flush=False, timeout=10)
    listed = list_owners(h.storage)
    assert (listed["t-0-x"].released, listed["t-0-x"].owner_url) == (True, "")
    assert (listed["t-1-x"].released, listed["t-1-x"].owner_url) == (False, pod.advertised_url)
    fanout = coordinator_fanout(h.storage, 200, expected=lambda: {"t-0-x", "t-1-x"})
    try:
        tier = fanout.tier(set(), h.table.latest_version(), h.spec)
        assert tier is not None
        assert set(tier.groups) == {pod.advertised_url}
        assert set(tier.groups[pod.advertised_url]) == {"t-1-x"}
        assert tier.missing == {}
    finally:
        fanout.close()
    # The next owner's claim ends the release: it serves the shard's fresh rows again.
    again = h.open(shard="t-0-x", config=pod)
    assert list_owners(h.storage)["t-0-x"].released is False
    again.close(flush=False, timeout=5)


def test_the_owners_of_many_shards_are_read_together(tmp_path: Path) -> None:
    # Two round trips a shard, one shard after another: 1,024 shards took ~100 s on S3 at
    # 50 ms a request, and a query whose copy lacked a shard waited for the whole read.
    storage = LocalStorage(tmp_path / "wal")
    for i in range(32):
        ManifestStore(storage, f"t-{i}-x").claim(f"http://10.0.0.{i}:8080")
    started = time.monotonic()
    listed = list_owners(RecordingStorage(storage, delay_s=0.02))  # type: ignore[arg-type]
    elapsed = time.monotonic() - started
    assert {shard: m.owner_url for shard, m in listed.items()} == {
        f"t-{i}-x": f"http://10.0.0.{i}:8080" for i in range(32)
    }
    assert elapsed < 32 * 2 * 0.02 / 4, elapsed  # 1.28 s one shard after another


def wait_for_owner(owners: ShardOwners, shard: str, url: str) -> None:
    deadline = time.monotonic() + 10
    while (owner := owners.current().get(shard)) is None or owner.url != url:
        assert time.monotonic() < deadline, f"{shard} never listed at {url}"
        time.sleep(0.01)


def test_between_whole_reads_only_the_shards_claimed_since_are_read(tmp_path: Path) -> None:
    # A pod answering queries re-read every manifest each refresh_s: at 1,024 shards on
    # S3, 2,049 requests every ~7 s. Between whole reads the claim board says which changed.
    storage = RecordingStorage(LocalStorage(tmp_path / "wal"))
    for i in range(16):
        ManifestStore(storage.inner, f"t-{i}-x").claim("http://a:1")
    owners = ShardOwners(storage, refresh_s=0.0)  # type: ignore[arg-type]
    assert len(owners.current()) == 16
    before = storage.manifest_gets()
    ManifestStore(storage.inner, "t-3-x").claim("http://b:1")  # a rebalance moved t-3
    wait_for_owner(owners, "t-3-x", "http://b:1")
    assert storage.manifest_gets() - before <= 2, storage.manifest_gets() - before  # t-3's


def test_what_the_board_does_not_show_arrives_with_the_next_whole_read(tmp_path: Path) -> None:
    # An older build's claim posts no marker (nor does a release): the next whole read,
    # every full_read_s, lists it.
    storage = LocalStorage(tmp_path / "wal")
    store = ManifestStore(storage, "t-0-x")
    current = store.claim("http://a:1")
    owners = ShardOwners(storage, refresh_s=0.0, full_read_s=0.5)
    assert owners.current()["t-0-x"].url == "http://a:1"
    newer = dataclasses.replace(current, version=current.version + 1, epoch=current.epoch + 1)
    storage.put_if_absent(
        store.key(newer.version), dataclasses.replace(newer, owner_url="http://b:1").encode()
    )
    wait_for_owner(owners, "t-0-x", "http://b:1")


def test_a_shard_whose_owner_did_not_answer_is_read_again_at_the_next_re_read(
    tmp_path: Path,
) -> None:
    # A drained pod released its shards (no marker on the board) and answers no more: the
    # coordinator rechecks the shards it routed there instead of naming them missing until
    # the next whole read (a minute).
    storage = LocalStorage(tmp_path / "wal")
    store = ManifestStore(storage, "t-0-x")
    current = store.claim("http://gone:1")
    owners = ShardOwners(storage, refresh_s=0.0)
    assert owners.current()["t-0-x"].released is False
    store.advance(current, owner_url="", released=True)
    owners.recheck(["t-0-x"])
    deadline = time.monotonic() + 10
    while not owners.current()["t-0-x"].released:
        assert time.monotonic() < deadline, "the released shard was never read again"
        time.sleep(0.01)
