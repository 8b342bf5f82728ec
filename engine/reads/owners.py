"""Who holds which shard's memtables, read from the shard manifests (routing for fan-out).

A shard writer records where it serves queries (`ShardManifest.owner_url`, its
`query.advertised_url`) in the manifest version that claims the shard, so the newest
manifest of every shard names its owner and the owner's epoch: no extra service, and
correct across rebalances (a new owner's claim is a newer manifest version with a higher
epoch). A process that answers for a shard with another epoch than the one listed here
is recognised by it: an older epoch is a fenced owner, a newer one means this list is
stale.

Lifecycle: one `ShardOwners` per reader, shared by every query thread. The first
`current()` reads the manifests; later, a copy older than `refresh_s` is re-read on a
short-lived daemon thread while queries keep using it (on S3 a read is one LIST per shard
plus one GET: no query waits for it), and a copy marked stale (`saw_epoch` with an epoch it
does not list) is re-read by the query that finds it, since its routing is wrong now. One
read at a time; the others use the copy they have. Nothing to close.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import structlog

from engine.manifest import list_owners
from engine.storage import Storage

log = structlog.get_logger("lance_sink.reader")


@dataclass(frozen=True, slots=True)
class Owner:
    """The writer of a shard as its newest manifest names it."""

    shard: str
    url: str
    epoch: int
    #: The "topic:partition"s the shard has flushed rows of (empty before its first flush).
    partitions: tuple[str, ...] = ()


class ShardOwners:
    """The owners of every shard under a WAL storage root, cached."""

    def __init__(self, storage: Storage, refresh_s: float) -> None:
        self.storage = storage
        self.refresh_s = refresh_s
        self._owners: dict[str, Owner] | None = None
        self._read_at = 0.0
        self._stale = False
        self._lock = threading.Lock()
        self._reading = threading.Lock()

    def current(self) -> dict[str, Owner]:
        """Every shard whose newest manifest names an owner URL, by shard.

        Raises:
            PersistenceError: the first read of the manifests failed (later failures keep
                the old copy, logged).
        """
        with self._lock:
            owners, fresh = self._owners, not self._stale
            due = time.monotonic() - self._read_at >= self.refresh_s
        if owners is not None and fresh and not due:
            return owners
        if owners is not None and not self._reading.acquire(blocking=False):
            return owners  # another thread is reading them
        if owners is None:
            self._reading.acquire()
        elif fresh:  # only old: read in the background, keep routing by this copy
            threading.Thread(
                target=self._read_and_release, args=(owners,), name="shard-owners", daemon=True
            ).start()
            return owners
        return self._read_and_release(owners)

    def _read_and_release(self, old: dict[str, Owner] | None) -> dict[str, Owner]:
        try:
            return self._read(old)
        finally:
            self._reading.release()

    def _read(self, old: dict[str, Owner] | None) -> dict[str, Owner]:
        started = time.monotonic()
        try:
            manifests = list_owners(self.storage)
        except Exception as exc:
            if old is None:
                raise
            log.warning("shard_owners_read_failed", error=str(exc))
            return old
        owners = {
            shard: Owner(shard, m.owner_url, m.epoch, tuple(sorted(m.flushed_offsets)))
            for shard, m in manifests.items()
            if m.owner_url
        }
        with self._lock:
            self._owners, self._read_at, self._stale = owners, started, False
        return owners

    def saw_epoch(self, shard: str, epoch: int) -> None:
        """A process answered for `shard` at `epoch`: re-read the owners at the next
        `current()` if that is not the epoch listed."""
        with self._lock:
            listed = None if self._owners is None else self._owners.get(shard)
            if listed is None or listed.epoch != epoch:
                self._stale = True
