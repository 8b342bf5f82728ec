"""Base statistics cached per base version, recomputed in the background.

Used for what is costly to count on the base and changes slowly with it: BM25's document
counts, average length and document frequencies (`engine.reads.text`), the text index's
coverage, whether the base has a vector index (`engine.reads.vector`).

Lifecycle: one `StatsCache` per `Reader`, shared by every query thread. The stats thread
starts with the first background computation; `close` cancels what is queued (idempotent),
after which values are computed inline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import lance
import structlog

log = structlog.get_logger("lance_sink.reader")

#: What a failed background statistic run returns (its old value, if any, stays in use).
FAILED = object()
#: Cached base statistics (df per term, documents, avgdl) for this many columns x terms.
STATS_CACHE_ENTRIES = 16_384
#: Base statistics computed at an older base version are reused while they are younger than
#: this and the base's row count moved by less than `STATS_MAX_DRIFT`: counting a common
#: term's documents in a 1M-row base takes tens of ms, and flushes make a new version every
#: few seconds, while IDF barely moves with a few percent more documents.
STATS_MAX_AGE_S = 30.0
STATS_MAX_DRIFT = 0.1


class StatsCache:
    """Statistics of the base keyed by a tuple, each stored with the base version (and row
    count) it was computed at."""

    def __init__(self, closed: threading.Event) -> None:
        self._closed = closed
        self._stats: dict[tuple[Any, ...], Any] = {}
        self._stats_lock = threading.Lock()
        self._refreshing: dict[tuple[Any, ...], Future[Any]] = {}
        self._stats_pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Cancel queued background computations (idempotent; `closed` is set already)."""
        with self._stats_lock:
            pool = self._stats_pool
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def clear(self) -> None:
        """Forget every cached value."""
        with self._stats_lock:
            self._stats.clear()

    def cached(
        self,
        base: lance.LanceDataset,
        key: tuple[Any, ...],
        compute: Callable[[], Any],
        *,
        reuse: bool = True,
        wait_s: float | None = None,
        estimate: Any = None,
    ) -> Any:
        """`compute()` for this base version, or (with `reuse`) a recent value computed at a
        similar version (see `STATS_MAX_AGE_S`). With `reuse`, an older value is returned
        as it is while `compute()` runs again on the background stats thread (one run per
        key at a time): recounting a 1M-row base's documents took hundreds of ms, which a
        query then waited for every 30 s (the text p99 under ingestion).

        With `wait_s`, a value not cached yet is computed on the stats thread too, and
        waited for at most `wait_s` seconds; past that (or if it fails) the query gets
        `estimate`, and the value, once computed, serves the next queries."""
        version, rows, now = int(base.version), base.count_rows(), time.monotonic()
        with self._stats_lock:
            hit = self._stats.get(key)
        if hit is not None:
            value, at_version, at_rows, at_time = hit
            drift = abs(rows - at_rows) / max(at_rows, 1)
            if at_version == version:
                return value
            if reuse and at_rows > 0:
                if now - at_time >= STATS_MAX_AGE_S or drift >= STATS_MAX_DRIFT:
                    self.in_background(key, compute, version, rows)
                return value
        if wait_s is not None:
            future = self.in_background(key, compute, version, rows)
            if future is not None:  # None: the reader is closed, compute inline
                try:
                    value = future.result(timeout=wait_s)
                except TimeoutError:
                    return estimate
                return estimate if value is FAILED else value
        value = compute()
        self._store(key, value, version, rows, now)
        return value

    def peek(self, key: tuple[Any, ...]) -> Any:
        """The value last computed for `key` at any base version (None: none yet); never
        computes."""
        with self._stats_lock:
            hit = self._stats.get(key)
        return None if hit is None else hit[0]

    def _store(self, key: tuple[Any, ...], value: Any, version: int, rows: int, at: float) -> None:
        with self._stats_lock:
            if len(self._stats) >= STATS_CACHE_ENTRIES:
                self._stats.clear()
            self._stats[key] = (value, version, rows, at)

    def in_background(
        self, key: tuple[Any, ...], compute: Callable[[], Any], version: int, rows: int
    ) -> Future[Any] | None:
        """Compute a statistic on the background stats thread: a stale value's refresh, or
        a first value a query waits for at most `wait_s` (at most one run per key queued or
        running: returns that run's future, whose result is the value or `FAILED`; a
        failure keeps the old value, logged). None once the reader is closed."""
        with self._stats_lock:
            running = self._refreshing.get(key)
            if running is not None or self._closed.is_set():
                return running
            if self._stats_pool is None:
                self._stats_pool = ThreadPoolExecutor(1, thread_name_prefix="reader-stats")
            pool = self._stats_pool

            def run() -> Any:
                try:
                    value = compute()
                except Exception as exc:  # noqa: BLE001 - the old value stays in use
                    log.warning("reader_stats_refresh_failed", key=str(key), error=str(exc))
                    value = FAILED
                else:
                    self._store(key, value, version, rows, time.monotonic())
                finally:
                    with self._stats_lock:
                        self._refreshing.pop(key, None)
                return value

            future = pool.submit(run)
            self._refreshing[key] = future
            return future
