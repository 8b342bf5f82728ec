"""The shard writer on real Lance tables and real files: durability, visibility, group commit,
seals, flushes, replay, upserts and bad input."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import lance
import pyarrow as pa
import pytest

from engine.backpressure import BlockingValve, ShardMemory
from engine.errors import Backpressure, InvalidRecord, SchemaMismatch
from engine.schema import OP_DELETE
from engine.shard_stats import NoEvents
from engine.table import PROP_SHARD, PROP_WAL_END, flush_properties
from tests.engine.conftest import MakeHarness
from tests.support.engine import Harness, make_batch, source, visible_rows, writer_config

pytestmark = pytest.mark.timeout(120)


def offsets(rows: list[dict[str, object]]) -> list[int]:
    return sorted(int(r["_offset"]) for r in rows)  # type: ignore[call-overload]


def test_put_resolves_when_durable_and_visible(local_harness: MakeHarness) -> None:
    h = local_harness()
    writer = h.open()
    result = writer.put(make_batch(h.spec, 0, 10), source(0, 10)).result(10)
    # Durable: the WAL entry is on disk when the future resolves; visible: in the memtable.
    assert h.storage.exists(writer.wal.key(result.position))
    assert result.rows == 10
    assert offsets(visible_rows(writer)) == list(range(10))
    assert writer.durable_offsets == {("t", 0): 9}
    stats = writer.stats()
    assert stats.durable_position == stats.visible_position == result.position
    writer.close(flush=False)


def test_group_commit_window_means_what_it_says(local_harness: MakeHarness) -> None:
    interval = 0.3
    h = local_harness(config=writer_config(interval_s=interval))
    writer = h.open()
    start = time.monotonic()
    futures = [writer.put(make_batch(h.spec, i * 5, 5), source(i * 5, 5)) for i in range(6)]
    first = futures[0].result(10)
    waited = time.monotonic() - start
    # Everything put inside the window shares one entry, written when the window closes.
    assert {f.result(10).position for f in futures} == {first.position}
    assert interval * 0.9 <= waited < interval + 0.5  # slack for a loaded machine
    time.sleep(interval * 1.2)
    later = writer.put(make_batch(h.spec, 30, 5), source(30, 5)).result(10)
    assert later.position == first.position + 1
    writer.close(flush=False)


def test_buffer_size_closes_the_window_early(local_harness: MakeHarness) -> None:
    h = local_harness(config=writer_config(interval_s=30.0, max_wal_buffer_bytes=1))
    writer = h.open()
    start = time.monotonic()
    writer.put(make_batch(h.spec, 0, 5), source(0, 5)).result(10)
    assert time.monotonic() - start < 5
    writer.close(flush=False)


class SealSizes(NoEvents):
    def __init__(self) -> None:
        self.sealed: list[int] = []

    def memtable_sealed(self, shard: str, generation: int, rows: int, nbytes: int) -> None:
        self.sealed.append(nbytes)


def test_puts_that_outrun_the_wal_are_split_into_bounded_entries(
    local_harness: MakeHarness,
) -> None:
    # A burst of puts far larger than one WAL entry: each entry takes at most what fits in
    # max_wal_buffer_bytes, so memtables seal at their byte limit (overshoot <= one put)
    # instead of swallowing the whole burst, and flushes overlap the WAL appends.
    h = local_harness()
    batch_bytes = make_batch(h.spec, 0, 50).nbytes
    events = SealSizes()
    config = writer_config(
        interval_s=0.2, max_bytes=6 * batch_bytes, max_wal_buffer_bytes=3 * batch_bytes
    )
    writer = h.open(config=config, events=events)
    futures = [writer.put(make_batch(h.spec, i * 50, 50), source(i * 50, 50)) for i in range(40)]
    positions = [f.result(30).position for f in futures]
    per_entry = {p: positions.count(p) for p in positions}
    assert max(per_entry.values()) <= 3, per_entry
    assert positions == sorted(positions)  # entry order is put order
    writer.close(flush=True)
    assert len(events.sealed) >= 40 // 6
    assert max(events.sealed) <= 6 * batch_bytes * 1.2, (events.sealed, batch_bytes)
    assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(40 * 50))


@pytest.mark.parametrize(
    ("limits", "puts"),
    [
        ({"max_rows": 100}, 5),  # rows
        ({"max_bytes": 20_000}, 5),  # bytes
        ({"max_batches": 2}, 5),  # batches (one per WAL entry)
    ],
)
def test_thresholds_seal_and_flush_to_lance(
    local_harness: MakeHarness, limits: dict[str, int], puts: int
) -> None:
    h = local_harness(config=writer_config(**limits))
    writer = h.open()
    for i in range(puts):  # one entry per put: wait for each
        writer.put(make_batch(h.spec, i * 60, 60), source(i * 60, 60)).result(10)
    assert writer.wait_flushed(30)
    stats = writer.stats()
    assert stats.flushes_total >= 1
    assert stats.generation > 1
    base = h.base_rows()
    memtable = visible_rows(writer)
    # Every row is in exactly one tier.
    assert sorted(base.column("_offset").to_pylist() + offsets(memtable)) == list(range(puts * 60))
    tx = h.table.dataset().get_transactions(1)[0]
    assert tx.transaction_properties[PROP_SHARD] == h.shard
    assert int(tx.transaction_properties[PROP_WAL_END]) == stats.flushed_position
    writer.close(flush=False)


class SealGate(BlockingValve):
    """A valve whose `may_seal` answers `allowed` (and counts the questions)."""

    def __init__(self) -> None:
        super().__init__(1 << 40)
        self.allowed = True
        self.asked = 0

    def may_seal(self, shard: ShardMemory) -> bool:
        self.asked += 1
        return self.allowed


def wait_until(condition: Callable[[], bool], timeout: float) -> float:
    """Seconds until `condition` held (polled); fails after `timeout`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_memtable_is_sealed_and_flushed_at_its_max_age(local_harness: MakeHarness) -> None:
    """Rows of a slow partition reach the table `max_age_s` after the memtable's first row,
    without more puts, however far from the size limits; the next memtable's age starts at
    its own first row. A seal the controller refuses waits until it allows one."""
    gate = SealGate()
    h = local_harness(config=writer_config(max_rows=10**6, max_age_s=0.5), controller=gate)
    writer = h.open()
    started = time.monotonic()
    writer.put(make_batch(h.spec, 0, 10), source(0, 10)).result(10)
    # Flushed: in the base, and (after the flush's bookkeeping) out of the memtables.
    wait_until(lambda: h.base_rows().num_rows == 10 and visible_rows(writer) == [], timeout=10)
    assert time.monotonic() - started >= 0.5
    assert writer.stats().generation == 2
    gate.allowed = False
    writer.put(make_batch(h.spec, 10, 5), source(10, 5)).result(10)
    asked = gate.asked
    wait_until(lambda: gate.asked >= asked + 3, timeout=10)  # asked on later wakes too
    assert writer.stats().generation == 2
    assert offsets(visible_rows(writer)) == list(range(10, 15))
    gate.allowed = True
    wait_until(lambda: h.base_rows().num_rows == 15, timeout=10)
    assert writer.stats().generation == 3
    writer.close(flush=False)


def test_without_a_max_age_a_memtable_seals_on_size_only(local_harness: MakeHarness) -> None:
    h = local_harness(config=writer_config(max_rows=10**6))  # max_age_s = 0
    writer = h.open()
    writer.put(make_batch(h.spec, 0, 10), source(0, 10)).result(10)
    time.sleep(1.5)  # three times the age the test above seals at
    assert h.base_rows().num_rows == 0
    assert writer.stats().generation == 1
    writer.close(flush=False)


@pytest.mark.parametrize(
    ("limits", "rows"),
    [
        ({"max_rows": 1000}, 2500),  # one put past max_rows
        ({"max_rows": 1000}, 1000),  # one put that reaches it exactly
        ({"max_bytes": 20_000}, 600),  # past max_bytes
        ({"max_batches": 1}, 10),  # at max_batches (one batch per WAL entry)
    ],
)
def test_a_memtable_that_reaches_a_limit_is_sealed_without_another_put(
    local_harness: MakeHarness, limits: dict[str, int], rows: int
) -> None:
    """A quiet partition: one put takes the active memtable to (or past) a seal limit and
    nothing follows. It is sealed after that insert and flushed, not left to wait for the
    next put or `max_age_s` (0 here: size only)."""
    h = local_harness(config=writer_config(**limits))
    writer = h.open()
    writer.put(make_batch(h.spec, 0, rows), source(0, rows)).result(10)
    wait_until(lambda: h.base_rows().num_rows == rows and visible_rows(writer) == [], 10)
    assert writer.stats().generation == 2
    assert offsets(h.base_rows().to_pylist()) == list(range(rows))
    writer.close(flush=False)


def test_a_full_memtable_whose_seal_was_refused_is_sealed_at_the_next_chance(
    local_harness: MakeHarness,
) -> None:
    """The seal after an insert asks the controller like every live seal; refused, the full
    memtable stays active (the next put needs a seal, so it is refused too) and the WAL
    thread asks again on its wakes; once allowed it is sealed and flushed with no put."""
    gate = SealGate()
    gate.allowed = False
    h = local_harness(config=writer_config(max_rows=1000), controller=gate)
    writer = h.open()
    writer.put(make_batch(h.spec, 0, 2500), source(0, 2500)).result(10)
    asked = gate.asked
    assert asked >= 1  # the seal after the insert asked
    wait_until(lambda: gate.asked >= asked + 2, timeout=10)  # and later wakes ask again
    assert writer.stats().generation == 1
    assert len(visible_rows(writer)) == 2500
    with pytest.raises(Backpressure, match="seal refused"):
        writer.put(make_batch(h.spec, 2500, 1), source(2500, 1))
    gate.allowed = True
    wait_until(lambda: h.base_rows().num_rows == 2500 and visible_rows(writer) == [], 10)
    assert writer.stats().generation == 2
    writer.close(flush=False)


def test_replay_seals_a_memtable_that_an_entry_fills(local_harness: MakeHarness) -> None:
    """Replay uses the same rule (I4): an entry that fills the memtable seals it, and the
    replay flushes it before going on."""
    big = writer_config(max_rows=10**6)
    h = local_harness(config=big)
    writer = h.open()
    writer.put(make_batch(h.spec, 0, 2500), source(0, 2500)).result(10)
    writer.close(flush=False)
    replayer = h.open(config=writer_config(max_rows=1000))
    assert h.base_rows().num_rows == 2500
    assert visible_rows(replayer) == []
    replayer.close(flush=False)


def test_close_with_flush_empties_the_wal(local_harness: MakeHarness) -> None:
    h = local_harness()
    writer = h.open()
    for i in range(3):
        writer.put(make_batch(h.spec, i * 10, 10), source(i * 10, 10)).result(10)
    writer.close(flush=True)
    assert h.base_rows().num_rows == 30
    stats = writer.stats()
    assert stats.frozen_count == 0
    assert stats.flushed_offsets == {("t", 0): 29}
    assert all(p > stats.flushed_position for p in writer.wal.positions())
    manifest = writer.manifests.latest()
    assert manifest.flushed_position == stats.flushed_position
    assert manifest.flushed_offsets == {"t:0": 29}


def test_reopen_replays_without_reappending(local_harness: MakeHarness) -> None:
    h = local_harness()
    first = h.open()
    for i in range(4):
        first.put(make_batch(h.spec, i * 10, 10), source(i * 10, 10)).result(10)
    first.close(flush=False)
    wal_before = first.wal.positions()
    second = h.open()
    assert offsets(visible_rows(second)) == list(range(40))
    assert second.durable_offsets == {("t", 0): 39}
    assert second.epoch == first.epoch + 1
    # Replay re-appends nothing: only the new writer's fence entry was added.
    assert second.wal.positions() == [*wal_before, max(wal_before) + 1]
    assert second.stats().replayed_rows == 40
    assert h.base_rows().num_rows == 0
    second.close(flush=True)
    assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(40))


def test_crash_between_lance_commit_and_manifest_update(local_harness: MakeHarness) -> None:
    """The flush watermark lives in the Lance commit: a crash after the commit but before the
    manifest update must not flush the same rows twice (I3)."""
    h = local_harness()
    writer = h.open()
    for i in range(3):
        writer.put(make_batch(h.spec, i * 10, 10), source(i * 10, 10)).result(10)
    writer.close(flush=False)
    wal_end = max(writer.wal.positions())
    # What the flush would commit, committed exactly as the flush does, then "crash".
    rows = [make_batch(h.spec, 0, 30)]
    props = flush_properties(h.shard, writer.epoch, 1, wal_end, {"t:0": 29})
    h.table.commit_flush([h.spec.to_table_batch(b) for b in rows], None, props)
    assert writer.manifests.latest().flushed_position == 0
    reopened = h.open()
    assert visible_rows(reopened) == []  # not replayed: the commit covers it
    assert reopened.durable_offsets == {("t", 0): 29}
    assert reopened.manifests.latest().flushed_position == wal_end
    reopened.put(make_batch(h.spec, 30, 5), source(30, 5)).result(10)
    reopened.close(flush=True)
    assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(35))


def test_upsert_newest_wins_and_deletes_apply(local_harness: MakeHarness) -> None:
    h = local_harness(mode="upsert")
    writer = h.open()

    def key(o: int) -> str:
        return f"k{o % 10}"

    writer.put(make_batch(h.spec, 0, 10, key_of=key), source(0, 10)).result(10)
    # k0..k4 updated (offsets 10..14), k5 deleted (offset 15).
    writer.put(make_batch(h.spec, 10, 6, key_of=key, deletes={15}), source(10, 6)).result(10)
    live = {r["id"]: r["n"] for r in visible_rows(writer)}
    assert live == {f"k{i}": (10 + i if i < 5 else i) for i in range(10) if i != 5}
    writer.close(flush=True)
    base = {r["id"]: r["n"] for r in h.base_rows().to_pylist()}
    assert base == live
    # After the flush: a newer version in the memtable, a delete of a flushed key.
    again = h.open()
    again.put(make_batch(h.spec, 20, 2, key_of=key, deletes={21}), source(20, 2)).result(10)
    again.close(flush=True)
    final = {r["id"]: r["n"] for r in h.base_rows().to_pylist()}
    assert final == {**{k: v for k, v in live.items() if k != "k1"}, "k0": 20}


def test_delete_then_reinsert_in_one_entry(local_harness: MakeHarness) -> None:
    h = local_harness(mode="upsert", config=writer_config(interval_s=0.2))
    writer = h.open()
    writer.put(make_batch(h.spec, 0, 1, key_of=lambda o: "a"), source(0, 1)).result(10)
    f1 = writer.put(make_batch(h.spec, 1, 1, key_of=lambda o: "a", deletes={1}), source(1, 1))
    f2 = writer.put(make_batch(h.spec, 2, 1, key_of=lambda o: "a"), source(2, 1))
    assert f1.result(10).position == f2.result(10).position
    assert [r["n"] for r in visible_rows(writer)] == [2]
    writer.close(flush=True)
    assert h.base_rows().to_pylist()[0]["n"] == 2
    assert h.base_rows().num_rows == 1


def test_bad_batches_fail_typed_and_the_writer_stays_healthy(local_harness: MakeHarness) -> None:
    h = local_harness(mode="upsert")
    writer = h.open()
    good = make_batch(h.spec, 0, 5)
    entries = writer.stats().wal_entries_total

    wrong_schema = good.drop_columns(["text"])
    with pytest.raises(InvalidRecord) as info:
        writer.put(wrong_schema, source(0, 5))
    assert info.value.column == "text"

    vec_idx = good.schema.get_field_index("vec")
    short = pa.FixedSizeListArray.from_arrays(pa.array([0.0] * 5 * 3, pa.float32()), 3)
    wrong_dim = good.set_column(vec_idx, pa.field("vec", short.type), short)
    with pytest.raises(InvalidRecord) as info:
        writer.put(wrong_dim, source(0, 5))
    assert info.value.column == "vec"

    ids = pa.array(["a", "b", None, "d", "e"], pa.string())
    null_key = good.set_column(0, good.schema.field(0), ids)
    with pytest.raises(InvalidRecord) as info:
        writer.put(null_key, source(0, 5))
    assert (info.value.column, info.value.row) == ("id", 2)

    values = pa.array([0.0] * 5 * 8, pa.float32()).to_numpy(zero_copy_only=False).copy()
    values[3 * 8 + 1] = float("nan")
    nan_vec = pa.FixedSizeListArray.from_arrays(pa.array(values), 8)
    with_nan = good.set_column(vec_idx, good.schema.field(vec_idx), nan_vec)
    with pytest.raises(InvalidRecord) as info:
        writer.put(with_nan, source(0, 5))
    assert (info.value.column, info.value.row) == ("vec", 3)

    # Nothing of those batches became durable or visible; a good put still works.
    assert writer.stats().wal_entries_total == entries
    assert visible_rows(writer) == []
    writer.put(good, source(0, 5)).result(10)
    assert len(visible_rows(writer)) == 5
    assert writer.poisoned is None
    writer.close(flush=False)


def test_delete_rows_may_leave_non_key_columns_null(local_harness: MakeHarness) -> None:
    h = local_harness(mode="upsert")
    writer = h.open()
    schema = h.spec.batch_schema
    delete = pa.RecordBatch.from_pylist(
        [{"id": "x", "_op": OP_DELETE, "_topic": "t", "_partition": 0, "_offset": 0}],
        schema=schema,
    )
    writer.put(delete, source(0, 1)).result(10)
    assert visible_rows(writer) == []
    writer.close(flush=True)
    assert h.base_rows().num_rows == 0


def test_schema_mismatch_on_open(tmp_path: Path) -> None:
    uri = str(tmp_path / "table.lance")
    lance.write_dataset(pa.table({"id": pa.array([1, 2])}), uri)
    with pytest.raises(SchemaMismatch, match="'id'"):
        Harness(uri, str(tmp_path / "wal"))


def _os_thread_names() -> set[str]:
    return {(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()}


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux: OS thread names")
def test_the_wal_and_flush_threads_carry_os_names(local_harness: MakeHarness) -> None:
    """`top -H` and per-thread CPU tell the WAL workers, their timer and the flushes from the
    rest of the process (every Python thread otherwise carries the interpreter's name)."""
    h = local_harness(config=writer_config(max_rows=50))
    writer = h.open()
    for i in range(2):
        writer.put(make_batch(h.spec, i * 60, 60), source(i * 60, 60)).result(10)
    assert writer.wait_flushed(30)
    assert writer.stats().flushes_total >= 1
    assert {"wal_0", "wal_timer", "flush_0"} <= _os_thread_names()
    writer.close(flush=False)
