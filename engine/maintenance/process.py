"""`MaintenanceProcess`: the maintenance loops (`engine.maintenance.runner.Maintenance`) in
a child process, the sink's default (`maintenance.process`).

The parent side (`MaintenanceProcess`: start, standby, stop, the supervisor thread that
forwards the child's reports and restarts a child that exits on its own) and the child's
side (`run_child`, its main, and `_PipeEvents`, which sends each report up the pipe). The
pipe carries ``("active", bool)`` and ``("stop", timeout)`` down, and ``(task, outcome,
seconds, unindexed_rows)`` up.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import structlog

from config.settings import MaintenanceSettings
from engine.maintenance.runner import Maintenance, MaintenanceEvents, NoMaintenanceEvents
from engine.schema import TableSpec
from engine.storage import open_storage
from engine.table import BaseTable

log = structlog.get_logger("lance_sink.maintenance")

#: A maintenance process that exits on its own is restarted after this long, doubled after
#: each exit up to the maximum (reset once a process has lived longer than the maximum).
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 60.0
#: A child standing by this long is stopped (retired) and started again when the role is
#: gained: a standby child holds 126 MiB resident (56 MiB private; measured on an empty
#: table, more once indexes were loaded) for nothing. Long enough that a rolling restart of
#: the group, whose rebalances move the role back and forth within minutes, does not stop
#: and spawn children at each one (a start costs a spawn, the imports, ~0.7 s of CPU, and a
#: table open), short next to a standby pod's life (days).
STANDBY_RETIRE_S = 300.0
#: A retired child may finish the task it was in for this long (it starts none on standby,
#: so only a task begun before the role was lost, over `STANDBY_RETIRE_S` ago, is cut; the
#: role's new holder runs it again).
RETIRE_STOP_TIMEOUT_S = 60.0
#: How often the supervisor, waiting for the child's reports, checks for a retirement due.
RETIRE_CHECK_S = 1.0


class MaintenanceProcess:
    """Runs `Maintenance` (its two loops: the same tasks at the same cadence) in a child
    process, the sink's default (`maintenance.process`).

    Why: Lance runs a process's dataset operations on one shared runtime. While the vector
    index was optimised in the sink process, queries of every kind (Lance's own searches
    too) waited inside Lance for over a second, in bursts (bench/query, docs/reads.md). A
    child process has a runtime of its own, and runs at a lower CPU priority
    (`maintenance.nice`), so the kernel gives ingestion and queries the CPU first, once the
    table has its first vector and text indexes (`Maintenance.first_indexes_built`): until
    then every query scans the base flat, and at the lower priority a catch-up starved their
    builds (600k messages: the first text index took 33 s, the vector index 48 s; at 200k
    the text index 11-12 s, 2.9 s at the sink's priority, bench/results/catchup.txt). The
    child starts at the sink's priority and lowers its own, every thread's, after a task
    finds them built.

    The child is started with the ``spawn`` method (a fork would copy the locks of Lance's
    and librdkafka's threads in whatever state they are), opens the table and the WAL storage
    itself, and sends each task's outcome and the unindexed row count over a pipe; a
    supervisor thread here forwards them to `events` and `unindexed_rows()`. The child exits
    when `stop()` asks it to, or when the pipe closes because the sink died (even by
    SIGKILL). A child that exits on its own (a crash inside Lance, the OOM killer) is logged
    (``maintenance_process_exited``) and restarted with backoff. `set_active` reaches the
    child over the same pipe (a restarted child starts in the last state set).

    Standby: no child runs until the role is first gained (`set_active(True)`, or
    `active=True` at construction), and a child standing by for `standby_retire_s` is
    stopped like at `stop` (``maintenance_process_retired``, not a crash: no restart) and
    started again the next time the role is gained. A standby child would hold its runtimes
    (126 MiB resident on an empty table) doing nothing; taking over costs a child start
    instead (under a second, nothing next to the tasks' cadence).

    Killing the child in the middle of a task loses only that task's work: each task is one
    or a few Lance commits, each atomic; files written by an interrupted task are removed by
    a later cleanup.

    Lifecycle: `start()` once (starts the supervisor thread, which starts a child once the
    role is held), `set_active()` any time, `stop()` during shutdown (safe, idempotent;
    bounded by its `timeout` whether a child runs, retires or none does).
    """

    def __init__(
        self,
        spec: TableSpec,
        storage_uri: str,
        settings: MaintenanceSettings,
        events: MaintenanceEvents | None = None,
        *,
        init: Callable[[], None] | None = None,
        active: bool = True,
        standby_retire_s: float = STANDBY_RETIRE_S,
    ) -> None:
        """`init` runs first in the child (e.g. to configure logging); it must be picklable
        (a module-level function or a `functools.partial` of one). `active` False: no child
        is started until `set_active(True)`. `standby_retire_s`: see the class docstring."""
        self.spec = spec
        self.storage_uri = storage_uri
        self.settings = settings
        self.events: MaintenanceEvents = events or NoMaintenanceEvents()
        self.init = init
        self.restarts = 0
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        #: Notified (under `_lock`) when the role is gained or a stop is requested.
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._supervisor: threading.Thread | None = None
        self._stop_sent = False
        self._active = active
        self.standby_retire_s = standby_retire_s
        self._standby_since = time.monotonic()
        self._unindexed = 0

    def start(self) -> None:
        """Start the supervisor thread, which starts the child now if active, else once the
        role is gained (no-op if running)."""
        if self._supervisor is not None and self._supervisor.is_alive():
            return
        self._stop.clear()
        self._supervisor = threading.Thread(
            target=self._supervise, name="maintenance-supervisor", daemon=True
        )
        self._supervisor.start()

    def set_active(self, active: bool) -> None:
        """Have the child run the tasks (True) or stand by after its current one (False);
        returns at once. The message is a few bytes on the pipe, which never fills."""
        with self._lock:
            if active == self._active:
                return
            self._active = active
            self._standby_since = time.monotonic()
            self._changed.notify_all()
            conn = None if self._stop_sent else self._conn
            if conn is not None:  # sent under the lock: the child sees the changes in order
                with contextlib.suppress(OSError, ValueError):  # gone: a new child reads it
                    conn.send(("active", active))

    @property
    def active(self) -> bool:
        return self._active

    def request_stop(self, timeout: float) -> None:
        """Ask the child to stop after its current task, which it may finish within
        `timeout` seconds; returns at once (`stop` waits, and kills)."""
        self._stop.set()
        with self._lock:
            self._changed.notify_all()
            conn = None if self._stop_sent else self._conn
            self._stop_sent = True
            if conn is not None:
                with contextlib.suppress(OSError, ValueError):  # the child is gone already
                    conn.send(("stop", timeout))

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the child to stop after its current task (unless `request_stop` did); kill
        it if it has not stopped within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        self.request_stop(timeout)
        with self._lock:
            process, conn = self._process, self._conn
        if process is not None and conn is not None:
            process.join(max(deadline - time.monotonic(), 0.01))
            if process.is_alive():
                log.warning("maintenance_process_killed", pid=process.pid, after_s=timeout)
                process.kill()
                process.join(5)
        if self._supervisor is not None:
            self._supervisor.join(5)

    def unindexed_rows(self) -> int:
        """As `Maintenance.unindexed_rows`, as the child last reported it."""
        return self._unindexed

    def pid(self) -> int | None:
        """The running child's process id (None before `start`, before the role is first
        gained, after a retirement on standby, or between restarts)."""
        process = self._process
        return process.pid if process is not None and process.is_alive() else None

    def _supervise(self) -> None:
        backoff = RESTART_BACKOFF_S
        retired = True  # no child yet: the first starts once the role is held
        while True:
            with self._lock:
                while retired and not self._active and not self._stop.is_set():
                    self._changed.wait()
                if self._stop.is_set():
                    return
                parent, child = self._ctx.Pipe()
                process = self._ctx.Process(
                    target=run_child,
                    args=(
                        child,
                        self.spec,
                        self.storage_uri,
                        self.settings,
                        self.init,
                        self._active,
                    ),
                    name="lance-sink-maintenance",
                    daemon=True,
                )
                process.start()
                child.close()
                self._process, self._conn = process, parent
                self._stop_sent = False
            started = time.monotonic()
            log.info("maintenance_process_started", pid=process.pid, active=self._active)
            retired = self._forward(parent)
            process.join(5)
            parent.close()
            if self._stop.is_set():
                return
            if retired:
                log.info("maintenance_process_retired", pid=process.pid, exitcode=process.exitcode)
                backoff = RESTART_BACKOFF_S
                continue
            self.restarts += 1
            self._report(self.events.process_exited, process.exitcode)
            if time.monotonic() - started > RESTART_BACKOFF_MAX_S:
                backoff = RESTART_BACKOFF_S
            log.warning(
                "maintenance_process_exited",
                pid=process.pid,
                exitcode=process.exitcode,
                restart_in_s=backoff,
            )
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)

    def _forward(self, conn: Connection) -> bool:
        """Forward the child's reports until its end of the pipe closes, retiring the child
        once it has stood by for `standby_retire_s`; True if it was retired."""
        retiring = False
        while True:
            try:
                if not conn.poll(RETIRE_CHECK_S):
                    retiring = retiring or self._retire_if_due(conn)
                    continue
                task, outcome, seconds, unindexed = conn.recv()
            except (EOFError, OSError):
                return retiring
            self._unindexed = unindexed
            self._report(self.events.ran, task, outcome, seconds)

    def _retire_if_due(self, conn: Connection) -> bool:
        """Ask the child to stop if it has stood by for `standby_retire_s` (and no stop was
        asked already); True if asked."""
        with self._lock:
            due = time.monotonic() - self._standby_since >= self.standby_retire_s
            if self._active or self._stop_sent or not due:
                return False
            self._stop_sent = True  # set_active(True) now starts the next child instead
            with contextlib.suppress(OSError, ValueError):  # gone already: retired anyway
                conn.send(("stop", RETIRE_STOP_TIMEOUT_S))
            return True

    @staticmethod
    def _report(event: Callable[..., None], *args: Any) -> None:
        try:
            event(*args)
        except Exception as exc:  # noqa: BLE001 - a metrics failure must not stop upkeep
            log.warning("maintenance_event_failed", event=event.__name__, error=str(exc))


#: The tasks after which the child asks whether the first indexes exist (each reads the
#: table's newest version anyway, every `optimize_interval_s`).
INDEX_TASKS = frozenset({"vector_index", "fts_index"})


class _PipeEvents:
    """MaintenanceEvents of the child: each report goes to the parent with the unindexed row
    count (both loops report; one lock keeps their messages whole). After an index task,
    once the first indexes exist, it lowers the child's priority by `nice` (once)."""

    def __init__(self, conn: Connection, nice: int = 0) -> None:
        self.conn = conn
        self.maintenance: Maintenance | None = None
        self._lock = threading.Lock()
        self._nice = nice

    def ran(self, task: str, outcome: str, seconds: float) -> None:
        unindexed = self.maintenance.unindexed_rows() if self.maintenance is not None else 0
        with self._lock, contextlib.suppress(OSError, ValueError):
            self.conn.send((task, outcome, seconds, unindexed))
        if task in INDEX_TASKS:
            self._lower_priority()

    def _lower_priority(self) -> None:
        if not self._nice or self.maintenance is None:
            return
        try:
            if not self.maintenance.first_indexes_built():
                return
        except Exception as exc:  # noqa: BLE001 - the next index task asks again
            log.warning("maintenance_index_check_failed", error=str(exc))
            return
        with self._lock:
            nice, self._nice = self._nice, 0
        if nice:
            lower_priority(nice)
            log.info("maintenance_priority_lowered", nice=nice)

    def process_exited(self, exitcode: int | None) -> None:
        return None  # the parent's supervisor reports its child's exits


def lower_priority(nice: int) -> None:
    """Add `nice` to the niceness of every thread of this process. On Linux niceness is a
    thread's (`os.nice` changes the calling thread only, and Lance's runtime threads run
    by now); threads started later inherit it from the thread starting them."""
    try:
        threads = [int(t.name) for t in Path("/proc/self/task").iterdir()]
    except OSError:
        os.nice(nice)  # no /proc: the process's priority, where the system keeps one
        return
    for tid in threads:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(now + nice, 19))


def run_child(
    conn: Connection,
    spec: TableSpec,
    storage_uri: str,
    settings: MaintenanceSettings,
    init: Callable[[], None] | None,
    active: bool = True,
) -> None:
    """The maintenance child's main (see `MaintenanceProcess`): runs the loops (active or
    standing by, as the parent says) until the parent says stop or its end of the pipe
    closes, then exits without waiting for a task still inside Lance."""
    # Ctrl-C reaches the whole process group; the parent drains and then stops this child.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if init is not None:
        init()
    events = _PipeEvents(conn, settings.nice)
    maintenance = Maintenance(
        spec,
        BaseTable(spec),
        open_storage(storage_uri, spec.storage_options),
        settings,
        events,
        active=active,
    )
    events.maintenance = maintenance
    maintenance.start()
    timeout = 0.0
    while True:
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            log.warning("maintenance_parent_gone")
            break
        if kind == "active":
            maintenance.set_active(bool(value))
            continue
        timeout = float(value)  # "stop"
        break
    maintenance.stop(timeout=timeout)
    os._exit(0)
