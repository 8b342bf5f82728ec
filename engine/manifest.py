"""The shard manifest: writer epoch and flushed watermark, versioned by create-only puts.

    <shard>/manifest/<version:020d>.json

Each version is immutable. Since 2026-12 every version also records its shard's origin (the
table's canonical location, the topic and the partition: `ShardOrigin`), so a table moved
with its WAL storage finds the shards it had under its old location (`engine.shard_ids`);
versions written by earlier builds lack it and load with `origin=None`.

A writer claims the shard by writing version v+1 with epoch+1, then posts the claim on
the WAL storage's claim board (`engine.claim_board`: idle writers of other processes learn
of it from one listing); it records a flush by writing version v+1 with the same epoch.
Because every write is create-only at the next version, two writers can never both succeed
from the same version: the loser learns it was fenced (`Fenced`). Older versions are
deleted once two newer ones exist.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

from engine import claim_board
from engine.errors import Fenced, PersistenceError
from engine.storage import AlreadyExists, Storage

CLAIM_ATTEMPTS = 16
#: Shards whose manifests `list_owners` reads at once (two storage round trips each).
OWNER_READ_WORKERS = 16


@dataclass(frozen=True, slots=True)
class ShardOrigin:
    """Which topic-partition feeds which table through a shard.

    Attributes:
        table: the table's canonical location (`engine.storage.canonical_uri`) when the
            writer claimed the shard; after a move it is the new location.
        topic: the Kafka topic.
        partition: the Kafka partition.
    """

    table: str
    topic: str
    partition: int


@dataclass(frozen=True, slots=True)
class ShardManifest:
    """One version of a shard's manifest.

    Attributes:
        version: manifest version (0 = none written yet).
        epoch: the writer epoch that wrote it; the newest epoch owns the shard.
        flushed_position: every WAL entry at or below it is in the Lance table.
        flushed_offsets: last source offset in the Lance table per "topic:partition".
        lance_version: the table version of the last flush commit (0 = none); commits
            after it are searched for a flush that crashed before the manifest update.
        generation: the next memtable generation number.
        owner_url: where the writer of `epoch` serves its memtables to other pods (its
            `query.advertised_url`); empty when it advertised none.
        origin: the table, topic and partition of the shard, as the claiming writer knew
            them; None in versions written by earlier builds (or by a writer opened without
            one, as some tests do).
        released: written by a writer that closed with every row it held in the Lance
            table (a clean drain): no memtable holds fresh rows of the shard until the
            next claim, so fan-out asks nobody for it (and `owner_url` is empty).
    """

    version: int = 0
    epoch: int = 0
    flushed_position: int = 0
    flushed_offsets: dict[str, int] = field(default_factory=dict)
    lance_version: int = 0
    generation: int = 1
    owner_url: str = ""
    origin: ShardOrigin | None = None
    released: bool = False

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> ShardManifest:
        raw = json.loads(data)
        return cls(
            version=int(raw["version"]),
            epoch=int(raw["epoch"]),
            flushed_position=int(raw["flushed_position"]),
            flushed_offsets={str(k): int(v) for k, v in raw["flushed_offsets"].items()},
            lance_version=int(raw["lance_version"]),
            generation=int(raw["generation"]),
            owner_url=str(raw.get("owner_url", "")),  # absent before fan-out reads
            origin=_decode_origin(raw.get("origin")),  # absent before 2026-12
            released=bool(raw.get("released", False)),  # absent before 2026-12-05
        )


def _decode_origin(raw: object) -> ShardOrigin | None:
    if not isinstance(raw, dict):
        return None
    return ShardOrigin(
        table=str(raw["table"]), topic=str(raw["topic"]), partition=int(raw["partition"])
    )


class ManifestStore:
    """Reads and writes one shard's manifest versions."""

    def __init__(self, storage: Storage, shard: str) -> None:
        self.storage = storage
        self.shard = shard
        self.folder = f"{shard}/manifest"

    def key(self, version: int) -> str:
        return f"{self.folder}/{version:020d}.json"

    def latest(self) -> ShardManifest:
        """The newest manifest version, or an empty one for a new shard."""
        return self._latest_listed()[0]

    def _latest_listed(self) -> tuple[ShardManifest, list[int]]:
        """The newest manifest version and the versions the listing that found it saw."""
        versions = self._versions()
        if not versions:
            return ShardManifest(), versions
        # A version may be deleted by GC between list and get: fall back to re-listing.
        for _ in range(CLAIM_ATTEMPTS):
            try:
                return ShardManifest.decode(self.storage.get(self.key(versions[-1]))), versions
            except FileNotFoundError:
                versions = self._versions()
        raise PersistenceError("manifest kept vanishing while reading", shard=self.shard)

    def _versions(self) -> list[int]:
        out = []
        for key in self.storage.list(self.folder):
            name = key.rsplit("/", 1)[-1]
            if name.endswith(".json") and name[:-5].isdigit():
                out.append(int(name[:-5]))
        return sorted(out)

    def claim(self, owner_url: str = "", origin: ShardOrigin | None = None) -> ShardManifest:
        """Claim the shard with a new epoch (create-only write of the next version),
        recording where the new writer serves queries (`owner_url`) and, if given, the
        shard's `origin` (else the previous version's is kept); later versions of the epoch
        carry both.

        Raises:
            PersistenceError: lost the race `CLAIM_ATTEMPTS` times in a row.
        """
        for _ in range(CLAIM_ATTEMPTS):
            current, listed = self._latest_listed()
            claimed = replace(
                current,
                version=current.version + 1,
                epoch=current.epoch + 1,
                owner_url=owner_url,
                origin=origin or current.origin,
                released=False,
            )
            try:
                self.storage.put_if_absent(self.key(claimed.version), claimed.encode())
            except AlreadyExists:
                continue
            # Tell the other processes' idle writers of this shard at once (one listing of
            # the board each, not a LIST of every manifest: `engine.claim_board`).
            claim_board.post(self.storage, self.shard, claimed.epoch)
            # The listing that found `current` holds every older version: a version written
            # after it would have taken ours (the put above would have failed).
            self._delete_before(listed, claimed.version - 1)
            return claimed
        raise PersistenceError(
            "could not claim the shard: too many concurrent claims", shard=self.shard
        )

    def advance(
        self, current: ShardManifest, *, collect: bool = True, **changes: object
    ) -> ShardManifest:
        """Write the next version with `changes`, as the writer holding `current.epoch`;
        with `collect`, then delete the versions before the previous one (a listing and a
        delete: a flush leaves that to its WAL trim's thread, `collect`).

        Raises:
            Fenced: a newer version exists (another writer claimed the shard).
        """
        nxt = replace(current, version=current.version + 1, **changes)  # type: ignore[arg-type]
        try:
            self.storage.put_if_absent(self.key(nxt.version), nxt.encode())
        except AlreadyExists as exc:
            raise Fenced(
                "a newer writer claimed the shard", shard=self.shard, epoch=current.epoch
            ) from exc
        if collect:
            self.collect(nxt.version)
        return nxt

    def superseded(self, current: ShardManifest) -> bool:
        """True if a version after `current` exists, i.e. another writer claimed the shard.

        Lists rather than probing `current.version + 1`: that version may already have been
        garbage-collected by the newer writer.
        """
        return max(self._versions(), default=0) > current.version

    def collect(self, newest: int) -> None:
        """Delete versions older than the one before `newest` (best effort)."""
        self._delete_before(self._versions(), newest - 1)

    def _delete_before(self, versions: list[int], keep: int) -> None:
        for version in versions:
            if version < keep:
                self.storage.delete(self.key(version))


def list_owners(storage: Storage, workers: int = OWNER_READ_WORKERS) -> dict[str, ShardManifest]:
    """The newest manifest of every shard under the storage root, by shard.

    One folder listing plus, per shard, one listing and one read (the same as
    `ManifestStore.latest`), `workers` shards at a time: on S3 each is two round trips, and
    1,024 shards read one after another took ~100 s at 50 ms a request. Folders without
    manifest versions, and the claim board's, are not shards. A shard whose manifest
    vanished meanwhile (a concurrent claim collected it) is read again.

    Raises:
        PersistenceError: a manifest kept vanishing while it was read.
    """
    shards = [shard for shard in storage.folders("") if shard != claim_board.BOARD]
    return read_manifests(storage, shards, workers)


def read_manifests(
    storage: Storage, shards: list[str], workers: int = OWNER_READ_WORKERS
) -> dict[str, ShardManifest]:
    """The newest manifest of each of `shards` that has one, `workers` at a time (see
    `list_owners`)."""
    if not shards:
        return {}
    with ThreadPoolExecutor(min(workers, len(shards)), thread_name_prefix="shard-owners") as pool:
        manifests = list(pool.map(lambda shard: ManifestStore(storage, shard).latest(), shards))
    return {
        shard: manifest
        for shard, manifest in zip(shards, manifests, strict=True)
        if manifest.version
    }
