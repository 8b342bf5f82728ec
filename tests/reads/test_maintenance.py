"""Base-table maintenance on real Lance tables with live writers: each index is created,
indexes are optimised, small fragments compacted, old versions cleaned without deleting
what a shard's crash-window search needs, and the reader's answers never change."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pytest

from config.settings import MaintenanceSettings
from engine.maintenance import Maintenance, MaintenanceProcess
from engine.maintenance.runner import (
    MAX_INDEX_SEGMENTS,
    MAX_TRAINING_BYTES,
    PQ_SAMPLE_RATE,
    derived_partitions,
    derived_sub_vectors,
    is_conflict,
    training_sample_rate,
)
from engine.manifest import ManifestStore
from engine.reader import ReaderSettings
from engine.shard import ShardWriter
from engine.table import flush_properties
from tests.reads.conftest import ReadHarness, rows_batch, vectors, wait_for

pytestmark = pytest.mark.timeout(180)

MakeHarness = Callable[..., ReadHarness]


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def ran(self, task: str, outcome: str, seconds: float) -> None:
        assert seconds >= 0
        self.events.append((task, outcome))

    def process_exited(self, exitcode: int | None) -> None:
        self.events.append(("process_exited", str(exitcode)))


def maintenance_settings(**settings: Any) -> MaintenanceSettings:
    values: dict[str, Any] = {
        "vector_index_min_rows": 600,
        "optimize_unindexed_rows": 50,
        "compact_min_fragments": 4,
        "cleanup_retention_s": 3600,
        **settings,
    }
    return MaintenanceSettings(**values)


def maintenance(h: ReadHarness, events: Recorder | None = None, **settings: Any) -> Maintenance:
    return Maintenance(
        h.spec,
        h.table,
        h.storage,
        maintenance_settings(**settings),
        events,
        min_retained_versions=2,
    )


class Distances:
    """kNN distances, equal to others within float32 rounding: an unindexed fragment's rows
    are ranked by faiss, indexed ones by Lance, and the two round differently."""

    def __init__(self, values: list[float]) -> None:
        self.values = values

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Distances)
            and len(self.values) == len(other.values)
            and bool(np.allclose(self.values, other.values, rtol=1e-5, atol=1e-5))
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Distances({self.values})"


def answers(h: ReadHarness) -> tuple[Any, ...]:
    """What the reader returns for a fixed set of queries (compared before and after)."""
    r = h.reader
    q = vectors(np.array([5]), 16)[0]
    offsets = [1, 640, 700, 99]
    keys: list[Any] = (
        [f"k{o}" for o in offsets] if h.spec.upsert else [("t", 0, o) for o in offsets]
    )
    return (
        sorted(r.scan(columns=["id", "_offset"], limit=1000).to_pylist(), key=str),
        # Distances, not ids: rows at equal distance may come back in either order. Every
        # partition probed and every candidate re-ranked exactly (k x refine > rows): an
        # index built on these few rows (1 PQ sub-vector) misses a neighbour now and then
        # with less, which would be the index's approximation, not maintenance changing rows.
        Distances(
            r.search_vector(q, k=5, columns=["id"], nprobes=64, refine_factor=1000)
            .column("_distance")
            .to_pylist()
        ),
        sorted(r.search_text("row12 row650", k=5, columns=["id"]).column("id").to_pylist()),
        sorted(r.lookup(keys, columns=["id"]).column("id").to_pylist()),
        sorted(r.scan(filter="n >= 600", columns=["id"]).column("id").to_pylist()),
    )


def test_derived_index_parameters() -> None:
    assert derived_sub_vectors(384) == 24
    assert derived_sub_vectors(16) == 1
    assert derived_sub_vectors(100) == 5
    assert derived_partitions(1_000_000) == 1000
    assert derived_partitions(600) == 2
    assert derived_partitions(10) == 1
    # The training sample stays within MAX_TRAINING_BYTES (Lance's 256 per partition below).
    assert training_sample_rate(2, 16) == 256
    assert training_sample_rate(548, 384) == 79  # sqrt(300k) partitions
    assert MAX_TRAINING_BYTES >= 548 * 79 * 384 * 4
    assert training_sample_rate(100_000, 1536) == 16  # never below MIN_SAMPLE_RATE
    # IVF_PQ: Lance trains each sub-vector's 256 codes on 256 x sample_rate rows; bounded
    # (PQ_SAMPLE_RATE), that training is a third of the build it was (bench/index_build.py).
    assert training_sample_rate(2, 16, pq=True) == PQ_SAMPLE_RATE == 40
    assert training_sample_rate(195, 384, pq=True) == 40  # sqrt(50k) partitions: was 224
    assert training_sample_rate(100_000, 1536, pq=True) == 16
    assert is_conflict(OSError("Retryable commit conflict for version 7"))
    assert not is_conflict(ValueError("no such column"))


def test_creates_each_index_and_answers_do_not_change(make_harness: MakeHarness) -> None:
    h = make_harness(mode="upsert")
    w = h.open()
    h.put(w, range(300))
    m = maintenance(h)
    early = m.run_once()  # nothing flushed yet: nothing to index
    assert early["vector_index"] == early["fts_index"] == early["key_index"] == "skipped"
    h.put(w, range(300, 700))
    h.flush(w)
    h.put(w, range(700, 720))  # and some fresh rows
    h.put(w, [720], key_of=lambda o: "k640", version=3)  # an update of a flushed key
    before = answers(h)
    events = Recorder()
    m = maintenance(h, events)
    outcomes = m.run_once()
    assert outcomes["vector_index"] == "done"
    assert outcomes["fts_index"] == "done"
    assert outcomes["key_index"] == "done"
    types = {str(i.type_url).rsplit(".", 1)[-1] for i in h.table.dataset().describe_indices()}
    assert {"InvertedIndexDetails", "BTreeIndexDetails"} <= types
    assert len(types) == 3  # plus the vector index
    assert answers(h) == before
    assert ("vector_index", "done") in events.events
    # A second run has nothing to create.
    again = m.run_once()
    assert again["vector_index"] == again["fts_index"] == again["key_index"] == "skipped"


def test_ivf_pq_waits_for_the_rows_it_trains_on(make_harness: MakeHarness) -> None:
    """With `vector_index_min_rows` below 256, IVF_PQ is not built on fewer rows than its
    codebooks train on (Lance would make an index of no row, and the task would never run
    again: the column has an index); from 256 rows on it is, and holds them all."""
    h = make_harness()
    w = h.open()
    h.put(w, range(200))
    h.flush(w)
    m = maintenance(h, vector_index_min_rows=10, fts_index=False)
    assert m.run_once()["vector_index"] == "skipped"
    assert all(i.field_names != ["vec"] for i in h.table.dataset().describe_indices())
    h.put(w, range(200, 300))
    h.flush(w)
    assert m.run_once()["vector_index"] == "done"
    ds = h.table.dataset()
    (index,) = [i for i in ds.describe_indices() if i.field_names == ["vec"]]
    assert ds.stats.index_stats(index.name)["num_indexed_rows"] == 300


@pytest.mark.parametrize(("kind", "rate"), [("IVF_PQ", PQ_SAMPLE_RATE), ("IVF_HNSW_SQ", 256)])
def test_the_vector_index_trains_its_pq_codebooks_on_a_bounded_sample(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch, kind: str, rate: int
) -> None:
    """IVF_PQ's build asks Lance for at most `PQ_SAMPLE_RATE` training rows per code (Lance's
    256 trained the codebooks on 65,536 rows, most of a first build's time); IVF_HNSW_SQ,
    whose training is cheap, keeps Lance's rate. The index is built and holds every row."""
    asked: list[dict[str, Any]] = []
    create = lance.LanceDataset.create_index

    def spy(ds: lance.LanceDataset, *args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs)
        return create(ds, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "create_index", spy)
    h = make_harness()
    w = h.open()
    h.put(w, range(300))
    h.flush(w)
    m = maintenance(h, vector_index_min_rows=10, fts_index=False, vector_index=kind)
    assert m.run_once()["vector_index"] == "done"
    assert [a["sample_rate"] for a in asked] == [rate]
    ds = h.table.dataset()
    (index,) = [i for i in ds.describe_indices() if i.field_names == ["vec"]]
    assert ds.stats.index_stats(index.name)["num_indexed_rows"] == 300


@pytest.mark.parametrize(("kind", "rows"), [("IVF_PQ", 300), ("IVF_HNSW_SQ", 10)])
def test_a_vector_index_built_on_few_rows_answers_as_before(
    make_harness: MakeHarness, kind: str, rows: int
) -> None:
    """With `vector_index_min_rows` below 256, the first index is built on a small base
    (IVF_PQ once it has the 256 rows its codebooks train on, IVF_HNSW_SQ at once): it holds
    every row, and a kNN query right after finds the same rows at the same distances as the
    exact search before. Every partition probed and every candidate re-ranked exactly, as in
    `answers`: with the reader's defaults (20 probes, refine 10) an IVF_PQ of one 8-bit code
    per 16 floats missed a top-10 row in 3 of 8 runs, which is the index's approximation."""
    h = make_harness()
    w = h.open()
    h.put(w, range(rows))
    h.flush(w)
    queries = vectors(np.arange(10_000, 10_020), 16)

    def knn() -> list[tuple[set[int], Distances]]:
        out = []
        for q in queries:
            found = h.reader.search_vector(
                q, k=10, columns=["_offset"], nprobes=64, refine_factor=1000
            )
            out.append(
                (
                    set(found.column("_offset").to_pylist()),
                    Distances(found["_distance"].to_pylist()),
                )
            )
        return out

    before = knn()
    m = maintenance(h, vector_index_min_rows=10, fts_index=False, vector_index=kind)
    assert m.run_once()["vector_index"] == "done"
    ds = h.table.dataset()
    (index,) = [i for i in ds.describe_indices() if i.field_names == ["vec"]]
    assert ds.stats.index_stats(index.name)["num_indexed_rows"] == rows
    assert knn() == before


def test_scalar_indexes_on_filter_columns_keep_filtered_answers(
    make_harness: MakeHarness,
) -> None:
    """BITMAP and BTREE indexes are built on the configured columns (also a column with an
    INVERTED index), once; filtered queries return the same rows with them."""
    h = make_harness()
    w = h.open()
    h.put(w, range(700))
    h.flush(w)
    h.put(w, range(700, 760))

    def filtered() -> tuple[Any, ...]:
        q = vectors(np.array([5]), 16)[0]
        return (
            h.reader.scan(filter="n < 300 AND flag", columns=["_offset"], limit=1000)
            .column("_offset")
            .to_pylist(),
            h.reader.search_vector(q, k=10, filter="f >= 40.5", columns=["_offset"])
            .column("_offset")
            .to_pylist(),
            h.reader.search_text("alpha", k=20, filter="flag", columns=["_offset"])
            .column("_offset")
            .to_pylist(),
        )

    assert maintenance(h).run_once()["scalar_indexes"] == "skipped"  # none configured
    before = filtered()
    wanted = {"n": "BTREE", "flag": "BITMAP", "text": "BTREE"}
    m = maintenance(h, scalar_indexes=wanted)
    assert m.run_once()["scalar_indexes"] == "done"
    kinds = {
        (tuple(i.field_names), str(i.type_url).rsplit(".", 1)[-1])
        for i in h.table.dataset().describe_indices()
    }
    assert {
        (("n",), "BTreeIndexDetails"),
        (("flag",), "BitmapIndexDetails"),
        (("text",), "BTreeIndexDetails"),
        (("text",), "InvertedIndexDetails"),
    } <= kinds
    assert filtered() == before
    assert m.run_once()["scalar_indexes"] == "skipped"


def test_optimize_indices_past_the_threshold(make_harness: MakeHarness) -> None:
    h = make_harness()
    w = h.open()
    h.put(w, range(700))
    h.flush(w)
    m = maintenance(h)
    assert m.run_once()["vector_index"] == "done"
    assert m.unindexed_rows() == 0
    h.put(w, range(700, 730))
    h.flush(w)
    assert m.run_once()["optimize_indices"] == "skipped"  # 30 < 50
    assert m.unindexed_rows() == 30
    h.put(w, range(730, 800))
    h.flush(w)
    before = answers(h)
    assert m.run_once()["optimize_indices"] == "done"
    assert m.unindexed_rows() == 0
    assert answers(h) == before


def segments(h: ReadHarness) -> dict[str, int]:
    return {i.name: len(i.segments) for i in h.table.dataset().describe_indices()}


def test_optimize_adds_segments_then_merges_them(make_harness: MakeHarness) -> None:
    h = make_harness()
    w = h.open()
    h.put(w, range(700))
    h.flush(w)
    m = maintenance(h)
    m.run_once()
    assert set(segments(h).values()) == {1}
    first = 700
    for n in range(2, MAX_INDEX_SEGMENTS + 1):
        h.put(w, range(first, first + 60))
        h.flush(w)
        first += 60
        before = answers(h)
        m.optimize_indices()
        assert m.unindexed_rows() == 0
        # Only the new rows were indexed, as one more segment of every index.
        assert set(segments(h).values()) == {n}
        assert answers(h) == before
    h.put(w, range(first, first + 60))
    h.flush(w)
    before = answers(h)
    m.optimize_indices()
    assert m.unindexed_rows() == 0
    assert set(segments(h).values()) == {1}  # merged: bounded segments per query
    assert answers(h) == before


def test_the_thread_optimizes_between_full_runs(make_harness: MakeHarness) -> None:
    h = make_harness()
    w = h.open()
    h.put(w, range(700))
    h.flush(w)
    events = Recorder()
    m = maintenance(h, events, interval_s=3600, optimize_interval_s=1)
    m.run_once()
    full_run = len(events.events)
    h.put(w, range(700, 800))
    h.flush(w)
    m.start()
    try:
        deadline = time.monotonic() + 30
        while not {("optimize_indices", "done"), ("optimize_vector_index", "done")} <= set(
            events.events[full_run:]
        ):
            assert time.monotonic() < deadline, events.events
            time.sleep(0.05)
    finally:
        m.stop()
    ds = h.table.dataset()
    assert all(i.num_rows_indexed == ds.count_rows() for i in ds.describe_indices())
    # Only the optimize tasks ran in between (the creations found their indexes): the
    # full run is an hour away.
    between = events.events[full_run:]
    assert {t for t, o in between if o != "skipped"} == {
        "optimize_indices",
        "optimize_vector_index",
    }
    assert {t for t, _ in between} <= {
        "optimize_indices",
        "optimize_vector_index",
        "vector_index",
        "fts_index",
        "key_index",
        "scalar_indexes",
    }


def test_the_indexes_are_built_at_the_first_tick_after_the_first_flush(
    make_harness: MakeHarness,
) -> None:
    # They were built by the full runs only: with a table empty at the first one, its text
    # index waited `interval_s` (30 s by default) while every text query tokenised the
    # whole base, and a first vector index build held the text index back while it ran.
    h = make_harness()
    w = h.open()
    events = Recorder()
    m = maintenance(h, events, interval_s=3600, optimize_interval_s=1)
    m.set_active(True)
    m.start()
    try:
        time.sleep(1.5)  # a tick or two on the empty table: nothing to index yet
        h.put(w, range(700))
        h.flush(w)
        deadline = time.monotonic() + 30
        while not {("fts_index", "done"), ("vector_index", "done")} <= set(events.events):
            assert time.monotonic() < deadline, events.events
            time.sleep(0.05)
    finally:
        m.stop()
    ds = h.table.dataset()
    kinds = {str(i.type_url).rsplit(".", 1)[-1] for i in ds.describe_indices()}
    assert any("Inverted" in k for k in kinds), kinds
    assert not {"compact", "cleanup"} & {t for t, _ in events.events}  # no full run


def test_compaction_merges_small_fragments(make_harness: MakeHarness) -> None:
    h = make_harness(mode="upsert")
    w = h.open()
    for first in range(0, 700, 100):
        h.put(w, range(first, first + 100))
        h.flush(w)
    h.put(w, range(700, 720), key_of=lambda o: f"k{o - 700}", version=2)  # fresh updates
    assert len(h.table.dataset().get_fragments()) >= 4
    before = answers(h)
    m = maintenance(h, vector_index_min_rows=10_000, fts_index=False)
    assert m.run_once()["compact"] == "done"
    assert len(h.table.dataset().get_fragments()) == 1
    assert answers(h) == before
    assert m.run_once()["compact"] == "skipped"


def test_compaction_rewrites_a_fragment_an_upsert_left_a_tenth_deleted(
    make_harness: MakeHarness,
) -> None:
    """Upserts and deletes of flushed keys leave deleted rows in their fragments: storage,
    scan time and, with a text index, BM25 statistics that still count them. A fragment
    with a tenth of its rows deleted is compacted whatever the number of small fragments;
    before, such a fragment was rewritten only if `compact_min_fragments` small ones
    happened to be there."""
    h = make_harness(mode="upsert")
    w = h.open()
    h.put(w, range(1000))
    h.flush(w)
    h.index_text()
    h.put(w, range(1000, 1150), key_of=lambda o: f"k{o - 1000}", version=2)  # 15 % of them
    h.flush(w)
    deleted = [f.metadata.num_deletions for f in h.table.dataset().get_fragments()]
    assert deleted == [150, 0]
    before = answers(h)
    m = maintenance(h, vector_index_min_rows=10_000, compact_min_fragments=100)
    assert m.run_once()["compact"] == "done"
    fragments = h.table.dataset().get_fragments()
    assert [f.metadata.num_deletions for f in fragments] == [0] * len(fragments)
    assert answers(h) == before
    assert m.run_once()["compact"] == "skipped"


def test_compaction_that_merges_nothing_is_skipped(make_harness: MakeHarness) -> None:
    """Lance compacts indexed and unindexed fragments apart: a run over small fragments it
    cannot merge rewrites nothing (no commit), and reports ``skipped``, not ``done``
    (``done`` and the `table_compacted` line would claim a compaction that never was)."""
    h = make_harness(mode="upsert")
    w = h.open()
    for first in range(0, 200, 100):
        h.put(w, range(first, first + 100))
        h.flush(w)
    events = Recorder()
    m = maintenance(
        h,
        events,
        vector_index_min_rows=10_000,
        fts_index=False,
        compact_min_fragments=2,
        optimize_unindexed_rows=10_000,  # the next fragment stays out of the key index
    )
    outcomes = m.run_once()
    assert outcomes["key_index"] == "done"
    assert outcomes["compact"] == "done"  # the two indexed fragments, into one
    h.put(w, range(200, 300))
    h.flush(w)
    fragments = h.table.dataset().get_fragments()
    assert len(fragments) == 2  # indexed and unindexed: Lance merges neither into the other
    version = h.table.latest_version()
    assert m.run_once()["compact"] == "skipped"
    assert h.table.latest_version() == version
    assert ("compact", "done") in events.events
    assert events.events[-2:] == [("compact", "skipped"), ("cleanup", "skipped")]


def test_cleanup_keeps_what_a_shard_replay_needs(make_harness: MakeHarness) -> None:
    """A flush commit whose shard manifest does not record it yet (the crash window) pins
    itself and every newer version; versions below it are deleted once old enough."""
    h = make_harness()
    w = h.open()
    for first in range(0, 40, 10):
        h.put(w, range(first, first + 10))
        h.flush(w)
    # A crash-window flush of another shard: committed, never recorded in its manifest.
    batch = h.spec.to_table_batch(rows_batch(h.spec, list(range(1000, 1005)), partition=9))
    ghost = h.table.commit_flush([batch], None, flush_properties("ghost", 1, 1, 7, {"t:9": 1004}))
    assert ManifestStore(h.storage, "ghost").latest().lance_version == 0
    for first in range(40, 80, 10):
        h.put(w, range(first, first + 10))
        h.flush(w)
    latest = h.table.latest_version()
    time.sleep(1.2)
    m = maintenance(
        h,
        cleanup_retention_s=1,
        fts_index=False,
        vector_index_min_rows=10_000,
        compact_min_fragments=100,
    )
    assert m.cleanup_candidates() == list(range(1, ghost))
    assert m.run_once()["cleanup"] == "done"
    versions = [v["version"] for v in h.table.dataset().versions()]
    assert versions == list(range(ghost, latest + 1))
    mark = h.table.find_flush("ghost", 0)  # replay of "ghost" still finds its flush
    assert mark is not None
    assert mark.version == ghost
    # Our own shard's flushes are recorded in its manifest: they never pin anything.
    assert m.run_once()["cleanup"] == "skipped"
    assert h.reader.scan(columns=["_offset"]).num_rows == 85


def test_cleanup_and_flushes_pass_a_compaction_of_indexed_fragments(
    make_harness: MakeHarness,
) -> None:
    """pylance cannot decode the Rewrite transaction of a compaction over indexed fragments
    (TypeError): cleanup reads past it, and the next flush of the shard succeeds."""
    h = make_harness()
    w = h.open()
    for first in range(0, 60, 10):
        h.put(w, range(first, first + 10))
        h.flush(w)
    m = maintenance(h, cleanup_retention_s=1, compact_min_fragments=4)
    outcomes = m.run_once()
    assert outcomes["compact"] == "done"
    ds = h.table.dataset()
    assert ds.describe_indices()
    with pytest.raises(TypeError, match="RewrittenIndex"):
        ds.get_transactions(3)
    h.put(w, range(60, 70))
    h.flush(w)
    assert w.stats().flush_failures_total == 0
    time.sleep(1.2)
    assert m.run_once()["cleanup"] == "done"
    assert h.reader.scan(columns=["_offset"]).num_rows == 70


def test_cleanup_respects_the_retention(make_harness: MakeHarness) -> None:
    h = make_harness()
    w = h.open()
    for first in range(0, 50, 10):
        h.put(w, range(first, first + 10))
        h.flush(w)
    m = maintenance(h, cleanup_retention_s=3600)
    assert m.cleanup_candidates() == []
    assert m.run_once()["cleanup"] == "skipped"
    assert len(h.table.dataset().versions()) == h.table.latest_version()


@pytest.mark.slow
def test_reads_stay_correct_while_maintenance_runs_during_ingestion(
    make_harness: MakeHarness,
) -> None:
    """Ingest (with flushes), query and maintain at once: every acknowledged offset is
    visible exactly once in every scan, and the vector index, FTS index and compaction all
    happen meanwhile."""
    h = make_harness(max_rows=150, settings=ReaderSettings(max_k=10_000))
    w = h.open()
    h.put(w, range(700))
    h.flush(w)
    acked = 700
    stop = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        nonlocal acked
        try:
            while not stop.is_set() and acked < 3000:
                h.put(w, range(acked, acked + 25))
                acked += 25
        except BaseException as exc:
            errors.append(exc)

    events = Recorder()
    m = maintenance(h, events, compact_min_fragments=3, interval_s=1)
    producer = threading.Thread(target=produce)
    producer.start()
    m.start()
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            floor = acked
            got = h.reader.scan(columns=["_offset"], limit=5000).column("_offset").to_pylist()
            assert len(got) == len(set(got)), "a row appears twice"
            assert set(range(floor)) <= set(got), "an acknowledged row is missing"
            q = vectors(np.array([floor - 1]), 16)[0]
            hit = h.reader.search_vector(q, k=1, columns=["_offset"], nprobes=64)
            assert hit.column("_offset").to_pylist() == [floor - 1]
            # Each row's unique text marker, newest and flushed ones: memtables, flushed
            # memtables held while the text index lags, the indexed base.
            for offset in (floor - 1, floor - 2, floor // 3):
                if offset % 11 == 5:  # rows without text
                    continue
                hit = h.reader.search_text(f"row{offset}", k=3, columns=["_offset"])
                assert hit.column("_offset").to_pylist() == [offset]
    finally:
        stop.set()
        producer.join(30)
        m.stop()
    assert not errors
    done = {task for task, outcome in events.events if outcome == "done"}
    assert {"vector_index", "fts_index", "compact"} <= done
    assert h.reader.flushed_text is not None
    assert h.reader.flushed_text.handoffs > 0  # text queries met flushed memtables held


# ---------------------------------------------------------------- in a child process


def exited(pid: int) -> bool:
    """Has the process exited (gone, or a zombie nobody reaped yet)?"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_the_process_runs_the_tasks_at_lower_priority_and_reports_them(
    make_harness: MakeHarness,
) -> None:
    h = make_harness()
    w = h.open()
    h.put(w, range(700))
    h.flush(w)
    events = Recorder()
    m = MaintenanceProcess(
        h.spec,
        h.storage.uri,
        maintenance_settings(interval_s=1, optimize_interval_s=1, optimize_unindexed_rows=500),
        events,
    )
    m.start()
    try:
        wait_for(lambda: m.pid() is not None, "the child did not start", 30)
        pid = m.pid()
        assert pid is not None
        assert pid != os.getpid()
        nice = min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)
        wait_for(lambda: os.getpriority(os.PRIO_PROCESS, pid) == nice, "niceness not set", 30)
        # The child builds the indexes (its own commits, seen by this process's reader)...
        wait_for(
            lambda: {("vector_index", "done"), ("fts_index", "done")} <= set(events.events),
            events.events,
            90,
        )
        types = {str(i.type_url).rsplit(".", 1)[-1] for i in h.table.dataset().describe_indices()}
        assert "InvertedIndexDetails" in types
        assert len(types) == 2
        # ... reports the unindexed rows it measured (100: not yet worth an optimisation)...
        h.put(w, range(700, 800))
        h.flush(w)
        wait_for(lambda: m.unindexed_rows() == 100, "100 unindexed rows not reported", 30)
        # ... and indexes them once 500 are due.
        h.put(w, range(800, 1300))
        h.flush(w)
        wait_for(lambda: m.unindexed_rows() == 0, "the new rows were not indexed", 60)
        ds = h.table.dataset()
        assert all(i.num_rows_indexed == ds.count_rows() == 1300 for i in ds.describe_indices())
        # The reader finds flushed rows through the child's indexes.
        got = h.reader.search_text("row1250", k=3, columns=["_offset"]).column("_offset")
        assert got.to_pylist()[0] == 1250
    finally:
        started = time.monotonic()
        m.stop(timeout=30)
    assert time.monotonic() - started < 30
    assert exited(pid)
    assert m.restarts == 0


def thread_niceness(pid: int) -> set[int]:
    """The niceness of every thread of process `pid` (Linux keeps one per thread)."""
    found = set()
    for tid in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.add(os.getpriority(os.PRIO_PROCESS, int(tid.name)))
        except OSError:
            continue  # the thread ended meanwhile
    return found


def test_the_child_lowers_its_priority_once_the_first_indexes_exist(
    make_harness: MakeHarness,
) -> None:
    """Until the table has its vector and text indexes (every query scans the base flat
    until then), the child runs at the sink's priority: at the lower one a catch-up starved
    their builds. Once a task finds them built, every thread of the child, Lance's runtime
    threads included, runs `nice` lower."""
    h = make_harness()
    w = h.open()
    events = Recorder()
    settings = maintenance_settings(interval_s=1, optimize_interval_s=1, nice=7)
    m = MaintenanceProcess(h.spec, h.storage.uri, settings, events)
    m.start()
    try:
        wait_for(lambda: m.pid() is not None, "the child did not start", 30)
        pid = m.pid()
        assert pid is not None
        sink = os.getpriority(os.PRIO_PROCESS, 0)
        wait_for(
            lambda: {("vector_index", "skipped"), ("fts_index", "skipped")} <= set(events.events),
            events.events,
            60,
        )
        assert thread_niceness(pid) == {sink}  # an empty table: nothing to build yet
        h.put(w, range(700))
        h.flush(w)
        wait_for(
            lambda: {("vector_index", "done"), ("fts_index", "done")} <= set(events.events),
            events.events,
            90,
        )
        lowered = min(sink + 7, 19)
        wait_for(lambda: thread_niceness(pid) == {lowered}, "the child kept its priority", 30)
        assert len(list(Path(f"/proc/{pid}/task").iterdir())) > 2  # the runtimes' threads too
    finally:
        m.stop(timeout=30)


def test_a_dead_child_is_restarted_and_a_stuck_one_killed_at_stop(
    make_harness: MakeHarness,
) -> None:
    h = make_harness()
    events = Recorder()
    m = MaintenanceProcess(h.spec, h.storage.uri, maintenance_settings(interval_s=3600), events)
    m.start()
    try:
        wait_for(lambda: m.pid() is not None, "the child did not start", 30)
        first = m.pid()
        assert first is not None
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: m.pid() not in (None, first), "the child was not restarted", 30)
        assert m.restarts == 1
        assert events.events == [("process_exited", str(-signal.SIGKILL))]
        second = m.pid()
        assert second is not None
        os.kill(second, signal.SIGSTOP)  # cannot answer: stop must not wait past its bound
    finally:
        started = time.monotonic()
        m.stop(timeout=1)
    assert time.monotonic() - started < 8
    assert exited(second)
    assert m.restarts == 1  # stopping is not a crash: no restart
    assert events.events == [("process_exited", str(-signal.SIGKILL))]


def indexed(h: ReadHarness) -> set[int]:
    """The rows each index of the base covers."""
    return {int(i.num_rows_indexed) for i in h.table.dataset().describe_indices()}


def wait_quiet(events: Recorder, quiet_s: float = 1.5, timeout: float = 60) -> int:
    """Wait until no event has come for `quiet_s` (a task in progress ended); their count."""
    deadline = time.monotonic() + timeout
    count, since = len(events.events), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, events.events
        time.sleep(0.1)
        if len(events.events) != count:
            count, since = len(events.events), time.monotonic()
    return count


def test_a_standby_runner_starts_no_task_until_it_is_active(make_harness: MakeHarness) -> None:
    """Every pod of a group ran every task on the one table (conflicts, failed cleanups,
    each optimisation done by each pod); a runner standing by starts none, runs as soon as
    it is set active, and after it is set to standby again starts nothing more."""
    h = make_harness()
    w = h.open()
    h.put(w, range(700))
    h.flush(w)
    events = Recorder()
    m = Maintenance(
        h.spec,
        h.table,
        h.storage,
        maintenance_settings(interval_s=1, optimize_interval_s=1),
        events,
        min_retained_versions=2,
        active=False,
    )
    m.start()
    try:
        time.sleep(2.5)  # two full runs (every index due) would have started by now
        assert events.events == []
        assert h.table.dataset().describe_indices() == []
        m.set_active(True)
        wait_for(
            lambda: {("vector_index", "done"), ("fts_index", "done")} <= set(events.events),
            events.events,
            60,
        )
        m.set_active(False)
        count = wait_quiet(events)
        h.put(w, range(700, 800))  # due for optimize_indices (50 rows)
        h.flush(w)
        time.sleep(2.5)
        assert len(events.events) == count, events.events[count:]
        assert indexed(h) == {700}
        m.set_active(True)
        wait_for(lambda: indexed(h) == {800}, events.events, 60)
    finally:
        m.stop()


def standby_process(
    make_harness: MakeHarness, **kwargs: Any
) -> tuple[ReadHarness, ShardWriter, MaintenanceProcess, Recorder]:
    """A started `MaintenanceProcess` standing by over a table with 700 flushed rows (one
    maintenance pass a second): the harness, its writer, the process and the recorder of
    its events; `kwargs` go to the process."""
    h = make_harness()
    w = h.open()
    h.put(w, range(700))
    h.flush(w)
    events = Recorder()
    settings = maintenance_settings(interval_s=1, optimize_interval_s=1)
    m = MaintenanceProcess(h.spec, h.storage.uri, settings, events, active=False, **kwargs)
    m.start()
    return h, w, m, events


@pytest.mark.slow
def test_the_child_stands_by_as_told_and_a_restarted_child_keeps_it(
    make_harness: MakeHarness,
) -> None:
    """`MaintenanceProcess.set_active` reaches the child over its pipe, and a child
    restarted after a crash starts in the last state set (standby: it indexes nothing).
    Created standing by, no child runs until the role is gained."""
    h, w, m, events = standby_process(make_harness)
    try:
        time.sleep(3)
        assert events.events == []
        assert m.pid() is None
        m.set_active(True)
        wait_for(lambda: m.pid() is not None, "the child did not start", 30)
        wait_for(lambda: ("fts_index", "done") in events.events, events.events, 60)
        m.set_active(False)
        first = m.pid()
        assert first is not None
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: m.pid() not in (None, first), "the child was not restarted", 30)
        count = wait_quiet(events)
        assert events.events[-1] == ("process_exited", str(-signal.SIGKILL))
        h.put(w, range(700, 800))  # due for optimize_indices (50 rows)
        h.flush(w)
        time.sleep(3)
        assert len(events.events) == count, events.events[count:]
        assert indexed(h) == {700}
        m.set_active(True)
        wait_for(lambda: indexed(h) == {800}, events.events, 60)
    finally:
        m.stop(timeout=30)


def maintenance_children() -> list[int]:
    """This process's running maintenance children, as the OS has them."""
    return [
        p.pid
        for p in multiprocessing.active_children()
        if p.name == "lance-sink-maintenance" and p.pid is not None and not exited(p.pid)
    ]


@pytest.mark.slow
def test_a_standby_child_starts_when_the_role_is_gained_and_retires_on_standby(
    make_harness: MakeHarness,
) -> None:
    """A standby child held ~120 MiB resident doing nothing: none runs until the role is
    gained, and one standing by for `standby_retire_s` stops (not a crash: no restart) and
    starts again when the role comes back."""
    _h, _w, m, events = standby_process(make_harness, standby_retire_s=1.0)
    try:
        time.sleep(2)
        assert m.pid() is None
        assert maintenance_children() == []
        m.set_active(True)
        wait_for(lambda: m.pid() is not None, "the child did not start", 30)
        first = m.pid()
        assert maintenance_children() == [first]
        wait_for(lambda: ("fts_index", "done") in events.events, events.events, 60)
        m.set_active(False)
        assert first is not None
        wait_for(lambda: exited(first), "the standby child was not retired", 30)
        wait_for(lambda: m.pid() is None, "the retired child is still listed", 5)
        assert maintenance_children() == []
        assert m.restarts == 0
        assert ("process_exited", "0") not in events.events
        m.set_active(True)
        wait_for(lambda: m.pid() not in (None, first), "no child when the role came back", 30)
        assert maintenance_children() == [m.pid()]
    finally:
        m.stop(timeout=30)
    assert maintenance_children() == []
    assert m.restarts == 0


PARENT = """
import sys, time
from config.settings import MaintenanceSettings
from engine.maintenance import MaintenanceProcess
import pickle
spec = pickle.loads(bytes.fromhex(sys.argv[1]))
m = MaintenanceProcess(spec, sys.argv[2], MaintenanceSettings(interval_s=3600))
m.start()
while m.pid() is None:
    time.sleep(0.05)
print("child", m.pid(), flush=True)
time.sleep(600)
"""


def test_the_child_exits_when_the_sink_is_killed(make_harness: MakeHarness) -> None:
    h = make_harness()
    with subprocess.Popen(
        [sys.executable, "-c", PARENT, pickle.dumps(h.spec).hex(), h.storage.uri],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    ) as parent:
        try:
            assert parent.stdout is not None
            line = ""
            while not line.startswith("child "):  # after the log lines (structlog's stdout)
                line = parent.stdout.readline()
                assert line, "the parent exited"
            child = int(line.split()[1])
            assert not exited(child)
            parent.kill()  # as SIGKILL would: no shutdown code of the parent runs
            parent.wait(10)
            wait_for(lambda: exited(child), "the maintenance child outlived the sink", 15)
        finally:
            parent.kill()
