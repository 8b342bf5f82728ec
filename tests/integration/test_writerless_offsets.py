"""The offsets of a partition without a shard writer, and its series after release, in a
real `SinkService` (real broker client, real Lance table): fast companions of
`tests/e2e/test_lag_without_writer.py`."""

from __future__ import annotations

import re
import time

import pytest

from sink.consumer.partition import PartitionState, Phase
from sink.consumer.status import PartitionView
from sink.service import SinkService

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]


def series(service: SinkService, topic: str, shard: str) -> list[str]:
    """Exposition lines of the partition (`topic`) or of its shard."""
    text = service.board.exposition().decode()
    pattern = re.compile(rf'(topic="{re.escape(topic)}"|shard="{re.escape(shard)}")')
    return [line for line in text.splitlines() if pattern.search(line)]


def test_a_dropped_writer_leaves_current_offsets_and_a_release_leaves_no_series(
    service: SinkService, topic: str
) -> None:
    # A partition whose writer was poisoned after making 0-119 durable and flushing
    # 0-79, with 120 committed and a batch from offset 120 (produced 30 s ago) dropped.
    state = PartitionState(
        topic, 0, 120, phase=Phase.RECOVERING, position=120, done=120, shard="s-0"
    )
    state.writer_durable, state.writer_flushed = 120, 80
    state.rewound = (120, int(time.time() * 1000) - 30_000)
    state.open_error = "Poisoned: disk full"
    service.partitions.add(state)
    service.broker.end_offsets[(topic, 0)] = 150  # the last statistics before it
    service.board.publish()
    snap = service.board.partition_offsets(PartitionView.of(state))
    assert (snap.end, snap.consumed, snap.durable, snap.committed, snap.flushed) == (
        150,
        120,
        120,
        120,
        80,
    )
    assert snap.lag_seconds() >= 30
    service.metrics.shard_memory("s-0", unflushed=10, frozen_count=1, active=5, index=0)
    lines = series(service, topic, "s-0")
    assert any(line.startswith("lance_sink_commit_lag_messages{") for line in lines)
    assert any(line.startswith("lance_sink_writer_poisoned{") for line in lines)
    assert any(line.startswith("lance_sink_wal_unflushed_bytes{") for line in lines)

    service.lifecycle.release(state, flush=False)  # revoked: no series stays at its last value
    assert series(service, topic, "s-0") == []


def test_a_failed_open_is_named_briefly_in_readiness_and_status(
    service: SinkService, topic: str
) -> None:
    """Lance's errors carry a multi-line Rust Debug dump: /readyz and /v1/status repeated
    ~1.5 KB of it per partition. They carry its first line now; the log keeps it all."""
    state = PartitionState(topic, 0, -1)
    service.partitions.add(state)
    dump = "LanceError(IO): Generic S3 error: request timed out\n" + "  frame {\n" * 150
    service.lifecycle.open_failed(state, OSError(dump), event="partition_open_failed")
    service.board.publish()
    _, reasons = service.board.readiness()
    (reason,) = [r for r in reasons if r.startswith(f"{topic}[0]")]
    assert reason == (
        f"{topic}[0]: no shard writer (OSError: LanceError(IO): Generic S3 error: request "
        "timed out (the whole error is in the log)), retrying (attempt 2)"
    )
    (entry,) = service.board.status()["partitions"]
    assert "frame" not in str(entry)
    service.lifecycle.open_failed(state, OSError("x" * 1000), event=None)
    assert len(state.open_error or "") < 400
