"""What librdkafka's statistics tell the sink: brokers up, and each held partition's log end.

librdkafka calls `on_stats` from consume() on the loop thread every
`observability.kafka_statistics_interval_ms`; readiness and the offset snapshots read the
figures from any thread (single assignments and dict reads of ints: atomic in CPython).
The high watermark comes from fetch responses, which is right on every broker; a partition
the consumer does not fetch has none newer (`sink.lag.PausedEnds` probes those).
"""

from __future__ import annotations

import time
from collections.abc import Container

import orjson


class BrokerStats:
    """The last statistics' figures (see the module docstring)."""

    def __init__(self, held: Container[tuple[str, int]]) -> None:
        self.held = held  # the partitions whose log end is kept
        self.brokers_up = 0
        self.received_at = 0.0  # monotonic time of the last statistics (0: none yet)
        self.end_offsets: dict[tuple[str, int], int] = {}

    def on_stats(self, stats_json: str) -> None:
        """librdkafka's statistics callback. orjson: at 1,024 partitions the statistics are
        ~1 MB a second, which the standard library's parser took ~10 ms of the idle loop's
        thread a second to read (orjson ~2.5x less)."""
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
