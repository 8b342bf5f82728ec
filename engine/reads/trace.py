"""Where one query's time goes: `QueryTrace`, the seconds its thread spent in named stages.

The query API runs each query (and each answer to another pod's fan-out request) inside
`traced`, on the thread that runs it; the read path marks its stages with `stage(name)`.
A query slower than ``query.slow_query_ms`` is logged (`query_slow`) with its stages, so an
operator sees whether it waited for another pod's fresh rows, for a base fragment being
loaded, for Lance's search, or for the statistics of a new base version.

Stages may nest: each records its own wall time, so an outer stage includes its inner
ones, and a stage entered several times (each fragment read, each round trip) adds up.
Only the query's own thread is traced: work on other threads (a hybrid query's text half,
the base search running `meanwhile`, the fan-out requests in flight) is not counted; the
query thread's waits for it are (`fanout_wait`, `base_wait`). Outside `traced`, `stage`
costs one context-variable read.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar


class QueryTrace:
    """The seconds spent in each stage by one query's thread, and since it began."""

    __slots__ = ("stages", "started")

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.stages: dict[str, float] = {}

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    def add(self, name: str, seconds: float) -> None:
        self.stages[name] = self.stages.get(name, 0.0) + seconds

    def summary(self) -> dict[str, float]:
        """Milliseconds per stage, largest first (what the slow-query log shows)."""
        ordered = sorted(self.stages.items(), key=lambda item: -item[1])
        return {name: round(seconds * 1000, 1) for name, seconds in ordered}


_current: ContextVar[QueryTrace | None] = ContextVar("lance_sink_query_trace", default=None)


@contextmanager
def traced() -> Iterator[QueryTrace]:
    """Trace the stages this thread runs until the block ends."""
    trace = QueryTrace()
    token = _current.set(trace)
    try:
        yield trace
    finally:
        _current.reset(token)


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Count the block's wall time in stage `name` of the current trace, if any."""
    trace = _current.get()
    if trace is None:
        yield
        return
    started = time.monotonic()
    try:
        yield
    finally:
        trace.add(name, time.monotonic() - started)
