"""A writer pod's fair share for queries: `QueryShare`.

A writer pod ingests and answers queries in one process: the consumer loop, its decode
threads, the WAL and the memtables take the interpreter lock and the cores that its
queries (and other pods' fan-out requests for its fresh rows) need. During a catch-up
ingestion runs flat out and, left alone, would starve them (issue 40: p99 9.4 s).

While at least one query runs, ingestion takes at most ``query.ingest_share`` of the
consumer loop's time: after an iteration that did ingestion work (consumed messages,
handed them to decoding, waited for decoders, put rows), the loop sleeps long enough that
its busy time is that share of the whole, at most `MAX_PAUSE_S` at a time. Everything
downstream (decoding, WAL appends, memtable inserts, flushes) is fed by the loop, so it
slows with it; the loop's sleep releases the interpreter lock to the queries. With no
query running, nothing changes: a pod's ingestion rate is unchanged whenever nobody reads
from it, and at a steady low rate the loop is mostly waiting for messages anyway.

The queries count themselves in and out (`sink.http.pool.QueryPool` does it for the
query API and for fan-out requests); the loop asks `pause_after` once per iteration.
`lance-sink serve` builds none: it has no ingestion to yield.
"""

from __future__ import annotations

import threading

# The longest one pause: the loop still serves rebalances, commits and its tick between.
MAX_PAUSE_S = 0.25


class QueryShare:
    """How long the consumer loop pauses while queries run (see the module docstring).

    `share` is ``query.ingest_share`` (0 < share <= 1; 1 never pauses). Thread-safe:
    queries enter and leave on their pool's threads, the loop reads on its own.
    """

    def __init__(self, share: float) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.share = share
        self._running = 0
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        """Queries running now (fan-out requests included)."""
        return self._running

    def enter(self) -> None:
        """A query starts."""
        with self._lock:
            self._running += 1

    def leave(self) -> None:
        """A query ends (its work, not its request: abandoned work still counts)."""
        with self._lock:
            self._running -= 1

    def pause_after(self, busy_s: float) -> float:
        """The pause owed after a loop iteration that spent `busy_s` on ingestion: 0 when
        no query runs; else `busy_s` * (1 - share) / share, at most `MAX_PAUSE_S`."""
        if self._running <= 0 or self.share >= 1 or busy_s <= 0:
            return 0.0
        return min(busy_s * (1 - self.share) / self.share, MAX_PAUSE_S)
