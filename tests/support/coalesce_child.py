"""Shard writers of one table in their own process, for the coalesced-flush crash test: they
flush together in one multi-shard Lance commit and the process SIGKILLs itself right after
it, before the shard manifests record it (or after the first of them does).

    python -m tests.support.coalesce_child TABLE_URI WAL_URI SHARDS ROWS KILL_AT

Opens shards `t-<p>-test` (p < SHARDS), puts ROWS rows of source offsets 0.. into each
(topic t, partition p), prints `READY`, then flushes a warm-up shard alone (so the pacing
holds the next round back) and seals every shard. The multi-shard commit prints
`COMMITTED <version> <shards>`; KILL_AT `commit` kills the process then, `manifest` after
the next shard manifest update (printing `MANIFEST <shard>`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from engine.coalesce import CoalesceLimits
from engine.manifest import ManifestStore, ShardManifest
from engine.table import PROP_SHARDS, BaseTable, commit_records
from sink.log import configure_logging
from tests.support.engine import Harness, make_batch, source, writer_config


def main() -> None:
    table_uri, wal_uri = sys.argv[1], sys.argv[2]
    shards, rows, kill_at = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    configure_logging("warning", "json")  # logs to stderr; stdout carries the markers
    armed = [False]
    real_commit = BaseTable.commit_flush
    real_advance = ManifestStore.advance

    def commit_then_die(self: BaseTable, *args: Any, **kwargs: Any) -> int:
        version = real_commit(self, *args, **kwargs)
        props = args[2]
        if PROP_SHARDS in props:
            print(f"COMMITTED {version} {len(commit_records(props))}", flush=True)
            if kill_at == "commit":
                os.kill(os.getpid(), signal.SIGKILL)
            armed[0] = True
        return version

    one_at_a_time = threading.Lock()  # the shards' manifests advance on several threads

    def advance_then_die(self: ManifestStore, *args: Any, **kwargs: Any) -> ShardManifest:
        with one_at_a_time:
            manifest = real_advance(self, *args, **kwargs)
            if armed[0]:
                print(f"MANIFEST {self.shard}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return manifest

    BaseTable.commit_flush = commit_then_die  # type: ignore[method-assign]
    ManifestStore.advance = advance_then_die  # type: ignore[method-assign]
    h = Harness(
        table_uri,
        wal_uri,
        config=writer_config(max_rows=rows * 10),
        coalesce=CoalesceLimits(max_commits_per_s=0.5),
    )
    writers = [h.open(shard=f"t-{p}-test") for p in range(shards)]
    for p, writer in enumerate(writers):
        for first in range(0, rows, 10):
            count = min(10, rows - first)
            batch = make_batch(h.spec, first, count, partition=p)
            writer.put(batch, source(first, count, partition=p)).result(30)
    print("READY", flush=True)
    warm = h.open(shard="warm-up")
    warm.put(make_batch(h.spec, 0, 1, partition=99), source(0, 1, partition=99)).result(30)
    warm.seal()
    assert warm.wait_flushed(30)
    for writer in writers:
        writer.seal()
    time.sleep(60)  # the parent fails the test if the kill did not come


if __name__ == "__main__":
    main()
