"""The query API's threads: `QueryPool`, bounded slots for queries and their abandoned work.

Queries run on the app's own pool: ``query.max_concurrent_queries`` slots for queries
someone waits for, plus as many threads for abandoned work, i.e. queries whose request got
504 but whose work (which cannot be interrupted) is still running. A 504 hands its slot over
to new queries while the abandoned work is under that second bound; past it, timed-out work
keeps its slot until it ends. So a slot is held by a query nobody waits for at most
``query.timeout_ms`` while fewer than ``max_concurrent_queries`` such queries run, the
threads of the process stay bounded (twice the setting), and a request that finds every
slot taken gets 503 at once instead of queueing. On a writer pod both pools count their
running work into the consumer loop's `sink.query_share.QueryShare`.

`sink.http.app.create_query_app` builds two pools (its own queries, and other pods' fan-out
requests for this pod's fresh rows); `sink.http.serving.ServerHandle.stop` shuts them down.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from engine.threads import name_os_thread
from sink.http.errors import HttpError
from sink.query_share import QueryShare


class _Task:
    """One query's claim on the pool: a slot, or (once abandoned) an abandoned-work place."""

    __slots__ = ("abandoned", "done")

    def __init__(self) -> None:
        self.abandoned = False
        self.done = False


class QueryPool:
    """At most `size` queries someone waits for, plus at most `size` abandoned ones.

    `submit` takes a slot or raises `HttpError` 503 when none is free. The worker thread
    gives the slot back when the work ends. A request that gives up on its query (504)
    calls `abandon`: the work (which cannot be interrupted) goes on, counted as abandoned,
    and its slot is free for new queries at once, unless `size` abandoned queries are
    running already; then it keeps its slot until it ends, as every query did before. So a
    query nobody waits for holds a slot at most `query.timeout_ms` (under that bound),
    threads stay bounded (2 * `size`), and a flood of slow queries cannot grow them.

    Lifecycle: built by `create_query_app` (kept as ``app.state.query_pool``);
    `shutdown` (from `ServerHandle.stop`) lets running work finish in the background.
    """

    def __init__(self, size: int, share: QueryShare | None = None) -> None:
        self.size = size
        self._share = share  # counts the running work in, for the writer's consumer loop
        self._running = 0
        self._abandoned = 0
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(
            max_workers=2 * size, thread_name_prefix="query", initializer=name_os_thread
        )

    @property
    def running(self) -> int:
        """Slots taken now (queries someone waits for, or abandoned past the bound)."""
        with self._lock:
            return self._running

    @property
    def abandoned(self) -> int:
        """Abandoned queries whose work still runs without holding a slot."""
        with self._lock:
            return self._abandoned

    def _release(self, task: _Task) -> None:
        if self._share is not None:
            self._share.leave()
        with self._lock:
            task.done = True
            if task.abandoned:
                self._abandoned -= 1
            else:
                self._running -= 1

    def abandon(self, task: _Task) -> None:
        """Nobody waits for `task` any more: free its slot if abandoned work is under its
        bound (else the slot is freed when the work ends)."""
        with self._lock:
            if task.done or task.abandoned or self._abandoned >= self.size:
                return
            task.abandoned = True
            self._running -= 1
            self._abandoned += 1

    def submit(self, fn: Callable[[], pa.Table]) -> tuple[asyncio.Future[pa.Table], _Task]:
        """Start `fn` on a pool thread (call from the event loop).

        Raises:
            HttpError: 503, every slot is taken.
        """
        with self._lock:
            if self._running >= self.size:
                raise HttpError(
                    503,
                    "overloaded",
                    f"{self.size} queries are already running (query.max_concurrent_queries)",
                )
            self._running += 1
        if self._share is not None:
            self._share.enter()
        task = _Task()

        def work() -> pa.Table:
            try:
                return fn()
            finally:
                self._release(task)

        try:
            return asyncio.get_running_loop().run_in_executor(self._executor, work), task
        except BaseException:
            self._release(task)
            raise

    def shutdown(self) -> None:
        """Accept no more work; running work finishes in the background."""
        self._executor.shutdown(wait=False, cancel_futures=True)
