"""What a shard writer reports: domain events as they happen (`EngineEvents`, pushed to the
sink's metrics facade from the writer's own threads) and a snapshot of its state on demand
(`ShardStats`, pulled by `ShardWriter.stats()`, readable after close and poisoning).

Event methods are called on the thread that did the work (a WAL worker, a flush thread,
the caller of `open`, `seal` or `close`), `memtable_sealed` while it holds the writer's lock:
an implementation must be thread-safe and quick, and must never call back into the writer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class EngineEvents(Protocol):
    """Domain events the engine reports (the sink's metrics facade implements this)."""

    def shard_origin(self, shard: str, topic: str, partition: int) -> None: ...
    def wal_appended(self, shard: str, seconds: float, nbytes: int, rows: int) -> None: ...
    def memtable_sealed(self, shard: str, generation: int, rows: int, nbytes: int) -> None: ...
    def flushed(self, shard: str, seconds: float, rows: int) -> None: ...
    def flush_failed(self, shard: str, error: BaseException) -> None: ...
    def replayed(self, shard: str, seconds: float, rows: int, nbytes: int) -> None: ...
    def poisoned(self, shard: str, error: BaseException) -> None: ...


class NoEvents:
    """EngineEvents that records nothing."""

    def shard_origin(self, shard: str, topic: str, partition: int) -> None:
        return None

    def wal_appended(self, shard: str, seconds: float, nbytes: int, rows: int) -> None:
        return None

    def memtable_sealed(self, shard: str, generation: int, rows: int, nbytes: int) -> None:
        return None

    def flushed(self, shard: str, seconds: float, rows: int) -> None:
        return None

    def flush_failed(self, shard: str, error: BaseException) -> None:
        return None

    def replayed(self, shard: str, seconds: float, rows: int, nbytes: int) -> None:
        return None

    def poisoned(self, shard: str, error: BaseException) -> None:
        return None


@dataclass(frozen=True, slots=True)
class ShardStats:
    """A snapshot of one shard writer's state (readable after close and poisoning)."""

    shard: str
    epoch: int
    generation: int
    rows: int
    bytes: int
    index_bytes: int
    frozen_count: int
    frozen_bytes: int
    durable_position: int
    visible_position: int
    flushed_position: int
    durable_offsets: dict[tuple[str, int], int]
    flushed_offsets: dict[tuple[str, int], int]
    wal_entries_total: int
    wal_bytes_total: int
    flushes_total: int
    flush_failures_total: int
    flushed_rows_total: int
    replayed_rows: int
    replay_seconds: float
    poisoned: str | None
