"""SIGKILL a writer process at random instants (replay, puts, seals, flushes), restart it
after the last durable offset, and check exactly-once after every crash (I3) — on a local
folder and on S3 (moto)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from engine.manifest import ManifestStore
from tests.support.engine import Harness, visible_rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def run_until_killed(
    table: str, wal: str, start: int, options: dict[str, str] | None, delay: float
) -> tuple[int, int]:
    """Start the child at `start`, SIGKILL it `delay` s after it is ready.

    Returns (durable offset it reported at start, last acknowledged offset)."""
    args = [sys.executable, "-m", "tests.support.engine_child", table, wal, str(start), "150"]
    if options:
        args.append(json.dumps(options))
    proc = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    assert ready.startswith("READY "), ready
    acked = [-1]

    def read_acks() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("ACK "):
                acked[0] = int(line.split()[1])

    reader = threading.Thread(target=read_acks, daemon=True)
    reader.start()
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    reader.join(10)
    proc.stdout.close()
    return int(ready.split()[1]), acked[0]


def check_exactly_once(h: Harness, acked: int) -> int:
    """Open the shard (replay), check every acknowledged offset is present exactly once and
    nothing beyond the durable offset exists; returns the durable offset."""
    writer = h.open()
    try:
        view = writer.view()
        base = h.table.dataset()
        offsets = base.to_table(columns=["_offset"]).column("_offset").to_pylist()
        offsets += [int(r["_offset"]) for r in visible_rows(view, base=base)]
        durable = writer.durable_offsets.get(("t", 0), -1)
    finally:
        writer.close(flush=False)
    assert durable >= acked, "an acknowledged offset is not durable"
    assert sorted(offsets) == list(range(durable + 1)), "lost or duplicated offsets"
    return durable


def crash_loop(table: str, wal: str, options: dict[str, str] | None, rounds: int) -> None:
    rng = random.Random(7)
    h = Harness(table, wal, storage_options=options)
    try:
        resume = 0
        for _ in range(rounds):
            reported, acked = run_until_killed(table, wal, resume, options, rng.uniform(0.05, 1.2))
            assert reported == resume - 1  # the child replayed to the same durable offset
            resume = check_exactly_once(h, acked) + 1
        assert resume > 500, "the children made too little progress to prove anything"
        final = h.open()
        final.close(flush=True)
        assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(resume))
    finally:
        h.flusher.shutdown()


def test_sigkill_at_random_instants_local(tmp_path: Path) -> None:
    crash_loop(str(tmp_path / "table.lance"), str(tmp_path / "wal"), None, rounds=8)


@pytest.mark.s3
def test_sigkill_at_random_instants_s3(s3_bucket: str, s3_storage_options: dict[str, str]) -> None:
    prefix = f"s3://{s3_bucket}/{uuid.uuid4().hex[:8]}"
    crash_loop(f"{prefix}/table.lance", f"{prefix}/wal", s3_storage_options, rounds=5)


@pytest.mark.parametrize("kill_at", ["commit", "manifest"])
def test_sigkill_between_a_coalesced_commit_and_the_shard_manifests(
    tmp_path: Path, kill_at: str
) -> None:
    """Several shards' flushes in one Lance commit, the process SIGKILLed right after it
    (`commit`: no manifest records it; `manifest`: one does): on reopen every shard finds
    its own mark in the commit, replays nothing it covers, and every row is in the table
    exactly once (I3)."""
    table, wal = str(tmp_path / "table.lance"), str(tmp_path / "wal")
    shards, rows = 4, 30
    args = [sys.executable, "-m", "tests.support.coalesce_child", table, wal]
    proc = subprocess.Popen(
        [*args, str(shards), str(rows), kill_at],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, out
    lines = out.split("\n")
    assert "READY" in lines
    committed = [line.split() for line in lines if line.startswith("COMMITTED ")]
    assert len(committed) == 1
    assert int(committed[0][2]) == shards  # every shard in the one commit
    version = int(committed[0][1])
    manifested = [line.split()[1] for line in lines if line.startswith("MANIFEST ")]
    assert len(manifested) == (1 if kill_at == "manifest" else 0)

    h = Harness(table, wal)
    try:
        ds = h.table.dataset()
        assert int(ds.version) == version  # the process died before any other commit
        for p in range(shards):
            shard = f"t-{p}-test"
            recorded = ManifestStore(h.storage, shard).latest().lance_version
            assert (recorded == version) == (shard in manifested)
        for p in range(shards):
            writer = h.open(shard=f"t-{p}-test")
            assert writer.stats().replayed_rows == 0  # the commit covers the whole WAL
            assert writer.durable_offsets == {("t", p): rows - 1}
            assert writer.manifests.latest().lance_version == version
            writer.close(flush=True)
        assert h.table.latest_version() == version  # nothing flushed a second time
        got = h.base_rows().select(["_partition", "_offset"]).to_pylist()
        pairs = sorted((r["_partition"], r["_offset"]) for r in got if r["_partition"] != 99)
        assert pairs == [(p, o) for p in range(shards) for o in range(rows)]
    finally:
        h.flusher.shutdown()
