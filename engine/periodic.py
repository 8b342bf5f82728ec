"""A daemon thread that runs one step periodically: the reader's cache fillers use it."""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger("lance_sink.reader")


class PeriodicThread:
    """Runs `step()` every `interval_s` on a daemon thread named `name`.

    The thread starts on the first `start()` (later calls do nothing) and never after
    `close()`. A step that raises is logged as `failure_event` and run again at the next
    interval: the steps fill caches, so a failure costs time, never correctness.
    """

    def __init__(
        self, name: str, interval_s: float, step: Callable[[], None], failure_event: str
    ) -> None:
        self.name = name
        self.interval_s = interval_s
        self.step = step
        self.failure_event = failure_event
        self.thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def start(self) -> None:
        if self.thread is not None or self._closed.is_set():
            return
        with self._lock:
            if self.thread is None and not self._closed.is_set():
                self.thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self.thread.start()

    def close(self, timeout: float) -> None:
        """Stop (idempotent): wait up to `timeout` seconds for a running step to end."""
        self._closed.set()
        with self._lock:
            thread = self.thread
        if thread is not None:
            thread.join(timeout)

    def _loop(self) -> None:
        while not self._closed.wait(self.interval_s):
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - a cache filler must not die
                log.warning(self.failure_event, error=str(exc))
