"""Replay: reading back, on open, the WAL entries a shard's earlier owners made durable but
did not flush, and the fence entry that ends them.

`ShardWriter.open` calls `replay_wal` once, after the claim found the flushed watermark and
before the writer's WAL steps are scheduled:

1. Every entry after the flushed position is read in position order and handed to `apply`,
   which inserts it exactly as the live path did (the live seal predicate, flushing each
   memtable as it seals: bounded replay, I4).
2. The fence: an empty entry of the new epoch is appended create-only at the next position.
   If an older writer got there first, its entry is durable and may be acknowledged, so it
   is replayed too and the next position is tried. Once the fence is written, an older
   writer's next append finds its position taken and it poisons itself (`Fenced`, I5).

If `replay_wal` raises (storage failed, or `apply` raised: an entry of another shard, the poison
error of a failed flush), the writer's open fails and nothing was acknowledged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from engine.storage import AlreadyExists
from engine.wal import EntryEncoder, Wal, WalEntry


@dataclass(frozen=True, slots=True)
class Replayed:
    """What a replay read and where it fenced."""

    rows: int
    nbytes: int
    #: The position of the fence entry: the writer's first durable position.
    fence_position: int
    #: Every position found in the WAL (listed, or taken by an older writer before the
    #: fence), so the caller can trim those at or below the flushed position.
    positions: frozenset[int]


def replay_wal(
    wal: Wal,
    encoder: EntryEncoder,
    shard: str,
    epoch: int,
    schema: pa.Schema,
    flushed_position: int,
    apply: Callable[[WalEntry], None],
) -> Replayed:
    """Apply the entries after `flushed_position` in order, then fence (module docstring)."""
    rows = nbytes = 0
    position = flushed_position + 1
    present = set(wal.positions())
    while True:
        while position in present:
            entry = wal.read(position)
            apply(entry)
            rows += entry.num_rows
            nbytes += entry.nbytes
            position += 1
        # Fence: take the next position with an empty entry of our epoch. If an older
        # writer got there first, replay its entry too and try the next position.
        try:
            fence = encoder.encode(position, epoch, shard, schema, [], [])
            wal.append(position, fence)
        except AlreadyExists:
            present.add(position)
            continue
        break
    return Replayed(rows, nbytes, position, frozenset(present))
