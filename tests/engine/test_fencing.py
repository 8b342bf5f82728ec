"""One writer per shard (I5) and poison is terminal (I6), on a local folder and on S3."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from engine.errors import Fenced, Poisoned
from engine.flusher import TRIM_THREADS
from engine.manifest import ManifestStore, ShardManifest
from engine.shard import ShardWriter
from engine.storage import LocalStorage
from tests.engine.conftest import MakeHarness
from tests.support.engine import make_batch, source, visible_rows, writer_config
from tests.support.storage import RecordingStorage

pytestmark = pytest.mark.timeout(180)


def test_older_writer_is_fenced_and_acknowledges_nothing(any_harness: MakeHarness) -> None:
    h = any_harness()
    old = h.open()
    old.put(make_batch(h.spec, 0, 10), source(0, 10)).result(30)
    new = h.open()
    assert new.epoch == old.epoch + 1
    # The acknowledged rows of the old writer are replayed by the new one.
    assert sorted(r["_offset"] for r in visible_rows(new)) == list(range(10))
    # The old writer's next append or read fails with Fenced.
    with pytest.raises(Fenced):
        old.view()
    with pytest.raises(Fenced):
        old.put(make_batch(h.spec, 10, 5), source(10, 5))
    stats = old.stats()  # still readable
    assert stats.poisoned is not None
    assert "newer writer" in stats.poisoned
    new.put(make_batch(h.spec, 10, 5), source(10, 5)).result(30)
    new.close(flush=True)
    old.close(flush=True)
    assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(15))


def test_fenced_append_fails_the_put(any_harness: MakeHarness) -> None:
    """Without a read to notice the fence, the old writer's next WAL append finds its
    position taken by the new writer's fence entry and fails every put in it."""
    h = any_harness(config=writer_config(fence_check_interval_s=3600))
    old = h.open()
    old.put(make_batch(h.spec, 0, 10), source(0, 10)).result(30)
    new = h.open()
    future = old.put(make_batch(h.spec, 10, 5), source(10, 5))
    with pytest.raises(Fenced):
        future.result(30)
    assert [r["_offset"] for r in visible_rows(new)] == list(range(10))
    new.close(flush=False)
    old.close(flush=False)


def test_fenced_writer_does_not_flush(any_harness: MakeHarness) -> None:
    h = any_harness(config=writer_config(fence_check_interval_s=3600))
    gate = threading.Event()
    h.flusher.submit(lambda: gate.wait(60))  # hold the flush pool
    old = h.open()
    old.put(make_batch(h.spec, 0, 10), source(0, 10)).result(30)
    old.seal()  # a frozen memtable waits for the (held) pool
    new = h.open()
    gate.set()
    assert old.wait_flushed(30) is False  # it was fenced instead of flushing
    assert isinstance(old.poisoned, Fenced)
    assert h.base_rows().num_rows == 0
    new.close(flush=True)
    old.close(flush=True)
    assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(10))


def probes_of(writer: ShardWriter) -> list[str]:
    """The names of the threads that probe `writer`'s manifest for a fence from now on."""
    probes: list[str] = []
    superseded = writer.manifests.superseded

    def probe(current: ShardManifest) -> bool:
        probes.append(threading.current_thread().name)
        return superseded(current)

    writer.manifests.superseded = probe  # type: ignore[method-assign]
    return probes


def test_with_an_interval_reads_do_no_io_and_learn_of_a_fence_in_the_background(
    any_harness: MakeHarness,
) -> None:
    """`fence_check_interval_s` > 0: reads never probe the manifest themselves (no storage
    I/O on the query path); the idle writer's WAL thread probes at most that often, and its
    reads fail with Fenced soon after a newer writer claimed the shard."""
    h = any_harness(config=writer_config(fence_check_interval_s=0.2))
    old = h.open()
    old.put(make_batch(h.spec, 0, 10), source(0, 10)).result(30)
    probes = probes_of(old)
    for _ in range(4):  # reads spaced beyond the interval: each could have probed
        assert len(visible_rows(old)) == 10
        time.sleep(0.25)
    assert threading.current_thread().name not in probes
    assert probes  # the WAL thread did, in the background
    new = h.open()
    deadline = time.monotonic() + 10
    while old.poisoned is None:
        assert time.monotonic() < deadline, "the idle writer never learned of the fence"
        time.sleep(0.02)
    with pytest.raises(Fenced):
        old.view()
    assert threading.current_thread().name not in probes
    new.close(flush=False)
    old.close(flush=False)


def test_with_no_interval_every_read_probes_first(any_harness: MakeHarness) -> None:
    h = any_harness(config=writer_config(fence_check_interval_s=0))
    old = h.open()
    probes = probes_of(old)
    for _ in range(5):
        old.view()
    assert probes.count(threading.current_thread().name) == 5
    new = h.open()
    with pytest.raises(Fenced):
        old.view()
    new.close(flush=False)
    old.close(flush=False)


def test_a_revoked_shard_closes_without_waiting_for_wal_trims(any_harness: MakeHarness) -> None:
    """Closing without a flush (a revoke, in the rebalance callback) does not wait for the
    WAL trim its last flush queued: the trim threads serve all shards, and a revoke
    waited behind other shards' trims (35 s on S3). The next owner replays all the same
    while the trim is still to run, and nothing is lost or repeated."""
    h = any_harness()
    gate = threading.Event()
    for _ in range(TRIM_THREADS):  # other shards' long trims hold every trim thread
        h.flusher.trim(lambda: gate.wait(60))
    try:
        old = h.open()
        old.put(make_batch(h.spec, 0, 10), source(0, 10)).result(30)
        old.seal()
        assert old.wait_flushed(30)  # its trim is now queued behind the gate
        old.put(make_batch(h.spec, 10, 5), source(10, 5)).result(30)
        started = time.monotonic()
        old.close(flush=False, timeout=10)
        assert time.monotonic() - started < 5
        new = h.open()
        # The flushed rows are in the table, the others replayed into memtables.
        assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(10))
        assert sorted(r["_offset"] for r in visible_rows(new)) == list(range(10, 15))
    finally:
        gate.set()
    new.put(make_batch(h.spec, 15, 5), source(15, 5)).result(30)
    new.close(flush=True)
    assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(20))


def test_a_drained_shard_is_released_without_waiting_for_its_wal_trim(
    local_harness: MakeHarness,
) -> None:
    """A drain closes with a flush but does not wait for the WAL trims (a thousand shards'
    trims on S3 outlasted the drain's deadline): the shard is released with every row in
    the table, the engine's close drops the trims not started, and the next owner's first
    flush deletes the entries they left."""
    h = local_harness()
    gate = threading.Event()
    for _ in range(TRIM_THREADS):  # other shards' long trims hold every trim thread
        h.flusher.trim(lambda: gate.wait(60))
    old = h.open()
    old.put(make_batch(h.spec, 0, 10), source(0, 10)).result(30)
    started = time.monotonic()
    old.close(flush=True, timeout=10, wait_trims=False)
    assert time.monotonic() - started < 5
    assert old.manifests.latest().released
    assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(10))
    # The shard's trim is queued behind the gates: the shutdown drops it before the gates
    # open (opened first, a freed trim thread could take it before the shutdown).
    threading.Timer(0.5, gate.set).start()
    h.flusher.shutdown(cancel_trims=True)
    assert old.wal.positions(), "the dropped trim deleted nothing"
    h2 = local_harness()  # a new process: its own flusher
    new = h2.open()
    assert new.manifests.latest().released is False
    new.put(make_batch(h.spec, 10, 5), source(10, 5)).result(30)
    new.close(flush=True)
    assert new.wal.positions() == []  # its flush trimmed the old entries too
    assert sorted(h2.base_rows().column("_offset").to_pylist()) == list(range(15))


def test_a_clean_close_records_its_last_flush_and_the_release_in_one_manifest_write(
    any_harness: MakeHarness,
) -> None:
    """The flush that empties a closing shard's frozen queue also records the release: one
    manifest write per shard, not two (a drain of a thousand shards on S3 wrote each twice)."""
    h = any_harness()
    writer = h.open()
    claimed = writer.manifests.latest()
    writer.put(make_batch(h.spec, 0, 10), source(0, 10)).result(30)
    writer.close(flush=True)
    latest = writer.manifests.latest()
    assert latest.version == claimed.version + 1
    assert latest.released
    assert latest.owner_url == ""
    assert latest.lance_version == int(h.table.dataset().version)
    assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(10))


def test_a_drain_leaves_the_wal_trims_to_the_next_owner(local_harness: MakeHarness) -> None:
    """Once the engine leaves trims (a drain), a flush deletes no WAL entries, queued trims
    included: the drain's storage requests go to flushes and manifests, and the next
    owner's first flush deletes the entries left."""
    h = local_harness()
    gate = threading.Event()
    for _ in range(TRIM_THREADS):  # other shards' trims hold every trim thread
        h.flusher.trim(lambda: gate.wait(60))
    queued = h.open(shard="t-1-test")
    queued.put(make_batch(h.spec, 0, 5, partition=1), source(0, 5, partition=1)).result(30)
    queued.close(flush=True, wait_trims=False)  # its trim queued behind the gates
    h.flusher.leave_trims()
    gate.set()
    old = h.open()
    old.put(make_batch(h.spec, 0, 10), source(0, 10)).result(30)
    old.close(flush=True, wait_trims=False)
    h.flusher.shutdown()  # every trim submitted has run (or been left)
    assert old.manifests.latest().released
    assert old.wal.positions(), "a trim ran after leave_trims"
    assert queued.wal.positions(), "a queued trim ran after leave_trims"
    h2 = local_harness()  # the next owner, in a new process
    new = h2.open()
    new.put(make_batch(h.spec, 10, 5), source(10, 5)).result(30)
    new.close(flush=True)
    assert new.wal.positions() == []
    assert sorted(h2.base_rows().column("_offset").to_pylist()) == sorted([*range(5), *range(15)])


def test_a_shard_sealed_to_close_records_the_release_with_its_flush_before_its_close(
    any_harness: MakeHarness,
) -> None:
    """A drain seals every shard (`seal(closing=True)`) before closing any, and the closes
    wait for free threads: a flush that ends before its shard's close starts still records
    the release in its own manifest write, and the close writes none."""
    h = any_harness()
    writer = h.open()
    claimed = writer.manifests.latest()
    writer.put(make_batch(h.spec, 0, 10), source(0, 10)).result(30)
    writer.seal(closing=True)
    with pytest.raises(Poisoned, match="closed"):
        writer.put(make_batch(h.spec, 10, 1), source(10, 1))
    assert writer.wait_flushed(30)
    flushed = writer.manifests.latest()
    assert flushed.version == claimed.version + 1
    assert flushed.released
    writer.close(flush=True)
    assert writer.manifests.latest() == flushed
    assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(10))


def test_a_claim_lists_the_manifest_versions_once(tmp_path: Path) -> None:
    # A claim listed the versions to find the newest, then again to delete the old ones:
    # on S3 a LIST each of the ~10 requests an open makes.
    storage = RecordingStorage(LocalStorage(tmp_path / "wal"))
    store = ManifestStore(storage, "t-0-x")  # type: ignore[arg-type]
    for _ in range(3):
        store.claim("http://a:1")
    storage.listings.clear()
    claimed = store.claim("http://b:1")
    assert storage.listings == ["t-0-x/manifest"]
    # Still only the newest two versions are kept.
    assert storage.inner.list("t-0-x/manifest") == [
        store.key(claimed.version - 1),
        store.key(claimed.version),
    ]
