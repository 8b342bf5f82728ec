"""Shard ids: the name of the shard a topic-partition feeds into a table, and the names older
versions gave it.

A shard id names the shard's WAL and manifest in the WAL storage, so it must be stable across
processes and versions: a new owner finds its predecessor's state only under the same id.
`Engine.shard_id` picks the id a writer opens with (the current one, a legacy id whose
state is still in the WAL, or the id the table had at its old location: `moved_shard_ids`).
"""

from __future__ import annotations

import hashlib
import re

from engine.manifest import ManifestStore
from engine.storage import Storage, canonical_uri, uri_spellings


def shard_id(table_uri: str, topic: str, partition: int) -> str:
    """The shard of a topic-partition feeding a table: deterministic and readable.

    The table is identified by its location, `canonical_uri(table_uri)`, so every spelling
    of it (relative or absolute, trailing slash, file://, doubled slashes in an object-store
    key) names the same shard. For a URI already canonical (an absolute path without a
    trailing slash, ``s3://bucket/key`` without empty segments) the id is the one older
    versions gave it; for others see `legacy_shard_ids`.
    """
    return _digest_id(canonical_uri(table_uri), topic, partition)


def legacy_shard_ids(
    table_uri: str, topic: str, partition: int, *, spellings: bool = False
) -> list[str]:
    """Ids older versions gave this shard (they hashed `table.uri` exactly as written), in
    the order to look for their state: the URI as written, then, with `spellings`, every
    other common spelling of the same location (`uri_spellings`). Only ids that differ
    from `shard_id` are listed.

    `spellings` is safe only where the WAL storage is the table's own (the default
    `<table.uri>/_lance_sink`): shard state found there belongs to this table whatever
    spelling named it, while a WAL storage shared by several tables could hold another
    table's shard under a relative spelling that happens to match.
    """
    canonical = canonical_uri(table_uri)
    current = _digest_id(canonical, topic, partition)
    candidates = [table_uri, *(uri_spellings(canonical) if spellings else [])]
    out: list[str] = []
    for uri in candidates:
        legacy = _digest_id(uri, topic, partition)
        if legacy != current and legacy not in out:
            out.append(legacy)
    return out


class ShardFolders:
    """The shard folders at the root of a WAL storage, by the topic-partition their name
    says (`<topic>-<partition>-` and 12 hex digits): one listing of the root, looked up by
    every open that searches for a moved id (`moved_shard_ids`)."""

    _NAME = re.compile(r"(.+)-([0-9]+)-[0-9a-f]{12}")

    def __init__(self, folders: list[str]) -> None:
        #: Every folder at the root (shards of any table, whatever their ids).
        self.names = frozenset(folders)
        self.by_partition: dict[tuple[str, int], list[str]] = {}
        for folder in folders:
            match = self._NAME.fullmatch(folder)
            if match is not None:
                key = (match.group(1), int(match.group(2)))
                self.by_partition.setdefault(key, []).append(folder)

    @classmethod
    def listed(cls, storage: Storage) -> ShardFolders:
        """One listing of the storage root."""
        return cls(storage.folders(""))

    def named_like(self, topic: str, partition: int) -> list[str]:
        """The folders named like an id of `topic`-`partition`, sorted."""
        return sorted(self.by_partition.get((_safe_topic(topic), partition), ()))


def moved_shard_ids(
    storage: Storage,
    topic: str,
    partition: int,
    current: str,
    folders: ShardFolders | None = None,
) -> list[str]:
    """Shards of this topic-partition in `storage` under another id than `current`: what a
    table moved (or copied) with its WAL storage left under the ids of its old location.

    A candidate's folder is named like an id of the topic-partition (`<topic>-<partition>-`
    and 12 hex digits, whatever the table) and has a manifest whose recorded origin names the
    same topic and partition; a manifest of an earlier build, which records no origin, is
    taken on its folder name alone. Safe only where the WAL storage is the table's own (see
    `legacy_shard_ids`): in a shared one these are other tables' shards.

    Costs one listing of the storage root (none with `folders`, a listing taken earlier:
    see `Engine.shard_id` for why one listing serves many opens), and a listing and a read
    per candidate folder.
    """
    if folders is None:
        folders = ShardFolders.listed(storage)
    out = []
    for folder in folders.named_like(topic, partition):
        if folder == current:
            continue
        manifest = ManifestStore(storage, folder).latest()
        origin = manifest.origin
        if manifest.version and (
            origin is None or (origin.topic, origin.partition) == (topic, partition)
        ):
            out.append(folder)
    return out


def _safe_topic(topic: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in topic)[:80]


def _digest_id(uri: str, topic: str, partition: int) -> str:
    digest = hashlib.sha256(f"{uri}\0{topic}\0{partition}".encode()).hexdigest()[:12]
    return f"{_safe_topic(topic)}-{partition}-{digest}"
