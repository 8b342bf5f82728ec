"""What librdkafka's statistics tell the sink: brokers up, and each held partition's log end.

librdkafka calls `on_stats` from consume() on the loop thread every
`observability.kafka_statistics_interval_ms`; readiness and the offset snapshots read the
figures from any thread (single assignments and dict reads of ints: atomic in CPython).
The high watermark comes from fetch responses, which is right on every broker; a partition
the consumer does not fetch has none newer (`sink.lag.PausedEnds` probes those).

Readiness asks `unreachable`. librdkafka sends its first statistics one interval after the
consumer starts; until then (and for `STALE_INTERVALS` intervals more) the group's
assignment, which readiness waits for anyway, is the sign that a broker answers. The
interval is 5 s by default: each statistics document names every partition (~1 MB at
1,024 partitions), which librdkafka builds and the loop parses, ~1% of a core a second at
1,024 partitions, for figures that readiness alone still takes from it (lags read the
fetch responses' ends at each scrape).
"""

from __future__ import annotations

import time
from collections.abc import Container
from typing import Final

import orjson

#: Statistics older than this many intervals (plus a second) make a process not ready: two
#: may be missed (a consume() call late under load) before the third says something is wrong.
STALE_INTERVALS: Final = 3


class BrokerStats:
    """The last statistics' figures (see the module docstring)."""

    def __init__(self, held: Container[tuple[str, int]], interval_s: float) -> None:
        self.held = held  # the partitions whose log end is kept
        self.interval_s = interval_s  # `observability.kafka_statistics_interval_ms`
        self.created_at = time.monotonic()  # the consumer is created with it
        self.brokers_up = 0
        self.received_at = 0.0  # monotonic time of the last statistics (0: none yet)
        self.end_offsets: dict[tuple[str, int], int] = {}

    def unreachable(self, now: float) -> str | None:
        """Why no broker counts as reachable, or None: no statistics (or none newer)
        within `STALE_INTERVALS` intervals and a second of the consumer's start (or of the
        last ones), or the last ones had no broker up."""
        stale_s = STALE_INTERVALS * self.interval_s + 1
        if self.received_at == 0.0:
            if now - self.created_at > stale_s:
                return "no broker statistics yet"
            return None
        if now - self.received_at > stale_s:
            return f"no broker statistics for {now - self.received_at:.0f} s"
        if self.brokers_up == 0:
            return "no broker reachable"
        return None

    def on_stats(self, stats_json: str) -> None:
        """librdkafka's statistics callback. orjson: at 1,024 partitions the statistics are
        ~1 MB each, which the standard library's parser took ~10 ms of the idle loop's
        thread to read (orjson ~2.5x less)."""
        try:
            stats = orjson.loads(stats_json)
        except ValueError:  # orjson.JSONDecodeError is one
            return
        self.received_at = time.monotonic()
        self.brokers_up = sum(
            1
            for b in stats.get("brokers", {}).values()
            if b.get("state") == "UP" and b.get("nodeid", -1) >= 0
        )
        for topic, t in stats.get("topics", {}).items():
            for pid, p in t.get("partitions", {}).items():
                partition = int(pid)
                if partition < 0:
                    continue
                hi = int(p.get("hi_offset", -1))
                if hi >= 0 and (topic, partition) in self.held:
                    self.end_offsets[(topic, partition)] = hi

    def end(self, key: tuple[str, int]) -> int | None:
        """The partition's log end from the last statistics, if known."""
        return self.end_offsets.get(key)

    def forget(self, key: tuple[str, int]) -> None:
        """The partition was released: its log end is no longer this process's to know."""
        self.end_offsets.pop(key, None)
