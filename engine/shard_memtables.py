"""The memtables of one shard writer: the active memtable the WAL step inserts durable
entries into, the frozen ones waiting for their flush (oldest first), the durable cursors of
what they hold, and the view readers take of them (`ShardView`, with the rule that decides
which memtables a base table version already holds).

When the active memtable seals (who asks, and when):

- Before an insert, when `should_seal` says the entry would not fit: outright (the live put
  that needed it asked the controller's `may_seal` first, in `ShardWriter.put`).
- After an insert, when `is_full` says it reached a limit: replay seals outright, the live
  path asks `may_seal` (`seal_if_due`).
- At every WAL step (`seal_if_due`): full, or its first row `max_age_s` old, if `may_seal`
  allows; the step is scheduled at that age, and a refused seal is asked again every
  `engine.shard.IDLE_WAKE_S`.
- When the controller asked (`honour_seal_request`, `ShardMemory.request_seal`), and forced
  by drain, close and revoke (`ShardWriter.seal`, which ignores `may_seal`).

A seal freezes the active memtable, opens the next generation and calls `sealed` (the writer
schedules the flush, `engine.flusher`). A frozen memtable leaves `frozen` only once its flush
committed, so readers keep seeing its rows until the base holds them.

Every method runs under the writer's lock (the caller holds it): the caller's thread, the
WAL step and a flush share these fields through it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import lance
import pyarrow as pa
import structlog

from engine.backpressure import BackpressureController, ShardMemory
from engine.errors import LanceSinkError
from engine.memtable import Memtable, MemtableView, SealLimits, is_full, should_seal
from engine.schema import TableSpec
from engine.shard_stats import EngineEvents
from engine.table import holds_generation
from engine.wal import SourceRange

log = structlog.get_logger("lance_sink.engine")


@dataclass(frozen=True, slots=True)
class ShardView:
    """The visible memtables of a shard, newest first (active, then frozen newest-first)."""

    shard: str
    memtables: tuple[MemtableView, ...]
    #: The newest table version holding a memtable that is no longer in the view (flushed
    #: and dropped, or flushed by an earlier writer before this one replayed). A base
    #: version below it lacks rows the view lacks too: `fresh` is only exact for a base at
    #: or above it, which a view taken before the base always is (fan-out reads, whose owner
    #: takes its view after the coordinator opened the base, check it).
    dropped_through: int = 0

    def fresh(self, base: lance.LanceDataset) -> list[MemtableView]:
        """The memtables whose rows the base table version `base` does not hold.

        Order matters: take the view first, then open `base`, then call this. A memtable
        flushed meanwhile stays in the view (so its rows cannot vanish between the tiers),
        and its live flush state says whether `base` holds it: committed at or below
        `base.version` → skipped; committing right now → the transactions above its floor
        decide; not committing → `base` cannot hold it.
        """
        out = []
        version = int(base.version)
        for view in self.memtables:
            m = view.memtable
            committed, floor = m.committed_version, m.commit_floor  # this order (see above)
            if committed is not None:
                if committed <= version:
                    continue
            elif floor is not None and holds_generation(base, self.shard, m.generation, floor):
                continue
            out.append(view)
        return out


class ShardMemtables:
    """One shard's memtables and durable cursors (see the module docstring), owned by its
    `ShardWriter`: `poisoned` asks the writer's poison (no seal once poisoned),
    `pending_bytes` what it buffers for the next WAL entry (counted as active memory), and
    `sealed` is called after every seal."""

    def __init__(
        self,
        shard: str,
        spec: TableSpec,
        limits: SealLimits,
        max_age_s: float,
        controller: BackpressureController,
        memory: ShardMemory,
        events: EngineEvents,
        *,
        poisoned: Callable[[], LanceSinkError | None],
        pending_bytes: Callable[[], int],
        sealed: Callable[[], None],
    ) -> None:
        self.shard = shard
        self.spec = spec
        self.limits = limits
        self.max_age_s = max_age_s
        self.controller = controller
        self.memory = memory
        self.events = events
        self.log = log.bind(shard=shard)
        self._poisoned = poisoned
        self._pending_bytes = pending_bytes
        self._sealed = sealed
        self.active = Memtable(spec, 1)
        self.frozen: deque[Memtable] = deque()
        #: The WAL position of the newest entry in a memtable (durable and visible).
        self.durable_position = 0
        #: The last durable source offset per (topic, partition).
        self.durable_offsets: dict[tuple[str, int], int] = {}

    def start(
        self, generation: int, flushed_position: int, flushed_offsets: dict[tuple[str, int], int]
    ) -> None:
        """Start from what the claim found flushed (before replay)."""
        self.durable_position = flushed_position
        self.durable_offsets = dict(flushed_offsets)
        self.active = Memtable(self.spec, generation)

    def insert_fence(self, position: int) -> None:
        """Record the fence entry replay wrote (no rows) as the newest durable position."""
        self.durable_position = position
        self.active.insert([], position, [])
        self.account()

    def insert(
        self,
        batches: list[pa.RecordBatch] | tuple[pa.RecordBatch, ...],
        position: int,
        sources: list[SourceRange] | tuple[SourceRange, ...],
        *,
        replay: bool,
    ) -> bool:
        """Insert a durable entry into the active memtable: sealing first if `should_seal`
        says so, and after if the memtable is then full (`is_full`), so a quiet partition's
        full memtable flushes without waiting for the next put. Shared by the live path and
        replay (I4). Before an insert the seal is unconditional (the live put that needed it
        asked `may_seal`); after it, replay seals outright as before an insert, the live path
        asks the controller (`seal_if_due`). Returns True if a seal happened."""
        active = self.active
        sealed = False
        if should_seal(
            active.rows,
            active.memory_size,
            len(active.batches),
            sum(b.num_rows for b in batches),
            sum(b.nbytes for b in batches),
            self.limits,
        ):
            self.seal(reason="threshold")
            sealed = True
        self.active.insert(batches, position, sources)
        self.durable_position = position
        for s in sources:
            key = (s.topic, s.partition)
            self.durable_offsets[key] = max(self.durable_offsets.get(key, -1), s.last)
        self.account()
        if not replay:
            return self.seal_if_due() or sealed
        active = self.active
        if is_full(active.rows, active.memory_size, len(active.batches), self.limits):
            self.seal(reason="threshold")
            sealed = True
        return sealed

    def seal_if_due(self) -> bool:
        """Seal the active memtable if it is full (`is_full`: it reached a seal limit) or
        its first row is `max_age_s` old, so a quiet partition's rows reach the Lance table
        (and other pods' queries) without waiting for another put: a full one at once, a
        slow one within about `max_age_s` plus one flush. Checked after every live insert
        and at every WAL step (scheduled at the `max_age_s` deadline); a seal the
        controller refuses now is asked again `engine.shard.IDLE_WAKE_S` later. Returns True
        if it sealed."""
        active = self.active
        if not active.rows or self._poisoned() is not None:
            return False
        if is_full(active.rows, active.memory_size, len(active.batches), self.limits):
            reason = "threshold"
        else:
            age = self.max_age_s
            first = active.first_insert_at
            if age <= 0 or first is None or time.monotonic() - first < age:
                return False
            reason = "age"
        if not self.controller.may_seal(self.memory):
            return False
        self.seal(reason=reason)
        return True

    def honour_seal_request(self) -> None:
        """Seal the active memtable if a controller asked (ShardMemory.request_seal)."""
        if self.memory.seal_required:
            self.memory.seal_required = False
            if self.active.rows and self._poisoned() is None:
                self.seal(reason="requested")

    def seal(self, reason: str) -> None:
        """Freeze the active memtable and open the next generation; schedule its flush."""
        old = self.active
        old.frozen = True
        self.frozen.append(old)
        self.active = Memtable(self.spec, old.generation + 1)
        self.account()
        self.events.memtable_sealed(self.shard, old.generation, old.rows, old.memory_size)
        self.log.info(
            "memtable_sealed",
            generation=old.generation,
            rows=old.rows,
            bytes=old.memory_size,
            reason=reason,
        )
        self._sealed()

    def account(self) -> None:
        """Tell the backpressure controller's `ShardMemory` what the memtables hold."""
        self.memory.active_bytes = self.active.memory_size + self._pending_bytes()
        self.memory.frozen_bytes = sum(m.memory_size for m in self.frozen)

    def view(self, dropped_through: int) -> ShardView:
        """The visible memtables, newest first."""
        memtables = [self.active, *reversed(self.frozen)]
        return ShardView(self.shard, tuple(m.view() for m in memtables), dropped_through)
