"""The claim board: which shards were claimed lately, in one listing of the WAL storage.

An idle writer learns that a newer writer claimed its shard (it was fenced, I5) only by
looking; a busy one finds the fence at its next WAL append. Looking shard by shard is a
LIST of each shard's manifest: on S3, at the probe lane's default rate, 64 requests a
second (~5.5 million a day per pod) and ~0.4 ms of CPU each, whether or not anything
flows (issue #39). The board makes it one listing per interval for all the shards of a
WAL storage.

Lifecycle:

- `post(storage, shard, epoch)`: `ManifestStore.claim`, once the claim's manifest version
  is written, puts an empty marker `_claims/<wall-clock ms, 13 digits>-<epoch, 10
  digits>-<shard>`. Best effort: a post that fails is logged, and the shard's own idle
  probe still finds the claim (below).
- `ClaimBoard.claimed()`: the engine's sweep (`Engine`, on the scheduler's probe lane,
  every `max(fence_check_interval, IDLE_WAKE_S)`) lists the markers from `SKEW_S` before its
  previous sweep on (a claimer's clock may be behind ours) and returns each marker not
  reported before. The engine probes the manifest of every writer of its own that a
  marker names with a newer epoch (the probe poisons it: `Fenced`), and a writer that was
  still opening when its marker was reported asks `newest_epoch` once it is listed.
- Every `COLLECT_S` a sweep also deletes the markers older than `RETAIN_S`, in bulk.
- Readers of the owners (`engine.reads.owners.ShardOwners`) sweep a board of their own
  between whole reads of the manifests and re-read only the shards claimed since.

The shards' own idle probes stay, as the safety net for claims the board does not show:
an older build's claim posts no marker, a post failed, a claimer's clock ran more than
`SKEW_S` behind. With the board an engine probes each idle shard every `SAFETY_PROBE_S`
(and within `wal.fence_probes_per_s`) instead of every interval.

The folder is `_claims` at the WAL storage root: no shard id is spelled like it (ids end
in `-<partition>-<12 hex digits>`), so root listings that look for shards pass it by.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from engine.storage import AlreadyExists, Storage

log = structlog.get_logger("lance_sink.engine")

#: The board's folder at the WAL storage root.
BOARD = "_claims"
#: How far before its previous sweep a sweep lists: claimers' wall clocks may lag this
#: process's (NTP keeps pods within milliseconds; two minutes is for a badly kept host).
#: Markers of the last `SKEW_S` are listed again at every sweep and skipped as seen.
SKEW_S = 120.0
#: Markers older than this are deleted: far longer than `SKEW_S`, so a sweep never misses
#: one because it was collected.
RETAIN_S = 3600.0
#: How often a sweep lists the whole board to collect the old markers (one listing of the
#: claims of the last `RETAIN_S` plus a bulk delete; every process of a deployment does it).
COLLECT_S = 600.0
#: With the board, how often an engine probes each idle shard itself (the safety net for
#: claims the board does not show). At the default probe rate, 1,024 idle shards then cost
#: ~3.4 LISTs a second instead of 64.
SAFETY_PROBE_S = 300.0


@dataclass(frozen=True, slots=True)
class Marker:
    """One claim on the board."""

    ms: int  # the claimer's wall clock, ms since the epoch
    epoch: int
    shard: str


def marker_key(shard: str, epoch: int, ms: int) -> str:
    return f"{BOARD}/{ms:013d}-{epoch:010d}-{shard}"


def parse_marker(key: str) -> Marker | None:
    """The marker a key of the board names, or None for anything else."""
    name = key.rsplit("/", 1)[-1]
    parts = name.split("-", 2)
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or not parts[2]:
        return None
    return Marker(int(parts[0]), int(parts[1]), parts[2])


def post(storage: Storage, shard: str, epoch: int, clock: Callable[[], float] = time.time) -> None:
    """Put the marker of a claim (best effort, see the module docstring)."""
    key = marker_key(shard, epoch, int(clock() * 1000))
    try:
        storage.put_if_absent(key, b"", durable=False)  # a hint: the probes are the net
    except AlreadyExists:
        pass  # the same claim posted twice in one millisecond
    except Exception as exc:  # noqa: BLE001 - the shards' own probes find the claim
        log.warning("claim_post_failed", shard=shard, epoch=epoch, error=str(exc))


class ClaimBoard:
    """The sweeps of one WAL storage's board by one engine or one owners reader, one
    thread at a time (the probe lane never runs a probe twice at once; `ShardOwners`
    re-reads one at a time)."""

    def __init__(
        self, storage: Storage, clock: Callable[[], float] = time.time, *, collect: bool = True
    ) -> None:
        self.storage = storage
        self.clock = clock
        #: Whether sweeps delete old markers (writers do; readers, which may not be allowed
        #: to delete, leave it to them).
        self.collect = collect
        self._last_sweep: float | None = None
        #: Markers reported, by key (those before the listed window go).
        self._seen: dict[str, Marker] = {}
        #: The newest epoch the markers of `_seen` name, by shard (`newest_epoch`).
        self._newest: dict[str, int] = {}
        self._collected_at = float("-inf")
        #: Sweeps and markers collected: the tests and the bench read them.
        self.sweeps = 0
        self.collected = 0

    def claimed(self) -> list[Marker]:
        """The markers posted since the previous sweep (from `SKEW_S` before it; the first
        sweep from `SKEW_S` ago), each reported once."""
        now = self.clock()
        since = (self._last_sweep if self._last_sweep is not None else now) - SKEW_S
        floor = int(since * 1000)
        keys = self.storage.list_after(BOARD, marker_key("", 0, floor))
        self._last_sweep = now
        self.sweeps += 1
        new = []
        for key in keys:
            marker = parse_marker(key)
            if marker is None or key in self._seen:
                continue
            self._seen[key] = marker
            new.append(marker)
        self._seen = {k: m for k, m in self._seen.items() if m.ms >= floor}
        newest: dict[str, int] = {}
        for m in self._seen.values():
            newest[m.shard] = max(m.epoch, newest.get(m.shard, 0))
        self._newest = newest  # one reference swap: `newest_epoch` reads it from any thread
        if self.collect and now - self._collected_at >= COLLECT_S:
            self._collected_at = now
            self._collect(now)
        return new

    def newest_epoch(self, shard: str) -> int | None:
        """The newest epoch of `shard` that recent sweeps saw claimed (the last `SKEW_S` or
        more), if any. `Engine.open_shard` asks it once its writer is listed: a claim a sweep
        reported while that writer was still opening named no writer of the engine then."""
        return self._newest.get(shard)

    def _collect(self, now: float) -> None:
        """Delete the markers older than `RETAIN_S` (best effort)."""
        cutoff = int((now - RETAIN_S) * 1000)
        try:
            old = [
                key
                for key in self.storage.list_after(BOARD, None)
                if (m := parse_marker(key)) is not None and m.ms < cutoff
            ]
            self.storage.delete_many(old)
        except Exception as exc:  # noqa: BLE001 - collected at the next round
            log.warning("claim_collect_failed", error=str(exc))
            return
        self.collected += len(old)
