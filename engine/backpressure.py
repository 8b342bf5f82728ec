"""Admission control between callers of `ShardWriter.put` and memory.

`BackpressureController` is the seam: the writer calls `maybe_apply_backpressure` before
accepting a put and `may_seal` before a put that needs the active memtable sealed (and
before sealing one that an insert filled or that reached `max_age_s`). A
controller is injected (settings or constructor) and replaces the built-in one; it does not
layer on top of it. Built-ins:

- `BlockingValve` (default for embedded use): per shard, blocks the put while the shard's
  unflushed bytes exceed `max_unflushed_memtable_bytes`; never raises.
- `BudgetController` (what the sink uses): one process-wide byte budget over every shard;
  raises `Backpressure` instead of blocking, so the consumer loop can pause the partition.

`ShardMemory` is the live view a controller sees: its fields are updated by the writer as
memtables fill, seal and flush, and read without any lock (I7).
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from engine.errors import Backpressure


class ShardMemory:
    """Live memory view of one shard (not a snapshot).

    Attributes (written by the shard writer, read lock-free by anyone):
        active_bytes: the active memtable plus puts buffered for the next WAL entry.
        frozen_bytes: frozen memtables not yet flushed, including ones whose flush failed.
        seal_required: a controller asks the writer to seal the active memtable soon so
            that memory can be flushed and freed.
    """

    def __init__(self, shard: str) -> None:
        self.shard = shard
        self.active_bytes = 0
        self.frozen_bytes = 0
        self.seal_required = False
        self.closed = False
        self._changed = threading.Condition()
        self._on_seal_request: Callable[[], None] | None = None

    def request_seal(self) -> None:
        """Ask the writer to seal the active memtable soon (schedules its WAL step)."""
        self.seal_required = True
        if self._on_seal_request is not None:
            self._on_seal_request()

    def on_seal_request(self, callback: Callable[[], None]) -> None:
        """The writer registers how to be woken by `request_seal`."""
        self._on_seal_request = callback

    @property
    def unflushed_bytes(self) -> int:
        return self.active_bytes + self.frozen_bytes

    def notify(self) -> None:
        """Wake waiters: memory was freed, or the writer closed."""
        with self._changed:
            self._changed.notify_all()

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until `predicate()` holds (re-checked on every notify) or `timeout` passes."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)


class BackpressureStats:
    """Process-wide backpressure counters (thread-safe, cancellation-safe waits)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waits_total = 0
        self.wait_seconds_total = 0.0
        self.active_waits = 0
        self.rejections_total = 0

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Count a wait: visible in `active_waits` while it lasts, in the totals after."""
        start = time.monotonic()
        with self._lock:
            self.active_waits += 1
        try:
            yield
        finally:
            with self._lock:
                self.active_waits -= 1
                self.waits_total += 1
                self.wait_seconds_total += time.monotonic() - start

    def rejected(self) -> None:
        with self._lock:
            self.rejections_total += 1

    def snapshot(self) -> BackpressureSnapshot:
        with self._lock:
            return BackpressureSnapshot(
                self.waits_total, self.wait_seconds_total, self.active_waits, self.rejections_total
            )


@dataclass(frozen=True, slots=True)
class BackpressureSnapshot:
    waits_total: int
    wait_seconds_total: float
    active_waits: int
    rejections_total: int


@runtime_checkable
class BackpressureController(Protocol):
    """Decides whether a put may proceed. Called by the writer outside its lock."""

    stats: BackpressureStats

    def maybe_apply_backpressure(self, incoming_bytes: int, shard: ShardMemory) -> None:
        """Return to admit; block to delay; raise `Backpressure` to refuse."""

    def may_seal(self, shard: ShardMemory) -> bool:
        """May the active memtable of `shard` be sealed now? Asked before a put that needs
        a seal (refusal refuses the put) and before sealing a memtable that is full or old
        (refusal keeps it active; the writer asks again at its next wake and next put)."""

    def register(self, shard: ShardMemory) -> None:
        """A writer opened for `shard`."""

    def unregister(self, shard: ShardMemory) -> None:
        """The writer of `shard` closed."""


class ControllerBase:
    """Defaults for controllers: sealing always allowed, registration ignored."""

    def __init__(self) -> None:
        self.stats = BackpressureStats()

    def may_seal(self, shard: ShardMemory) -> bool:
        return True

    def register(self, shard: ShardMemory) -> None:
        return None

    def unregister(self, shard: ShardMemory) -> None:
        return None


class BlockingValve(ControllerBase):
    """Per-shard valve: a put waits while the shard holds more than `limit` unflushed bytes.

    Never raises. While waiting it asks for a seal if nothing is frozen (otherwise nothing
    would ever be flushed to free memory). An empty shard always admits.
    """

    POLL_S = 0.05  # re-check even without a notify, so a missed wake-up costs 50 ms at most

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def maybe_apply_backpressure(self, incoming_bytes: int, shard: ShardMemory) -> None:
        def admitted() -> bool:
            return (
                shard.closed
                or shard.unflushed_bytes == 0
                or shard.unflushed_bytes + incoming_bytes <= self.limit
            )

        if admitted():
            return
        with self.stats.waiting():
            while not admitted():
                if shard.frozen_bytes == 0 and not shard.seal_required:
                    shard.request_seal()
                shard.wait(admitted, self.POLL_S)


class BudgetController(ControllerBase):
    """Process-wide budget over every registered shard; refuses with `Backpressure`.

    A put is admitted while the unflushed bytes of all shards plus the put stay within
    `budget` (or when nothing at all is buffered, so a single large put cannot wedge the
    process). On refusal, if less than half of what is buffered is already frozen (and so
    on its way out), the shard with the largest active memtable is asked to seal.
    """

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget = budget
        self._shards: dict[int, ShardMemory] = {}
        self._lock = threading.Lock()

    def register(self, shard: ShardMemory) -> None:
        with self._lock:
            self._shards[id(shard)] = shard

    def unregister(self, shard: ShardMemory) -> None:
        with self._lock:
            self._shards.pop(id(shard), None)

    def used_bytes(self) -> int:
        """Unflushed bytes over every registered shard (lock-free reads of live views)."""
        return sum(s.unflushed_bytes for s in list(self._shards.values()))

    def maybe_apply_backpressure(self, incoming_bytes: int, shard: ShardMemory) -> None:
        shards = list(self._shards.values())
        used = sum(s.unflushed_bytes for s in shards)
        if used == 0 or used + incoming_bytes <= self.budget:
            return
        self.stats.rejected()
        frozen = sum(s.frozen_bytes for s in shards)
        if frozen * 2 < used:
            largest = max(shards, key=lambda s: s.active_bytes, default=None)
            if largest is not None and largest.active_bytes > 0:
                largest.request_seal()
        raise Backpressure(
            "process memory budget exhausted",
            shard=shard.shard,
            used_bytes=used,
            incoming_bytes=incoming_bytes,
            budget_bytes=self.budget,
        )


def build_controller(
    kind: str, *, process_budget_bytes: int, max_unflushed_memtable_bytes: int
) -> BackpressureController:
    """Build the controller named in the settings: 'budget', 'valve' or 'module:factory'.

    A factory is called with the two limits as keyword arguments and must return an object
    satisfying `BackpressureController`.
    """
    if kind == "budget":
        return BudgetController(process_budget_bytes)
    if kind == "valve":
        return BlockingValve(max_unflushed_memtable_bytes)
    module_name, _, attr = kind.partition(":")
    factory = importlib.import_module(module_name)
    for part in attr.split("."):
        factory = getattr(factory, part)
    controller = factory(  # type: ignore[operator]
        process_budget_bytes=process_budget_bytes,
        max_unflushed_memtable_bytes=max_unflushed_memtable_bytes,
    )
    if not isinstance(controller, BackpressureController):
        raise TypeError(f"{kind} did not return a BackpressureController")
    return controller
