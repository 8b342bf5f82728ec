"""The WAL scheduler: a pool of WAL workers and one timer shared by every shard writer of
a process, so the threads and the idle cost do not grow with the number of shards.

A shard writer registers a *step* (`WalScheduler.register`): one non-blocking pass of its
WAL work (seal a memtable that is due, write one WAL entry of its buffered puts and resolve
their futures, honour a seal request), and its idle fence probe. The step returns when the
shard next wants to run (a `time.monotonic()` deadline: the group-commit deadline of its
first buffered put, its active memtable's max-age seal), or None; the probe runs on the
probe lane, paced for the whole process (below), never through the step.

Lifecycle (who calls what, and when):

- `register(name, step)` (`ShardWriter.open`, once the shard is live) returns the shard's
  `ScheduledShard` handle. The pool threads start with the first registration.
- `wake(handle)` (a put that filled the WAL buffer, a seal request, close) queues the shard
  for the next free worker; `wake_at(handle, when)` (the first buffered put) puts a
  deadline in the timer's heap. Both are cheap, never block on I/O, and may be called with
  the writer's lock held (the scheduler's lock is taken last and never held while a step
  runs).
- A worker runs the step of one shard at a time, and **a shard is never run by two workers
  at once**: a shard woken while its step runs is queued again after it (`again`), so its
  WAL positions are written and its futures resolved in order. A step that raises is
  logged and not retried (the writer's step poisons the writer itself first, I6).
- `register(..., probe=fn, probe_interval=s)` also puts the shard on the **probe lane**:
  `PROBE_WORKERS` threads that call each registered shard's `fn` (its idle fence probe, a
  LIST of its manifest) at most every `probe_interval` seconds, oldest first, and all
  shards together at most `fence_probes_per_s` times a second (in batches of up to
  `PROBE_BATCH_S` of that rate a wake). So the idle cost of a
  process is bounded by that setting, not by its shard count (at 1,024 shards one probe
  per shard per second was a LIST plus a WAL step each, a fifth of a core idle: issue
  #39), and storage round trips of idle shards never queue before WAL steps of busy ones.
  A shard is probed every `max(probe_interval, probed shards / fence_probes_per_s)`
  seconds, plus a round trip when the lane falls behind on a slow store. A probe runs
  with no scheduler lock held, never twice at once for a shard, and one that raises is
  logged and probed again a period later.
- `add_probe(name, fn, interval)` (`Engine`, at its first open: the claim board's sweep,
  `engine.claim_board`) puts a probe of no shard on the same lane, paced with the shards'
  probes; `remove_probe` (`Engine.close`) ends it.
- `unregister(handle)` (the writer's close, after its last step) drops the shard: its
  deadlines are ignored and wakes do nothing.
- `close(timeout)` (`Engine.close`, after every writer closed) stops the workers and the
  timer; a step already running finishes first. A writer closed later finishes its WAL
  work on its own thread (`ShardWriter.close`).

A shard with nothing buffered and no deadline costs nothing: no thread waits for it and no
timer entry fires for it (its idle fence probe is one entry in the probe lane's heap, taken
within the process's probe rate).
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable

import structlog

from engine.threads import name_os_thread

log = structlog.get_logger("lance_sink.engine")

#: A step: one pass of a shard's WAL work; returns when it next wants to run, or None.
Step = Callable[[], float | None]

#: Threads of the probe lane: idle shards' fence probes (a LIST each, a round trip on S3)
#: run there, so they never delay a WAL append; with many shards on an object store they
#: fall behind (each shard then probes less often than asked), never the appends. Two, so
#: one slow LIST does not stop the lane.
PROBE_WORKERS = 2

#: The most probes a lane thread takes at one wake: this long at the lane's rate (16 at
#: the default 64 a second). One wake per probe was most of the lane's cost (a thread
#: wake-up and a turn of the interpreter lock per LIST of two names: ~0.02 of a core at
#: 64 probes a second, measured at 1,024 idle shards); the rate, and so the bound on how
#: stale an idle writer's fence may be, is the same, taken in bursts.
PROBE_BATCH_S = 0.25

#: Idle fence probes per second of one process (all its shards) by default
#: (`wal.fence_probes_per_s`): a probe costs ~0.1 ms of CPU on a local disk (a LIST and a
#: few Python calls), so 64 a second is well under 1% of a core, and up to 64 idle shards
#: keep the default `wal.fence_check_interval_ms` of 1 s; 1,024 shards are probed every
#: 16 s each.
DEFAULT_FENCE_PROBES_PER_S = 64

#: Rebuild the timer heap once this many of its entries were superseded (and they are the
#: majority): a busy shard moves its deadline earlier at every first put, and the old
#: entries would otherwise wait in the heap until their (possibly far) time.
_STALE_REBUILD = 256


def default_wal_workers() -> int:
    """The pool size when `wal.workers` is unset: 4 per core, at least 4, at most 32.

    A WAL worker mostly waits on storage (an fsync, or a PUT to an object store), so the
    pool is a few times the cores; it bounds how many WAL appends of different shards are
    in flight at once, not how many shards there are.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(32, max(4, 4 * (cores or 1)))


def _no_step() -> None:
    """The step of a probe of no shard (`WalScheduler.add_probe`): never woken."""


class ScheduledShard:
    """One registered shard: its step and its scheduling state (under the scheduler lock)."""

    __slots__ = ("again", "closed", "name", "probe", "probe_interval", "state", "step", "timer_at")

    IDLE, QUEUED, RUNNING = 0, 1, 2

    def __init__(
        self,
        name: str,
        step: Step,
        probe: Callable[[], None] | None = None,
        probe_interval: float = 1.0,
    ) -> None:
        self.name = name
        self.step = step
        #: Its idle fence probe (the probe lane calls it), or None.
        self.probe = probe
        self.probe_interval = probe_interval
        self.state = ScheduledShard.IDLE
        #: Woken while its step ran: queue it again after the step.
        self.again = False
        #: The deadline of its live timer entry (None: none).
        self.timer_at: float | None = None
        self.closed = False


def _let_go(handle: ScheduledShard) -> None:
    """Drop a closed handle's step and probe: its entry stays in the probe lane until due
    (an idle shard's is up to its `probe_interval` away, minutes), and through them it kept
    the closed shard writer, its memtables included, from being freed."""
    handle.step = _no_step
    handle.probe = None


class WalScheduler:
    """The WAL workers and the timer; see the module docstring."""

    def __init__(
        self,
        workers: int | None = None,
        name: str = "wal",
        *,
        fence_probes_per_s: float = DEFAULT_FENCE_PROBES_PER_S,
    ) -> None:
        if fence_probes_per_s <= 0:
            raise ValueError("fence_probes_per_s must be positive")
        self.workers = workers or default_wal_workers()
        self.name = name
        self.fence_probes_per_s = fence_probes_per_s
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._timer = threading.Condition(self._lock)
        self._probe_cv = threading.Condition(self._lock)
        #: The probe lane: (due, seq, shard), oldest due first; a shard being probed is out.
        self._probe_heap: list[tuple[float, int, ScheduledShard]] = []
        #: The earliest start of the next probe (paces the lane to `fence_probes_per_s`).
        self._probe_slot = 0.0
        self._ready: deque[ScheduledShard] = deque()
        self._heap: list[tuple[float, int, ScheduledShard]] = []
        self._stale = 0
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._registered = 0
        #: Steps run (all shards): a test counts them to check an idle engine stays idle.
        self.steps_total = 0
        #: Probes run (all shards): a test counts them to check the lane's rate.
        self.probes_total = 0
        #: Batches the lane took (each a thread's wake): a test checks they are few.
        self.probe_batches_total = 0

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def registered(self) -> int:
        """How many shards are registered now."""
        return self._registered

    # ------------------------------------------------------------------ shards

    def register(
        self,
        name: str,
        step: Step,
        *,
        probe: Callable[[], None] | None = None,
        probe_interval: float = 1.0,
    ) -> ScheduledShard:
        """Register a shard's step and, if given, its idle fence probe (first run one
        `probe_interval` from now); see the module docstring. Starts the threads if needed."""
        return self._admit(ScheduledShard(name, step, probe, probe_interval), shard=True)

    def add_probe(self, name: str, probe: Callable[[], None], interval: float) -> ScheduledShard:
        """Put a probe of no shard on the probe lane (the engine's claim-board sweep), run
        every `interval` within the lane's rate like a shard's; not counted in
        `registered`. `remove_probe` ends it. Starts the threads if needed."""
        return self._admit(ScheduledShard(name, _no_step, probe, interval), shard=False)

    def _admit(self, handle: ScheduledShard, *, shard: bool) -> ScheduledShard:
        """Start the threads if needed and put `handle`'s probe, if any, on the lane (first
        run one `probe_interval` from now); a `shard` is counted in `registered`. After
        `close`, the handle is closed at once."""
        with self._lock:
            if self._closed:
                handle.closed = True
                return handle
            if shard:
                self._registered += 1
            if not self._threads:
                self._start_locked()
            if handle.probe is not None:
                self._push_probe_locked(handle, time.monotonic() + handle.probe_interval)
        return handle

    def remove_probe(self, handle: ScheduledShard) -> None:
        """End a probe `add_probe` started (one running now finishes)."""
        with self._lock:
            handle.closed = True
            _let_go(handle)

    def unregister(self, handle: ScheduledShard) -> None:
        """Drop a shard: no further step runs for it (one running now finishes)."""
        with self._lock:
            if not handle.closed:
                handle.closed = True
                self._registered -= 1
                if handle.timer_at is not None:
                    handle.timer_at = None
                    self._stale += 1
            _let_go(handle)

    def wake(self, handle: ScheduledShard) -> None:
        """Run the shard's step as soon as a worker is free (once, however often woken)."""
        with self._lock:
            self._wake_locked(handle)

    def wake_at(self, handle: ScheduledShard, when: float) -> None:
        """Run the shard's step at `when` (`time.monotonic()`) at the latest."""
        with self._lock:
            self._wake_at_locked(handle, when)

    def _push_probe_locked(self, handle: ScheduledShard, due: float) -> None:
        heapq.heappush(self._probe_heap, (due, next(self._seq), handle))
        if self._probe_heap[0][2] is handle:
            self._probe_cv.notify()

    def _wake_locked(self, handle: ScheduledShard) -> None:
        if handle.closed or self._closed:
            return
        if handle.state == ScheduledShard.IDLE:
            handle.state = ScheduledShard.QUEUED
            self._ready.append(handle)
            self._work.notify()
        elif handle.state == ScheduledShard.RUNNING:
            handle.again = True

    def _wake_at_locked(self, handle: ScheduledShard, when: float) -> None:
        if handle.closed or self._closed:
            return
        if when <= time.monotonic():
            self._wake_locked(handle)
            return
        if handle.timer_at is not None:
            if handle.timer_at <= when:
                return  # an earlier entry is live: the step then asks again
            self._stale += 1
        handle.timer_at = when
        heapq.heappush(self._heap, (when, next(self._seq), handle))
        if self._heap[0][2] is handle:
            self._timer.notify()
        if self._stale > _STALE_REBUILD and self._stale * 2 > len(self._heap):
            self._heap = [e for e in self._heap if e[2].timer_at == e[0] and not e[2].closed]
            heapq.heapify(self._heap)
            self._stale = 0

    # ------------------------------------------------------------------ threads

    def _start_locked(self) -> None:
        for i in range(self.workers):
            t = threading.Thread(target=self._work_loop, name=f"{self.name}_{i}", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._timer_loop, name=f"{self.name}_timer", daemon=True)
        t.start()
        self._threads.append(t)
        for i in range(PROBE_WORKERS):
            t = threading.Thread(target=self._probe_loop, name=f"fence_probe_{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _probe_loop(self) -> None:
        """A probe lane thread: take the probes that are due, oldest first, at most a
        batch (`PROBE_BATCH_S` of the lane's rate) and no sooner than the lane's pace
        allows; run them without the lock, put each back a period on."""
        name_os_thread()
        pace = 1.0 / self.fence_probes_per_s
        most = max(1, int(self.fence_probes_per_s * PROBE_BATCH_S))
        while True:
            with self._lock:
                batch = self._take_probes_locked(pace, most)
                if not batch:
                    return
            for handle in batch:
                probe = handle.probe  # None once closed (`_let_go`)
                try:
                    if probe is not None and not handle.closed:
                        probe()
                except Exception as exc:  # noqa: BLE001 - the lane must not die with a shard
                    log.warning("fence_probe_failed", shard=handle.name, error=str(exc))
            with self._lock:
                again = time.monotonic()
                for handle in batch:
                    if not handle.closed and not self._closed:
                        self._push_probe_locked(handle, again + handle.probe_interval)

    def _take_probes_locked(self, pace: float, most: int) -> list[ScheduledShard]:
        """Wait for the probe lane's next batch: the due probes (up to `most`) once the
        lane's pace allows, which then moves a `pace` on per probe taken; [] when closed."""
        heap = self._probe_heap
        while not self._closed:
            if not heap:
                self._probe_cv.wait()
                continue
            due, _, head = heap[0]
            if head.closed:
                heapq.heappop(heap)
                continue
            now = time.monotonic()
            wait = max(due, self._probe_slot) - now
            if wait > 0:
                self._probe_cv.wait(wait)
                continue
            batch: list[ScheduledShard] = []
            while heap and len(batch) < most and heap[0][0] <= now:
                handle = heapq.heappop(heap)[2]
                if not handle.closed:
                    batch.append(handle)
            self._probe_slot = max(self._probe_slot, now) + pace * len(batch)
            self.probes_total += len(batch)
            self.probe_batches_total += 1
            return batch
        return []

    def _timer_loop(self) -> None:
        name_os_thread()
        with self._lock:
            while not self._closed:
                if not self._heap:
                    self._timer.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._timer.wait(wait)
                    continue
                when, _, handle = heapq.heappop(self._heap)
                if handle.timer_at != when or handle.closed:
                    self._stale = max(self._stale - 1, 0)
                    continue
                handle.timer_at = None
                self._wake_locked(handle)

    def _work_loop(self) -> None:
        name_os_thread()
        while True:
            with self._lock:
                while not self._ready and not self._closed:
                    self._work.wait()
                if self._closed:
                    return
                handle = self._ready.popleft()
                if handle.closed:
                    handle.state = ScheduledShard.IDLE
                    continue
                handle.state = ScheduledShard.RUNNING
                handle.again = False
                self.steps_total += 1
                step = handle.step  # taken while open: `unregister` lets go of it
            try:
                when = step()
            except Exception as exc:  # noqa: BLE001 - a worker must not die with a shard
                log.error("wal_step_failed", shard=handle.name, error=str(exc))
                when = None
            with self._lock:
                handle.state = ScheduledShard.IDLE
                if handle.again:
                    self._wake_locked(handle)
                elif when is not None:
                    self._wake_at_locked(handle, when)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the workers and the timer (idempotent); a running step finishes first."""
        with self._lock:
            self._closed = True
            self._work.notify_all()
            self._timer.notify_all()
            self._probe_cv.notify_all()
            threads, self._threads = self._threads, []
        deadline = time.monotonic() + timeout
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(deadline - time.monotonic(), 0))


_default: WalScheduler | None = None
_default_lock = threading.Lock()


def default_scheduler() -> WalScheduler:
    """The process-wide scheduler of writers opened without one (tests, benches, embedded
    use without an `Engine`): started on first use, never closed (daemon threads)."""
    global _default  # noqa: PLW0603 - one lazily built process-wide pool
    with _default_lock:
        if _default is None:
            _default = WalScheduler()
        return _default
