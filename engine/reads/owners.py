"""Who holds which shard's memtables, read from the shard manifests (routing for fan-out).

A shard writer records where it serves queries (`ShardManifest.owner_url`, its
`query.advertised_url`) in the manifest version that claims the shard, so the newest
manifest of every shard names its owner and the owner's epoch: no extra service, and
correct across rebalances (a new owner's claim is a newer manifest version with a higher
epoch). A process that answers for a shard with another epoch than the one listed here
is recognised by it: an older epoch is a fenced owner, a newer one means this list is
stale.

A copy that lists a shard at an old epoch is safe to route by: the listed owner refuses the
shard (or is the zombie DESIGN.md names), so the query says `partial`. A copy that does not
list a shard at all is not: that shard's fresh rows would be in no answer and named in no
`missing`. So a query passes `need`, the shards it must route (every partition of the
topics the sink consumes, less those it reads itself); a copy that lacks one of them is
not used: the query reads the manifests itself, or waits for a read that started after it
asked. A shard still unlisted then was not claimed when the query asked, so it holds no
committed row the query must return.

Lifecycle: one `ShardOwners` per reader, shared by every query thread. The first
`current()` reads the manifests; later, a copy older than `refresh_s` is re-read on a
short-lived daemon thread while queries keep using it (on S3 a whole read is one LIST per
shard plus one GET, `OWNER_READ_WORKERS` shards at a time: no query waits for it; between
whole reads, every `FULL_READ_S`, such a re-read lists the claim board and reads only the
shards claimed since), a copy marked stale (`saw_epoch` with an epoch it does not list)
is re-read whole by the query that finds it, since its routing is wrong now, and a copy
that lacks a needed shard is re-read whole as above. Nothing to close.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from dataclasses import dataclass

import structlog

from engine.claim_board import ClaimBoard
from engine.manifest import ShardManifest, list_owners, read_manifests
from engine.storage import Storage

log = structlog.get_logger("lance_sink.reader")

#: How often an old copy is re-read whole; between, the re-read lists the claim board and
#: reads the manifests of the shards claimed since (`engine.claim_board`). A whole read is a
#: LIST and a GET per shard: at 1,024 shards on S3, 2,049 requests (~7 s at 50 ms), which
#: a pod answering queries repeated every `refresh_s` (~280 requests a second). What the
#: board does not show (a release, an older build's claim) waits for the next whole read,
#: or for the query that finds the copy wrong (`saw_epoch`), whichever comes first.
FULL_READ_S = 60.0


@dataclass(frozen=True, slots=True)
class Owner:
    """The writer of a shard as its newest manifest names it."""

    shard: str
    #: Where the writer serves its memtables; "" when it advertised none (unadvertised).
    url: str
    epoch: int
    #: The shard's "topic:partition"s: those it has flushed rows of, and the one its
    #: manifest records as its origin (empty for a writer of an earlier build that never
    #: flushed).
    partitions: tuple[str, ...] = ()
    #: The writer closed with every row in the Lance table (`ShardManifest.released`):
    #: no process holds fresh rows of the shard until the next claim.
    released: bool = False


class ShardOwners:
    """The owners of every shard under a WAL storage root, cached."""

    def __init__(
        self, storage: Storage, refresh_s: float, full_read_s: float = FULL_READ_S
    ) -> None:
        self.storage = storage
        self.refresh_s = refresh_s
        self.full_read_s = full_read_s
        #: The claim board since the last whole read, and when that read began.
        self._board: ClaimBoard | None = None
        self._whole_at = 0.0
        #: Shards whose listed owner did not answer: read again at the next re-read.
        self._rechecks: set[str] = set()
        self._owners: dict[str, Owner] | None = None
        self._read_at = 0.0  # when the read of the copy started
        self._stale = False
        self._lock = threading.Lock()
        self._reading = threading.Lock()  # the background or stale re-read
        self._fresh_read = threading.Lock()  # reads for a `need` the copy lacks

    def current(self, need: Collection[str] | None = ()) -> dict[str, Owner]:
        """The owner of every shard as its newest manifest names it (URL "" when it
        advertised none), by shard, from a copy that lists every shard of `need` or was
        read after this call began (`need` None: which shards are needed is unknown, so the
        latter).

        Raises:
            PersistenceError: the first read of the manifests failed, or the read for a
                shard of `need` the copy lacks did (other failures keep the old copy,
                logged).
        """
        asked = time.monotonic()
        with self._lock:
            owners, fresh = self._owners, not self._stale
            due = asked - self._read_at >= self.refresh_s
            lacking = owners is not None and (need is None or any(s not in owners for s in need))
        if lacking:
            return self._read_after(asked)
        if owners is not None and fresh and not due:
            return owners
        if owners is not None and not self._reading.acquire(blocking=False):
            return owners  # another thread is reading them
        if owners is None:
            self._reading.acquire()
        elif fresh:  # only old: read in the background, keep routing by this copy
            threading.Thread(
                target=self._read_and_release,
                args=(owners,),
                kwargs={"claims_only": True},
                name="shard-owners",
                daemon=True,
            ).start()
            return owners
        return self._read_and_release(owners)

    def _read_after(self, asked: float) -> dict[str, Owner]:
        """A copy whose read started at or after `asked`: one read at a time, and a query
        that waited for another query's read uses it when it started late enough."""
        with self._fresh_read:
            with self._lock:
                if self._owners is not None and self._read_at >= asked:
                    return self._owners
            return self._read(None)  # a failed read raises: the copy lacks a shard

    def _read_and_release(
        self, old: dict[str, Owner] | None, *, claims_only: bool = False
    ) -> dict[str, Owner]:
        try:
            return self._read(old, claims_only=claims_only)
        finally:
            self._reading.release()

    def _read(self, old: dict[str, Owner] | None, *, claims_only: bool = False) -> dict[str, Owner]:
        """Read the owners: every manifest, or with `claims_only` (a copy that is only old)
        and a whole read less than `full_read_s` ago, those of the shards claimed since."""
        started = time.monotonic()
        board = self._board
        try:
            if (
                claims_only
                and old is not None
                and board is not None
                and started - self._whole_at < self.full_read_s
            ):
                changed = self._read_claimed(board)
                with self._lock:
                    # Onto the newest copy (a whole read may have ended meanwhile), a shard's
                    # manifest as read now unless the copy lists a newer epoch; with nothing
                    # claimed since (most re-reads), the copy stays as it is.
                    owners = self._owners if self._owners is not None else old
                    if changed:
                        owners = dict(owners)
                        for shard, owner in changed.items():
                            listed = owners.get(shard)
                            if listed is None or owner.epoch >= listed.epoch:
                                owners[shard] = owner
                    self._owners = owners
                    self._read_at = max(self._read_at, started)
                    return owners
            owners = self._read_whole()
        except Exception as exc:
            if old is None:
                raise
            log.warning("shard_owners_read_failed", error=str(exc))
            return old
        with self._lock:
            if started >= self._read_at:  # a read that started earlier never wins
                self._owners = owners
                self._read_at, self._stale = started, False
            return self._owners if self._owners is not None else owners

    def _read_whole(self) -> dict[str, Owner]:
        """Every shard's newest manifest; the claim board's window starts with it (what was
        posted before is in this read, up to the board's skew)."""
        started = time.monotonic()
        board = ClaimBoard(self.storage, collect=False)
        board.claimed()
        with self._lock:
            self._rechecks.clear()  # read now with every other shard
        manifests = list_owners(self.storage)
        with self._lock:
            self._board, self._whole_at = board, started
        return {shard: owner_of(shard, m) for shard, m in manifests.items()}

    def _read_claimed(self, board: ClaimBoard) -> dict[str, Owner]:
        """The owners of the shards the board shows claimed since and of those `recheck`
        named, read now."""
        with self._lock:
            rechecks, self._rechecks = self._rechecks, set()
        shards = sorted(rechecks | {marker.shard for marker in board.claimed()})
        manifests = read_manifests(self.storage, shards)
        return {shard: owner_of(shard, manifest) for shard, manifest in manifests.items()}

    def recheck(self, shards: Collection[str]) -> None:
        """The owner listed for `shards` did not answer (gone, or slow): the next re-read
        reads their manifests too (a pod that drained released them; a new owner's claim
        the board did not show is found)."""
        with self._lock:
            self._rechecks.update(shards)

    def saw_epoch(self, shard: str, epoch: int) -> None:
        """A process answered for `shard` at `epoch`: re-read the owners at the next
        `current()` if that is not the epoch listed."""
        with self._lock:
            listed = None if self._owners is None else self._owners.get(shard)
            if listed is None or listed.epoch != epoch:
                self._stale = True


def owner_of(shard: str, manifest: ShardManifest) -> Owner:
    """The owner `manifest` (the shard's newest) names."""
    partitions = set(manifest.flushed_offsets)
    if manifest.origin is not None:
        partitions.add(f"{manifest.origin.topic}:{manifest.origin.partition}")
    return Owner(
        shard,
        manifest.owner_url,
        manifest.epoch,
        tuple(sorted(partitions)),
        released=manifest.released,
    )
