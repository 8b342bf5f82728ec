"""One query's consistent view: the fresh memtable tiers and one base version.

Taken in the order `ShardView.fresh` requires (`take`):

1. the views of every shard writer (active and frozen memtables, newest first) -- these
   hold only durable rows (I2: rows enter a memtable only after their WAL entry is durable);
2. then the base table at its latest version;
3. then `ShardView.fresh(base)`: memtables that base version already holds are skipped, so
   a row is never seen in both tiers and never in neither while it is being flushed.

Tiers are ordered newest first: per shard, the active memtable, then frozen ones newest
first; the base is last. For upsert tables the newest tier holding a key decides it, so a
base row whose key a fresh memtable holds is not shown (`Snapshot.base_hidden`), and the
base is asked for more rows while such rows leave fewer than k (`Snapshot.base_overfetch`).
Across shards there is no order (a key is expected in one topic-partition, which is what
Kafka's key partitioning gives); if a key does occur in two shards, the first shard in
`shards()` order wins, so a key still appears once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import structlog

from engine.errors import LanceSinkError
from engine.memtable import key_values
from engine.reads.remote import RemoteAnswer, RemoteTier
from engine.reads.tiers import MemtableTier
from engine.schema import TableSpec
from engine.shard import ShardWriter

log = structlog.get_logger("lance_sink.reader")

#: Base over-fetch when rows are hidden by newer memtable versions: start with k plus this
#: many, then grow 4x per round (bounded by `MAX_FETCH_ROUNDS`).
BASE_OVERFETCH = 16
MAX_FETCH_ROUNDS = 6


#: Per-query bounds of a Lance scan of the base (a flat kNN over fragments no index covers,
#: a text or filtered scan). Lance buffers up to 2 GiB of reads per scan and decodes 16
#: batches ahead by default: with the pool's queries scanning at once, the sink outgrew its
#: pod (bench/memory). 32 MiB and 4 batches ahead keep each scan's reads bounded.
SCAN_IO_BUFFER_BYTES = 32 << 20
SCAN_BATCH_READAHEAD = 4


@dataclass(frozen=True)
class Snapshot:
    """What one query reads: the fresh memtables (newest first) and one base version."""

    base: lance.LanceDataset
    tiers: tuple[MemtableTier, ...]
    spec: TableSpec
    #: Other pods' memtables (`engine.reads.remote`); None in local mode.
    remote: RemoteTier | None = None
    #: The highest `ShardView.dropped_through` of the views (see `take`).
    dropped_through: int = 0

    def local_hidden(self, keys: list[Any]) -> np.ndarray:
        """For each key: does a fresh memtable of this process decide it?"""
        upsert = [t for t in self.tiers if t.view.keys is not None]
        if not upsert:
            return np.zeros(len(keys), dtype=bool)
        return np.fromiter(
            (any(t.holds(k) for t in upsert) for k in keys), dtype=bool, count=len(keys)
        )

    def base_hidden(self, keys: list[Any]) -> np.ndarray:
        """For each key: does a fresh memtable (here or on another pod) decide it, so the
        base row is not shown?"""
        hidden = self.local_hidden(keys)
        if self.remote is not None and self.spec.upsert and not hidden.all():
            unknown = np.flatnonzero(~hidden)
            hidden[unknown] = self.remote.decides([keys[i] for i in unknown])
        return hidden

    def any_keys(self) -> bool:
        """May a fresh memtable decide some base rows' keys (upserts or deletes)?"""
        if not self.spec.upsert:
            return False
        return self.remote is not None or any(t.view.keys for t in self.tiers)

    def remote_rows(self, answers: list[RemoteAnswer]) -> list[pa.Table]:
        """The rows of the owner pods' answers, less keys a memtable of this process decides
        (a key in two shards: the first shard holding it wins, this process's first)."""
        out = []
        for answer in answers:
            table = answer.table
            if table.num_rows and self.spec.upsert and self.tiers:
                hidden = self.local_hidden(key_values(table, self.spec.primary_key))
                table = table.filter(pa.array(~hidden))
            out.append(table)
        return out

    def base_limit(self, k: int) -> int:
        """Base rows fetched first: k, plus `BASE_OVERFETCH` when fresh memtables may
        decide some base rows' keys."""
        return k + (BASE_OVERFETCH if self.any_keys() else 0)

    def base_overfetch(
        self,
        k: int,
        fetch_rows: Callable[[int], pa.Table],
        first: pa.Table | None = None,
    ) -> pa.Table:
        """Fetch the base's top rows, dropping those decided by a fresh memtable, asking for
        more (4x per round) while hidden rows leave fewer than k. `first` is the first
        round's result when the caller fetched it already."""
        any_keys = self.any_keys()
        limit = self.base_limit(k)
        for _ in range(MAX_FETCH_ROUNDS):
            table = first if first is not None else fetch_rows(limit)
            first = None
            if not any_keys or not table.num_rows:
                return table
            hidden = self.base_hidden(key_values(table, self.spec.primary_key))
            visible = table.filter(pa.array(~hidden))
            if visible.num_rows >= k or table.num_rows < limit:
                return visible
            limit *= 4
        return visible


def take(
    spec: TableSpec,
    writers: list[ShardWriter],
    open_base: Callable[[], lance.LanceDataset],
    skipped: Callable[[str, BaseException], None],
    remote: Callable[[lance.LanceDataset, set[str]], RemoteTier | None] | None = None,
) -> Snapshot:
    """Views first, then the base, then `fresh` (see the module docstring). A writer whose
    view fails (poisoned, fenced) is skipped and reported to `skipped`. `remote(base)`
    gives the other pods' memtables relative to that base version (fan-out reads), for the
    shards whose view this process did not take."""
    views = []
    for writer in writers:
        try:
            views.append(writer.view())
        except LanceSinkError as exc:
            skipped(writer.shard, exc)
            log.warning("reader_shard_skipped", shard=writer.shard, error=str(exc))
    base = open_base()
    tiers: list[MemtableTier] = []
    for view in views:
        shard_tiers: list[MemtableTier] = []
        for m in view.fresh(base):
            # Newer = every tier already listed (earlier shards, then newer memtables).
            tier = MemtableTier(view.shard, m, (*tiers, *shard_tiers), spec)
            shard_tiers.append(tier)
        tiers.extend(shard_tiers)
    dropped = max((v.dropped_through for v in views), default=0)
    far = None if remote is None else remote(base, {v.shard for v in views})
    return Snapshot(base, tuple(tiers), spec, far, dropped)
