"""The WAL scheduler (`engine.wal_scheduler`): shards share a pool of WAL workers and one
timer, so opening shards adds no threads and an idle shard costs no wake-ups; the WAL
contracts (group commit, futures resolved in put order, close writes what is buffered) hold
with many shards on few workers (real Lance and real files on tmp_path)."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine
from engine.errors import Fenced
from engine.manifest import ShardManifest
from engine.shard import PutResult, ShardWriter
from engine.wal_scheduler import PROBE_BATCH_S, WalScheduler
from tests.engine.conftest import MakeHarness
from tests.engine.test_shard_ids import TOPIC, settings
from tests.support.engine import make_batch, source, writer_config

SHARDS = 64


def test_opening_64_shards_adds_no_thread_per_shard(local_harness: MakeHarness) -> None:
    """Writers opened without an engine share the process-wide scheduler: the threads do
    not grow with the shards (they did by one WAL thread each)."""
    harness = local_harness()
    first = harness.open(shard="t-first-test")
    before = threading.active_count()
    writers = [harness.open(shard=f"t-{i}-test") for i in range(SHARDS)]
    assert threading.active_count() - before <= 2, threading.enumerate()
    futures = [
        w.put(make_batch(harness.spec, 0, 5, partition=i), source(0, 5, partition=i))
        for i, w in enumerate(writers)
    ]
    assert all(f.result(30).rows == 5 for f in futures)
    for w in [first, *writers]:
        w.close(flush=False)


def test_an_idle_shard_is_not_woken(local_harness: MakeHarness) -> None:
    """An idle shard's WAL step runs only for its fence probe (every
    `fence_check_interval_s`), never on a short poll: 64 idle shards, no step in a second."""
    scheduler = WalScheduler(2)
    harness = local_harness(config=writer_config(fence_check_interval_s=3.0))
    try:
        writers = [harness.open(shard=f"t-{i}-test", scheduler=scheduler) for i in range(SHARDS)]
        time.sleep(1.0)  # the first step of each (+0.5 s): its first fence probe
        steps = scheduler.steps_total
        assert steps >= SHARDS
        time.sleep(1.2)
        assert scheduler.steps_total == steps
        for w in writers:
            w.close(flush=False)
    finally:
        scheduler.close()


def test_many_shards_on_two_workers_keep_put_order_and_group_commit(
    local_harness: MakeHarness,
) -> None:
    """Puts to 64 shards on 2 workers: each shard's futures resolve in put order with
    non-decreasing WAL positions, puts within the window share entries, and close writes
    what is still buffered."""
    scheduler = WalScheduler(2)
    harness = local_harness(config=writer_config(max_rows=10**6, interval_s=0.05))
    try:
        writers = [harness.open(shard=f"t-{i}-test", scheduler=scheduler) for i in range(SHARDS)]
        futures: list[list[Future[PutResult]]] = [[] for _ in writers]
        for n in range(10):
            for i, w in enumerate(writers):
                batch = make_batch(harness.spec, n * 3, 3, partition=i)
                futures[i].append(w.put(batch, source(n * 3, 3, partition=i)))
        last = [
            w.put(make_batch(harness.spec, 30, 1, partition=i), source(30, 1, partition=i))
            for i, w in enumerate(writers)
        ]
        for w in writers:
            w.close(flush=False)  # writes the buffered puts before returning
        for i, w in enumerate(writers):
            results = [f.result(0) for f in [*futures[i], last[i]]]
            positions = [r.position for r in results]
            assert positions == sorted(positions)
            assert len(set(positions)) < len(positions)  # group commit
            assert w.stats().wal_entries_total == len(set(positions))
            assert w.durable_offsets[("t", i)] == 30
    finally:
        scheduler.close()


def test_engine_close_stops_the_wal_workers(tmp_path: Path) -> None:
    """The engine's scheduler runs its shards (workers and timer start with the first) and
    stops with `Engine.close`, after the writers wrote what they buffered."""
    others = set(threading.enumerate())  # e.g. the default scheduler of other tests
    engine = Engine.from_settings(settings(str(tmp_path / "t.lance")))
    writers = [engine.open_shard(TOPIC, p) for p in range(8)]
    futures = [
        w.put(make_batch(engine.spec, 0, 5, topic=TOPIC, partition=p), source(0, 5, TOPIC, p))
        for p, w in enumerate(writers)
    ]
    assert all(f.result(30).rows == 5 for f in futures)
    assert engine.wal_scheduler.registered == 8
    threads = [t for t in set(threading.enumerate()) - others if t.name.startswith("wal_")]
    assert len(threads) == engine.wal_scheduler.workers + 1  # the workers and the timer
    engine.close(timeout=10)
    assert engine.wal_scheduler.registered == 0
    assert not any(t.is_alive() for t in threads)
    assert all(w.durable_offsets[(TOPIC, p)] == 4 for p, w in enumerate(writers))


def count_probes(writers: list[ShardWriter]) -> dict[str, int]:
    """How often each writer's manifest is probed for a fence from now on, by shard."""
    counts = {w.shard: 0 for w in writers}
    for w in writers:
        superseded = w.manifests.superseded

        def probe(current: ShardManifest, shard: str = w.shard, inner: Any = superseded) -> bool:
            counts[shard] += 1
            return bool(inner(current))

        w.manifests.superseded = probe  # type: ignore[method-assign]
    return counts


def test_idle_fence_probes_are_paced_for_the_process_not_per_shard(
    local_harness: MakeHarness,
) -> None:
    """32 idle shards asking for a probe every 0.5 s (64 a second: one per shard per
    period, as before issue #39's pacing) on a lane paced to 16 a second: at most 16 a
    second happen (plus one batch: the lane takes them in bursts of `PROBE_BATCH_S` of
    its rate), and still every shard is probed within shards / rate (2 s)."""
    rate, shards = 16, 32
    scheduler = WalScheduler(2, fence_probes_per_s=rate)
    harness = local_harness(config=writer_config(fence_check_interval_s=0.5))
    try:
        writers = [harness.open(shard=f"t-{i}-test", scheduler=scheduler) for i in range(shards)]
        counts = count_probes(writers)
        started = time.monotonic()
        time.sleep(1.0)
        before = sum(counts.values())
        time.sleep(2.0)
        probed = sum(counts.values()) - before
        burst = max(1, int(rate * PROBE_BATCH_S))
        assert probed <= rate * (time.monotonic() - started - 1.0) + burst, probed
        assert all(n >= 1 for n in counts.values()), counts
        for w in writers:
            w.close(flush=False)
    finally:
        scheduler.close()


def test_the_probe_lane_takes_due_probes_in_batches() -> None:
    """Many idle shards all due: the lane runs its 64 probes a second in a few wakes (a
    batch of `PROBE_BATCH_S` of its rate each), not one wake per probe (which cost the
    idle process ~0.02 of a core at 1,024 shards), at the same rate."""
    rate = 64
    scheduler = WalScheduler(2, fence_probes_per_s=rate)
    probed = threading.Semaphore(0)
    try:
        for i in range(256):
            scheduler.register(f"s{i}", lambda: None, probe=probed.release, probe_interval=0.1)
        time.sleep(0.3)
        probes, batches = scheduler.probes_total, scheduler.probe_batches_total
        started = time.monotonic()
        time.sleep(1.0)
        elapsed = time.monotonic() - started
        probes = scheduler.probes_total - probes
        batches = scheduler.probe_batches_total - batches
        burst = int(rate * PROBE_BATCH_S)
        assert rate * elapsed - 2 * burst <= probes <= rate * elapsed + burst, probes
        assert batches <= elapsed / PROBE_BATCH_S + 2, (batches, probes)
    finally:
        scheduler.close()


def test_a_fenced_idle_writer_learns_it_within_the_paced_bound(
    local_harness: MakeHarness,
) -> None:
    """The bound the pacing promises (`wal.fence_probes_per_s`): an idle writer among
    many learns of a newer writer within max(interval, shards / rate) (here 17 / 8 s),
    plus a probe, and its reads then fail with Fenced."""
    scheduler = WalScheduler(2, fence_probes_per_s=8)
    harness = local_harness(config=writer_config(fence_check_interval_s=0.5))
    try:
        writers = [harness.open(shard=f"t-{i}-test", scheduler=scheduler) for i in range(16)]
        newer = harness.open(shard="t-3-test", scheduler=scheduler)
        fenced_at = time.monotonic()
        old = writers[3]
        while old.poisoned is None:
            assert time.monotonic() - fenced_at < 17 / 8 + 1.0, "the fence went unnoticed"
            time.sleep(0.02)
        with pytest.raises(Fenced):
            old.view()
        assert all(w.poisoned is None for w in writers if w is not old)
        for w in [*writers, newer]:
            w.close(flush=False)
    finally:
        scheduler.close()


def test_an_unregistered_shard_is_not_kept_by_its_pending_probe() -> None:
    # The probe lane keeps a closed shard's entry until it is due (an idle shard's probe is
    # minutes away); through its step and probe the entry kept the closed shard writer and
    # its memtables alive that long (after a rebalance, every revoked shard's).
    class Shard:
        def step(self) -> None:
            return None

        def probe(self) -> None:
            pass

    scheduler = WalScheduler(workers=1, fence_probes_per_s=10)
    try:
        shard = Shard()
        handle = scheduler.register("t-0", shard.step, probe=shard.probe, probe_interval=300)
        gone = weakref.ref(shard)
        scheduler.unregister(handle)
        del shard
        gc.collect()
        assert gone() is None
        other = Shard()
        probe = scheduler.add_probe("board", other.probe, 300)
        gone = weakref.ref(other)
        scheduler.remove_probe(probe)
        del other
        gc.collect()
        assert gone() is None
    finally:
        scheduler.close()
