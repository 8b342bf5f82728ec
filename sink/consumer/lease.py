"""The consumer lease: who may wait on the consumer's handle, the loop or a reader.

confluent-kafka serialises the calls on one client handle: a call from another thread
while consume() waits polls (with short sleeps) until that call ends, and then competes
with the loop's next consume() for the gap between two calls. A /metrics scrape or a
status call reads the cached high watermark of every held partition
(`get_watermark_offsets(cached=True)`, microseconds each): as one call per gap it took
seconds at a thousand partitions, and a quiet loop that waits longer in consume() (fewer,
shorter gaps) starved it (issue #39). So the loop's consume() calls and a reader's whole
pass take turns under one lease:

- the loop (`consume`, on the loop thread) holds the lease for each consume() call, and
  before each call gives way to every reader already waiting;
- a reader (`hold`, any thread) waits for the consume() in progress to end (at most one
  consume wait: `kafka.consume_timeout_ms`, or the quiet loop's slice,
  `sink.service.QUIET_CONSUME_TIMEOUT_S`), makes all its calls, and lets go.

The loop's other consumer calls (commit, position, pause, seek, assign) are short and
need no lease. Nothing here raises; `close` is not needed (the consumer's own close ends
the loop's use of it, and `StatusBoard.consumer_closing` the readers').
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class Consuming(Protocol):
    """The consumer's part the lease calls for the loop."""

    def consume(self, num_messages: int = ..., timeout: float = ...) -> list[Any]: ...


class ConsumerLease:
    """Turns on one consumer handle between the loop's consume() calls and readers'
    passes (see the module docstring)."""

    def __init__(self, consumer: Consuming) -> None:
        self.consumer = consumer
        self._turn = threading.Condition(threading.Lock())
        self._consuming: int | None = None  # the thread inside consume(), if any
        self._reading = False  # a reader holds the lease
        self._waiting = 0  # readers waiting for it
        self.passes = 0  # readers' passes so far (tests and benchmarks count them)

    def consume(self, num_messages: int, timeout: float) -> list[Any]:
        """The loop's consume(): after every reader already waiting has had its pass."""
        with self._turn:
            while self._reading or self._waiting:
                self._turn.wait()
            self._consuming = threading.get_ident()
        try:
            return self.consumer.consume(num_messages, timeout)
        finally:
            with self._turn:
                self._consuming = None
                self._turn.notify_all()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """A reader's pass over the consumer: waits for the loop's consume() in progress,
        if any, to return. A callback consume() runs (the loop thread, inside the call)
        holds the handle already and passes at once."""
        if self._consuming == threading.get_ident():
            yield
            return
        with self._turn:
            self._waiting += 1
            try:
                while self._consuming is not None or self._reading:
                    self._turn.wait()
            finally:
                self._waiting -= 1
            self._reading = True
            self.passes += 1
        try:
            yield
        finally:
            with self._turn:
                self._reading = False
                self._turn.notify_all()
