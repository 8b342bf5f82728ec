"""The reader over real writers and real Lance tables: newest version wins across tiers,
deletes stay deleted, a row appears once, acknowledged rows are found by every query kind
at once, and nothing unacknowledged is ever returned (I2)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from engine.errors import Poisoned
from engine.filters import QueryError, UnknownColumn
from engine.reads import stats as stats_module
from engine.reads import text as text_module
from tests.reads.conftest import ReadHarness, text_of, vectors

pytestmark = pytest.mark.timeout(120)

MakeHarness = Callable[..., ReadHarness]


def upsert_layers(h: ReadHarness) -> tuple[dict[str, int], set[str]]:
    """Base: k0..k99 (offsets 0..99). Frozen: k0..k29 again (offsets 100..129).
    Active: k10..k19 again (130..139), deletes of k20..k24 (140..144) and of base-only
    k50..k54 (145..149), and a new key k200 (150).

    Returns the expected newest offset per visible key, and the deleted keys.
    """
    w = h.open()
    h.put(w, range(100))
    h.flush(w)
    h.hold_flushes()
    h.put(w, range(100, 130), key_of=lambda o: f"k{o - 100}", version=1)
    w.seal()
    h.put(w, range(130, 140), key_of=lambda o: f"k{o - 120}", version=2)
    h.put(
        w,
        range(140, 150),
        key_of=lambda o: f"k{o - 120}" if o < 145 else f"k{o - 95}",
        deletes=set(range(140, 150)),
    )
    h.put(w, [150], key_of=lambda o: "k200", version=2)
    expected = {f"k{i}": i for i in range(100)}
    expected.update({f"k{i}": 100 + i for i in range(30)})
    expected.update({f"k{i}": 120 + i for i in range(10, 20)})
    deleted = {f"k{i}" for i in [*range(20, 25), *range(50, 55)]}
    for key in deleted:
        expected.pop(key)
    expected["k200"] = 150
    return expected, deleted


def check_upsert_view(h: ReadHarness, expected: dict[str, int], deleted: set[str]) -> None:
    r = h.reader
    # Scan: every visible key once, at its newest offset; deleted keys absent.
    rows = r.scan(columns=["id", "_offset"], limit=1000).to_pylist()
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)), "a key appears twice"
    assert {row["id"]: row["_offset"] for row in rows} == expected
    # Lookup of every key ever written (and one never written).
    keys = [*expected, *deleted, "never"]
    found = r.lookup(keys, columns=["id", "_offset"]).to_pylist()
    assert {row["id"]: row["_offset"] for row in found} == expected
    assert len(found) == len(expected)
    # Vector: each key's newest vector finds exactly that version at distance 0; an older
    # version's vector does not bring back the old row.
    for key in ["k5", "k15", "k27", "k40", "k200"]:
        offset = expected[key]
        version = 2 if offset >= 130 else 1 if offset >= 100 else 0
        q = vectors(np.array([offset]), 16, version)[0]
        hit = r.search_vector(q, k=1, columns=["id", "_offset"]).to_pylist()[0]
        assert (hit["id"], hit["_offset"]) == (key, offset)
        assert hit["_distance"] == pytest.approx(0.0, abs=1e-4)
    for old in [5, 15, 22, 52]:  # superseded or deleted versions in older tiers
        q = vectors(np.array([old]), 16, 0)[0]
        hits = r.search_vector(q, k=20, columns=["_offset"]).column("_offset").to_pylist()
        assert old not in hits
    # Text: a term unique to one row version ("row<offset>").
    for key, offset in [("k5", 105), ("k15", 135), ("k40", 40)]:
        hits = r.search_text(f"row{offset}", k=5, columns=["id", "_offset"]).to_pylist()
        assert [(h_["id"], h_["_offset"]) for h_ in hits] == [(key, offset)]
    for old in [5, 15, 22, 52, 142]:
        assert r.search_text(f"row{old}", k=5, columns=["_offset"]).num_rows == 0
    # Filter: the same answer as the scan, restricted.
    got = r.scan(filter="f >= 0", columns=["id", "_offset"]).to_pylist()
    assert {row["id"]: row["_offset"] for row in got} == expected


def test_newest_version_wins_and_deletes_stay_deleted(make_harness: MakeHarness) -> None:
    h = make_harness(mode="upsert")
    expected, deleted = upsert_layers(h)
    stats = h.writers[0].stats()
    assert stats.frozen_count == 1
    assert stats.rows > 0
    check_upsert_view(h, expected, deleted)
    # Let the flushes through: the same answers with everything in the base.
    for event in h._held:
        event.set()
    h.flush(h.writers[0])
    assert h.writers[0].stats().frozen_count == 0
    check_upsert_view(h, expected, deleted)


def test_key_updated_after_the_snapshot_is_not_lost(make_harness: MakeHarness) -> None:
    """A memtable's keys dict is live: a key re-put after the view was taken must neither
    vanish nor appear twice for a reader holding the older view."""
    h = make_harness(mode="upsert")
    w = h.open()
    h.put(w, range(10))
    h.flush(w)
    h.put(w, range(10, 20), key_of=lambda o: f"k{o - 10}", version=1)
    snap = h.reader.snapshot()
    h.put(w, range(20, 25), key_of=lambda o: f"k{o - 20}", version=2)  # after the view
    (tier,) = snap.tiers
    assert tier.holds("k0")  # its newest row id is beyond the view: found by scanning
    assert tier.find_in_view("k0") == 0
    assert not tier.holds("k99")
    assert snap.base_hidden(["k0", "k9", "k99"]).tolist() == [True, True, False]


def test_acknowledged_row_is_found_by_every_query_kind(make_harness: MakeHarness) -> None:
    h = make_harness()
    w = h.open()
    h.put(w, range(50))
    h.flush(w)
    offset = 50
    h.put(w, [offset])  # resolved = durable and visible
    r = h.reader
    q = vectors(np.array([offset]), 16)[0]
    assert r.search_vector(q, k=1, columns=["_offset"]).column("_offset").to_pylist() == [offset]
    assert r.search_text(f"row{offset}", k=3, columns=["_offset"]).column(
        "_offset"
    ).to_pylist() == [offset]
    assert r.scan(filter=f"_offset = {offset}", columns=["_offset"]).num_rows == 1
    assert r.lookup([("t", 0, offset)], columns=["_offset"]).column("_offset").to_pylist() == [
        offset
    ]
    # And a flushed one, through the same four paths.
    assert r.lookup([("t", 0, 7)], columns=["_offset"]).column("_offset").to_pylist() == [7]
    assert r.search_text("row7", k=3, columns=["_offset"]).column("_offset").to_pylist() == [7]


@pytest.mark.slow
def test_nothing_unacknowledged_is_returned_under_concurrent_puts(
    make_harness: MakeHarness,
) -> None:
    """Queries run while another thread puts (small memtables, so seals and flushes happen
    too): every returned offset is at most the durable offset when the query finished, and
    no row appears twice."""
    h = make_harness(max_rows=120)
    w = h.open()
    stop = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        offset = 0
        try:
            while not stop.is_set():
                n = 7 + offset % 13
                h.put(w, range(offset, offset + n))
                offset += n
        except BaseException as exc:
            errors.append(exc)

    producer = threading.Thread(target=produce)
    producer.start()
    r = h.reader
    q = vectors(np.array([3]), 16)[0]
    queries: list[Callable[[], list[Any]]] = [
        lambda: r.scan(columns=["_offset"], limit=1000).column("_offset").to_pylist(),
        lambda: r.search_vector(q, k=50, columns=["_offset"]).column("_offset").to_pylist(),
        lambda: (
            r.search_text("alpha bravo", k=50, columns=["_offset"]).column("_offset").to_pylist()
        ),
        lambda: (
            r.lookup([("t", 0, o) for o in range(0, 3000, 3)], columns=["_offset"])
            .column("_offset")
            .to_pylist()
        ),
        lambda: (
            r.scan(filter="n > 10", columns=["_offset"], limit=1000).column("_offset").to_pylist()
        ),
    ]
    deadline = time.monotonic() + 6
    rounds = 0
    try:
        while time.monotonic() < deadline:
            for query in queries:
                got = query()
                durable = w.durable_offsets.get(("t", 0), -1)
                assert len(got) == len(set(got)), "a row appears twice"
                assert not got or max(got) <= durable, "a returned row is not durable"
            rounds += 1
    finally:
        stop.set()
        producer.join(30)
    assert not errors
    assert rounds > 3
    assert w.stats().flushes_total > 0  # flushes really ran during the queries


def test_scan_sees_each_row_once_while_flushing(make_harness: MakeHarness) -> None:
    h = make_harness()
    w = h.open()
    for first in range(0, 400, 40):
        h.put(w, range(first, first + 40))
    done = threading.Event()

    def flush() -> None:
        h.flush(w)
        done.set()

    thread = threading.Thread(target=flush)
    thread.start()
    seen = 0
    while not done.is_set() or seen < 2:
        got = h.reader.scan(columns=["_offset"], limit=1000).column("_offset").to_pylist()
        assert sorted(got) == list(range(400))
        seen += 1
    thread.join(30)


def test_request_errors_are_typed(make_harness: MakeHarness) -> None:
    h = make_harness()
    r = h.reader
    with pytest.raises(QueryError, match="dimension 3"):
        r.search_vector([1.0, 2.0, 3.0], k=5)
    with pytest.raises(QueryError, match="NaN"):
        r.search_vector([float("nan")] * 16, k=5)
    with pytest.raises(QueryError, match="k must be between"):
        r.search_vector([0.0] * 16, k=0)
    with pytest.raises(QueryError, match="k must be between"):
        r.search_text("alpha", k=10_000)
    with pytest.raises(UnknownColumn):
        r.scan(columns=["nope"])
    with pytest.raises(UnknownColumn):
        r.search_text("alpha", column="id")
    with pytest.raises(QueryError, match="no searchable terms"):
        r.search_text("the and of")
    with pytest.raises(QueryError, match="words of 40 characters or more"):
        r.search_text("x" * 1_000)
    with pytest.raises(QueryError, match="needs 3 values"):
        r.lookup([("t", 0)])
    with pytest.raises(QueryError, match="is not a int32 value"):
        r.lookup([("t", "x", 1)])


def test_text_queries_are_bounded_in_terms_and_characters(make_harness: MakeHarness) -> None:
    """Every distinct term is counted and searched: 20,000 of them in one query took
    gigabytes and every query slot. Past the bounds: a QueryError (400) naming them."""
    h = make_harness()
    w = h.open(0)
    h.put(w, range(20))
    words = [f"w{i}" for i in range(text_module.MAX_TEXT_TERMS)]
    # At the bound: answered (the rows' own words among the terms).
    got = h.reader.search_text(" ".join([*words[:-1], "alpha"]), k=5)
    assert got.num_rows == 5
    with pytest.raises(QueryError, match=r"129 distinct terms; at most 128"):
        h.reader.search_text(" ".join([*words, "alpha"]), k=5)
    with pytest.raises(QueryError, match=r"129 distinct terms; at most 128"):
        h.reader.search_hybrid([0.0] * 16, " ".join([*words, "alpha"]), k=5)
    # Repeated words are one term each.
    assert h.reader.search_text(" ".join(["alpha"] * 1000), k=5).num_rows == 5
    with pytest.raises(QueryError, match="characters long; at most 16384"):
        h.reader.search_text("alpha " * 3000, k=5)


def test_poisoned_shard_is_skipped(make_harness: MakeHarness) -> None:
    h = make_harness()
    w1, w2 = h.open(0), h.open(1)
    h.put(w1, range(5))
    h.put(w2, range(5), partition=1)
    w2.poison(Poisoned("test", shard=w2.shard))
    got = h.reader.scan(columns=["_partition"]).column("_partition").to_pylist()
    assert got == [0] * 5


def test_text_of_rows_contains_their_marker() -> None:
    assert "row12" in text_of(12)


def test_stale_base_statistics_are_served_while_recomputed_in_the_background(
    make_harness: Callable[..., ReadHarness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A query never waits for a base statistic it already has: an expired value is returned
    as it is and recomputed on the stats thread; the next query sees the new value."""
    h = make_harness()
    w = h.open()
    h.put(w, range(100))
    h.flush(w)
    reader = h.reader
    assert reader.ctx.stats.cached(reader.snapshot().base, ("k",), lambda: "v1") == "v1"
    h.put(w, range(100, 200))
    h.flush(w)
    base = reader.snapshot().base  # a newer version: the cached value is an older one's
    monkeypatch.setattr(stats_module, "STATS_MAX_AGE_S", 0.0)
    gate = threading.Event()
    calls = []

    def slow() -> str:
        calls.append(1)
        gate.wait(30)
        return "v2"

    started = time.monotonic()
    assert reader.ctx.stats.cached(base, ("k",), slow) == "v1"
    assert reader.ctx.stats.cached(base, ("k",), slow) == "v1"  # one refresh at a time
    assert time.monotonic() - started < 5
    gate.set()
    deadline = time.monotonic() + 10
    while reader.ctx.stats.cached(base, ("k",), lambda: "v3") != "v2":
        assert time.monotonic() < deadline, "the background refresh never landed"
        time.sleep(0.01)
    assert len(calls) == 1


def test_a_first_statistic_is_waited_for_at_most_its_bound(make_harness: MakeHarness) -> None:
    """With `wait_s`, a statistic not cached yet is computed on the stats thread; a query
    waits for it at most `wait_s` and otherwise (or when it fails) gets the estimate; the
    value then serves the next queries. A closed reader computes inline."""
    h = make_harness()
    w = h.open()
    h.put(w, range(100))
    h.flush(w)
    reader = h.reader
    base = reader.snapshot().base
    gate = threading.Event()
    calls = []

    def slow() -> str:
        calls.append(1)
        gate.wait(30)
        return "counted"

    started = time.monotonic()
    assert reader.ctx.stats.cached(base, ("k",), slow, wait_s=0.05, estimate="guess") == "guess"
    assert reader.ctx.stats.cached(base, ("k",), slow, wait_s=0.05, estimate="guess") == "guess"
    assert time.monotonic() - started < 5
    gate.set()
    deadline = time.monotonic() + 10
    while reader.ctx.stats.cached(base, ("k",), slow, wait_s=0.05, estimate="guess") != "counted":
        assert time.monotonic() < deadline, "the background count never landed"
        time.sleep(0.01)
    assert len(calls) == 1  # the second query waited on the first one's run
    # Within the bound: the value itself.
    assert reader.ctx.stats.cached(base, ("fast",), lambda: 7, wait_s=10, estimate=0) == 7

    def broken() -> int:
        raise OSError("the count failed")

    assert reader.ctx.stats.cached(base, ("broken",), broken, wait_s=10, estimate=3) == 3
    reader.close()
    assert reader.ctx.stats.cached(base, ("closed",), lambda: 5, wait_s=0.0, estimate=0) == 5
