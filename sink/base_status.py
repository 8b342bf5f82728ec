"""The base table's part of `/v1/status` (its rows and index lag), bounded in time.

Reading it opens the Lance dataset and counts its rows: a few requests to table storage,
milliseconds on a local disk, tens on S3. A stalled store (an S3 endpoint that accepts
connections and never answers, a hung mount) holds those requests for as long as the
store client's own timeouts and retries allow: minutes. The status must answer at once
whatever storage does, so:

- the read runs on a daemon thread of its own, **one at a time**: a status call while a
  read is in flight waits for that read and never starts another, so a stalled store holds
  one thread, not one per status call (nor the process's exit);
- a call waits for it at most `BASE_STATUS_TIMEOUT_S`; past that its answer says the
  figures are unknown now and why (how long storage has not answered), with the last
  figures read and their age (`last_known`, when a read ever succeeded). The read in
  flight goes on; when it ends, its figures are the next call's `last_known`.

Lifecycle: `SinkService` builds one `BaseTableStatus` with its read function; the status
endpoint's threads call `get` (any thread, concurrently). Nothing to close: a read still
stalled at exit is a daemon thread the interpreter does not wait for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from engine.threads import name_os_thread

log = structlog.get_logger("lance_sink.sink")

#: How long a status call waits for the base table's figures. A read takes milliseconds
#: locally and tens on S3, so a healthy store answers well within it; an operator's
#: `lance-sink status` (10 s timeout) and a dashboard poll get their answer within it
#: whatever the store does.
BASE_STATUS_TIMEOUT_S: Final = 1.0


@dataclass
class _Read:
    """One read of the base table's figures, on its own thread."""

    started: float  # monotonic
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] | None = None  # the figures, or {"unindexed_rows": None, "error"}


class BaseTableStatus:
    """The base table's figures for `/v1/status`, each call bounded by `timeout_s` (see the
    module docstring).

    Args:
        read: reads the figures (`rows`, `unindexed_rows`, `unindexed_by_index`) from table
            storage; any exception it raises is reported as the figures' `error`.
        timeout_s: the longest a call waits for a read.
    """

    def __init__(
        self, read: Callable[[], dict[str, Any]], timeout_s: float = BASE_STATUS_TIMEOUT_S
    ) -> None:
        self._read = read
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._running: _Read | None = None
        self._last: tuple[float, dict[str, Any]] | None = None  # (monotonic, figures)

    def get(self) -> dict[str, Any]:
        """The base table's figures as read now (a read that started for this call, or the
        one in flight), or, when storage does not answer within the timeout,
        `unindexed_rows: None` with the `error` and the `last_known` figures with their
        `age_s`."""
        with self._lock:
            running = self._running
            if running is None:
                running = self._running = _Read(time.monotonic())
                threading.Thread(
                    target=self._run, args=(running,), name="base-status", daemon=True
                ).start()
        if running.done.wait(self._timeout_s) and running.result is not None:
            return dict(running.result)
        now = time.monotonic()
        out: dict[str, Any] = {
            "unindexed_rows": None,
            "error": (
                f"table storage has not answered for {now - running.started:.1f} s "
                "(a read of the base table is still in flight)"
            ),
        }
        with self._lock:
            last = self._last
        if last is not None:
            at, figures = last
            out["last_known"] = {**figures, "age_s": round(now - at, 1)}
        return out

    def _run(self, read: _Read) -> None:
        name_os_thread()
        result: dict[str, Any]
        try:
            result = self._read()
        except Exception as exc:  # noqa: BLE001 - any failure is the status's error, not the thread's end
            result = {"unindexed_rows": None, "error": f"{type(exc).__name__}: {exc}"}
        finished = time.monotonic()
        seconds = finished - read.started
        if seconds > self._timeout_s:
            log.info("base_status_read_slow", seconds=round(seconds, 3))
        with self._lock:
            if result.get("unindexed_rows") is not None:
                self._last = (finished, result)
            self._running = None
            read.result = result
        read.done.set()
