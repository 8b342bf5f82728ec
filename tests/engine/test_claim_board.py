"""The claim board (`engine.claim_board`): an engine's idle writers learn of another
process's claim from one listing of the WAL storage per sweep, not from a LIST of each
shard's manifest; a claim the board does not show is still found by the writers' own
(rare) probes; old markers are collected."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine.backpressure import BlockingValve
from engine.claim_board import (
    BOARD,
    COLLECT_S,
    RETAIN_S,
    SKEW_S,
    ClaimBoard,
    marker_key,
    parse_marker,
    post,
)
from engine.engine import Engine
from engine.errors import Fenced
from engine.manifest import ManifestStore
from engine.shard import ShardWriter
from engine.storage import LocalStorage, Storage, open_storage
from tests.engine.conftest import Storage as Location
from tests.support.engine import make_spec, writer_config
from tests.support.storage import RecordingStorage

pytestmark = pytest.mark.timeout(120)

#: The writers' fence check interval in these tests: sweeps run every IDLE_WAKE_S (0.5 s).
CHECK_S = 0.2


def engine_on(location: Location, storage: Storage | None = None, **kwargs: Any) -> Engine:
    table, wal, options = location
    extra = {"storage_options": options} if options else {}
    return Engine(
        make_spec(table, **extra),
        storage or open_storage(wal, options),
        writer_config(fence_check_interval_s=CHECK_S),
        BlockingValve(1 << 40),
        **kwargs,
    )


def wait_fenced(writer: ShardWriter, within_s: float) -> float:
    """Seconds until the writer's reads raise `Fenced` (fails after `within_s`)."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        try:
            writer.view()
        except Fenced:
            return time.monotonic() - started
        time.sleep(0.05)
    pytest.fail(f"the idle writer of {writer.shard} was not fenced within {within_s} s")


def test_idle_shards_cost_one_listing_a_sweep(tmp_path: Path) -> None:
    # 32 idle shards, each probing itself every 0.5 s, listed 64 manifests a second (the
    # lane's whole rate); with the board the engine lists the board once a sweep.
    location = (str(tmp_path / "t.lance"), str(tmp_path / "wal"), None)
    storage = RecordingStorage(LocalStorage(tmp_path / "wal"))
    engine = engine_on(location, storage)  # type: ignore[arg-type]
    try:
        for partition in range(32):
            engine.open_shard("t", partition)
        time.sleep(1.0)  # the first sweep (and its collection) is behind us
        before, sweeps = len(storage.listings), engine.claims.sweeps
        time.sleep(2.0)
        listings = len(storage.listings) - before
        assert engine.claims.sweeps - sweeps >= 3  # a sweep every 0.5 s
        assert listings <= engine.claims.sweeps - sweeps + 1, listings
    finally:
        engine.close(flush=False)


def test_an_idle_writer_learns_of_another_claim_from_the_board(any_storage: Location) -> None:
    first = engine_on(any_storage)
    second = engine_on(any_storage)
    try:
        idle = first.open_shard("t", 0)
        second.open_shard("t", 0)  # another process's claim of the same shard
        # The writer probes itself only every SAFETY_PROBE_S (300 s): the board told it.
        assert wait_fenced(idle, within_s=10) < 10
        assert first.claims.sweeps >= 1
    finally:
        second.close(flush=False)
        first.close(flush=False)


def test_a_claim_swept_while_the_writer_opened_still_fences_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process claims the shard, and this engine's sweep reports that claim, after
    # the writer claimed but before the engine lists it: no writer was there to probe.
    location = (str(tmp_path / "t.lance"), str(tmp_path / "wal"), None)
    first, second = engine_on(location), engine_on(location)
    real_open = ShardWriter.open

    def open_then_claimed_elsewhere(*args: Any, **kwargs: Any) -> ShardWriter:
        writer = real_open(*args, **kwargs)
        monkeypatch.setattr("engine.engine.ShardWriter.open", real_open)
        second.open_shard("t", 0)
        first._sweep_claims()
        return writer

    monkeypatch.setattr("engine.engine.ShardWriter.open", open_then_claimed_elsewhere)
    try:
        idle = first.open_shard("t", 0)
        assert first.claims.newest_epoch(idle.shard) == idle.epoch + 1
        assert idle.poisoned is not None  # fenced before open_shard returned
        with pytest.raises(Fenced):
            idle.view()
    finally:
        second.close(flush=False)
        first.close(flush=False)


def test_a_claim_the_board_does_not_show_is_found_by_the_writers_own_probe(
    tmp_path: Path,
) -> None:
    # An older build claims without posting a marker: the writer's own idle probe (every
    # safety_probe_s) still finds the newer manifest version.
    location = (str(tmp_path / "t.lance"), str(tmp_path / "wal"), None)
    engine = engine_on(location, safety_probe_s=1.0)
    try:
        idle = engine.open_shard("t", 0)
        manifests = ManifestStore(engine.storage, idle.shard)
        current = manifests.latest()
        newer = replace(current, version=current.version + 1, epoch=current.epoch + 1)
        engine.storage.put_if_absent(manifests.key(newer.version), newer.encode())
        markers = [parse_marker(k) for k in engine.storage.list_after(BOARD, None)]
        assert [m.epoch for m in markers if m] == [current.epoch]  # the engine's own claim
        wait_fenced(idle, within_s=10)
    finally:
        engine.close(flush=False)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_sweep_reports_each_claim_once_from_before_its_last_sweep(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "wal")
    clock = Clock(1_000_000.0)
    board = ClaimBoard(storage, clock)
    post(storage, "t-0-aaaaaaaaaaaa", 3, clock=lambda: clock.now - SKEW_S - 1)  # too old
    post(storage, "t-1-aaaaaaaaaaaa", 2, clock=lambda: clock.now - 10)
    assert [(m.shard, m.epoch) for m in board.claimed()] == [("t-1-aaaaaaaaaaaa", 2)]

    clock.now += 1
    # Posted after that sweep by a process whose clock is 30 s behind ours, and another.
    post(storage, "t-2-aaaaaaaaaaaa", 5, clock=lambda: clock.now - 30)
    post(storage, "t-3-aaaaaaaaaaaa", 1, clock=lambda: clock.now)
    claimed = board.claimed()
    assert sorted((m.shard, m.epoch) for m in claimed) == [
        ("t-2-aaaaaaaaaaaa", 5),
        ("t-3-aaaaaaaaaaaa", 1),
    ]
    clock.now += 1
    assert board.claimed() == []


def test_old_markers_are_collected(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "wal")
    clock = Clock(1_000_000.0)
    post(storage, "t-0-aaaaaaaaaaaa", 1, clock=lambda: clock.now - RETAIN_S - 5)
    post(storage, "t-1-aaaaaaaaaaaa", 1, clock=lambda: clock.now - RETAIN_S + 5)
    board = ClaimBoard(storage, clock)
    board.claimed()
    left = [parse_marker(k) for k in storage.list_after(BOARD, None)]
    assert [m.shard for m in left if m] == ["t-1-aaaaaaaaaaaa"]
    assert board.collected == 1

    clock.now += 10  # the other marker is old now, but the next collection is COLLECT_S on
    board.claimed()
    assert board.collected == 1
    clock.now += COLLECT_S
    board.claimed()
    assert board.collected == 2
    assert storage.list_after(BOARD, None) == []


@pytest.mark.parametrize("shard", ["t-0-939ed7d166a8", "events-v1--3-0-64fcce509283"])
def test_a_marker_names_its_shard_epoch_and_time(shard: str) -> None:
    marker = parse_marker(marker_key(shard, 7, 1_765_000_000_123))
    assert marker is not None
    assert (marker.shard, marker.epoch, marker.ms) == (shard, 7, 1_765_000_000_123)
    assert parse_marker(f"{BOARD}/not-a-marker") is None
    assert parse_marker(f"{BOARD}/123-456") is None


def test_a_marker_is_not_synced_to_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A marker is a hint (the shards' own probes find a claim whose marker a crash lost);
    # its file and folder syncs were two of the six fsyncs of every shard's open.
    storage = LocalStorage(tmp_path)
    synced: list[int] = []
    fsync = os.fsync

    def counted(fd: int) -> None:
        synced.append(fd)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", counted)
    post(storage, "t-0-abc", 3)
    assert synced == []
    markers = [parse_marker(key) for key in storage.list(BOARD)]
    assert [m.shard for m in markers if m is not None] == ["t-0-abc"]
    storage.put_if_absent("t-0-abc/wal/0", b"entry")  # what must survive a crash is synced
    assert synced
