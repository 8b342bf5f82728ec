"""Fan-out reads in one process: two "pods" (each its own Reader, shard writers and HTTP
query server on 127.0.0.1) on one table and one WAL root. A query to either pod returns
every committed row (I18): the other pod's memtable rows before any flush, newest wins
across pods for upsert tables, no row twice and none lost when the owner flushes between
the coordinator's base snapshot and its own view, and a partial answer that names the
missing shard when an owner does not answer in time."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np
import pyarrow as pa
import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from config.settings import QuerySettings
from engine.backpressure import BlockingValve
from engine.errors import FreshRowsUnavailable
from engine.flusher import Flusher
from engine.manifest import ManifestStore, ShardOrigin
from engine.reader import FanoutReport, Reader
from engine.reads import bm25
from engine.reads.remote import pack, unpack
from engine.schema import TableSpec
from engine.shard import ShardWriter
from engine.storage import Storage, open_storage
from engine.table import BaseTable
from sink.http import create_query_app
from tests.reads.conftest import read_spec, rows_batch, vectors
from tests.support.engine import source, writer_config
from tests.support.fanout import TOKEN, Events, coordinator_fanout, serve_queries

pytestmark = pytest.mark.timeout(180)

DIM = 16


class Pod:
    """One process's share of a fan-out deployment: a reader, writers and a query server."""

    def __init__(
        self,
        spec: TableSpec,
        storage: Storage,
        timeout_ms: int = 2000,
        expected: Callable[[], set[str] | None] | None = None,
    ) -> None:
        self.spec = spec
        self.table = BaseTable(spec)
        self.table.open()
        self.storage = storage
        self.flusher = Flusher(1)
        self.writers: list[ShardWriter] = []
        self.fanout = coordinator_fanout(storage, timeout_ms, expected)
        self.owners = self.fanout.owners
        self.events = Events()
        self.reader = Reader(
            spec, self.table, lambda: list(self.writers), events=self.events, fanout=self.fanout
        )
        self.server = serve_queries(self.reader, timeout_ms)
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.fanout.self_url = self.url
        self.config = dataclasses.replace(
            writer_config(max_rows=100_000, interval_s=0.002), advertised_url=self.url
        )

    def open(self, partition: int) -> ShardWriter:
        writer = ShardWriter.open(
            f"t-{partition}-fanout",
            self.spec,
            self.table,
            self.storage,
            self.config,
            BlockingValve(1 << 40),
            self.flusher,
            origin=ShardOrigin(self.spec.uri, "t", partition),
        )
        self.writers.append(writer)
        return writer

    def put(self, writer: ShardWriter, offsets: list[int], partition: int, **kw: Any) -> None:
        batch = rows_batch(self.spec, offsets, partition=partition, **kw)
        writer.put(batch, source(offsets[0], len(offsets), partition=partition)).result(30)

    def flush(self, writer: ShardWriter) -> None:
        writer.seal()
        assert writer.wait_flushed(60)

    def close(self) -> None:
        self.server.stop()
        self.reader.close()
        for w in self.writers:
            w.close(flush=False, timeout=30)
        self.flusher.shutdown()


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[Callable[..., tuple[Pod, Pod]]]:
    made: list[Pod] = []

    def make(mode: str = "append", timeout_ms: int = 2000) -> tuple[Pod, Pod]:
        spec = read_spec(str(tmp_path / "table.lance"), mode, DIM)
        storage = open_storage(str(tmp_path / "wal"))
        a, b = Pod(spec, storage, timeout_ms), Pod(spec, storage, timeout_ms)
        made.extend([a, b])
        return a, b

    yield make
    for pod in made:
        pod.close()


@pytest.fixture
def pods3(tmp_path: Path) -> Iterator[Callable[[], tuple[Pod, Pod, Pod]]]:
    made: list[Pod] = []

    def make() -> tuple[Pod, Pod, Pod]:
        spec = read_spec(str(tmp_path / "table.lance"), "append", DIM)
        storage = open_storage(str(tmp_path / "wal"))
        three = Pod(spec, storage), Pod(spec, storage), Pod(spec, storage)
        made.extend(three)
        return three

    yield make
    for pod in made:
        pod.close()


def offsets(table: Any) -> list[int]:
    return sorted(table.column("_offset").to_pylist())


def test_every_pod_returns_every_committed_row_before_any_flush(
    pods: Callable[..., tuple[Pod, Pod]],
) -> None:
    a, b = pods()
    wa, wb = a.open(0), b.open(1)
    a.put(wa, list(range(50)), 0)
    a.flush(wa)  # base: 0..49 (partition 0)
    a.put(wa, list(range(50, 60)), 0)  # pod A's memtable
    b.put(wb, list(range(1000, 1020)), 1)  # pod B's memtable
    for coordinator in (a, b):
        r = coordinator.reader
        everything = r.scan(columns=["_offset"], report=FanoutReport())
        assert offsets(everything) == [*range(60), *range(1000, 1020)]
        # vector: B's row 1007 is the nearest to its own vector, from either pod
        q = vectors(np.array([1007]), DIM)[0]
        got = r.search_vector(q, k=3, columns=["_offset"], report=FanoutReport())
        assert got.column("_offset").to_pylist()[0] == 1007
        assert got.column("_distance").to_pylist()[0] == pytest.approx(0, abs=1e-4)
        # filter-only and filtered kNN across pods
        assert offsets(r.scan(filter="_offset >= 1010", columns=["_offset"])) == list(
            range(1010, 1020)
        )
        got = r.search_vector(q, k=5, filter="_partition = 0", columns=["_offset"])
        assert all(o < 1000 for o in got.column("_offset").to_pylist())
        # text: row1013's own words, scored with statistics over the whole corpus
        hit = r.search_text("row1013", k=3, columns=["_offset"])
        assert hit.column("_offset").to_pylist()[0] == 1013
        hit = r.search_text("row55", k=3, columns=["_offset"])
        assert hit.column("_offset").to_pylist()[0] == 55
        # lookup (append: every row of a key)
        keys = [["t", 1, 1001], ["t", 0, 55], ["t", 0, 3], ["t", 9, 9]]
        found = r.lookup(keys, columns=["_offset"])
        assert offsets(found) == [3, 55, 1001]


def test_text_scores_are_the_same_from_every_pod(pods: Callable[..., tuple[Pod, Pod]]) -> None:
    """BM25 statistics cover the whole corpus: a pod scores another pod's memtable rows as
    that pod scores them itself."""
    a, b = pods()
    wa, wb = a.open(0), b.open(1)
    a.put(wa, list(range(200)), 0)
    a.flush(wa)
    a.put(wa, list(range(200, 260)), 0)
    b.put(wb, list(range(1000, 1100)), 1)
    got = [
        p.reader.search_text("alpha golf", k=40, columns=["_offset"]).to_pydict() for p in (a, b)
    ]
    # The same scores (ties may come in another order), and rows of both pods among them.
    assert got[0]["_score"] == pytest.approx(got[1]["_score"], rel=1e-5)
    score_of = [dict(zip(g["_offset"], g["_score"], strict=True)) for g in got]
    for offset in set(score_of[0]) & set(score_of[1]):
        assert score_of[0][offset] == pytest.approx(score_of[1][offset], rel=1e-5)
    assert any(o >= 1000 for o in got[0]["_offset"])


VOCABULARY = [
    "kilo", "lima", "mike", "oscar", "papa", "romeo", "sierra", "tango", "victor", "whiskey",
    "amber", "basil", "cedar", "dune", "ember", "fjord", "grove", "heath", "inlet", "juniper",
]  # fmt: skip
#: Zipf-like: a few common words and a long tail, so terms differ in rarity.
WEIGHTS = 1 / np.arange(1, len(VOCABULARY) + 1)


def varied_text(offset: int) -> str:
    rng = np.random.default_rng(offset)
    words = rng.choice(VOCABULARY, int(rng.integers(2, 16)), p=WEIGHTS / WEIGHTS.sum())
    return " ".join(str(w) for w in words)


def put_varied(pod: Pod, writer: ShardWriter, offsets: list[int], partition: int) -> None:
    """Rows whose texts vary in length and term frequencies (BM25 ranks them apart)."""
    batch = rows_batch(pod.spec, offsets, partition=partition)
    texts = pa.array([varied_text(o) for o in offsets], pa.string())
    batch = batch.set_column(batch.schema.get_field_index("text"), "text", texts)
    writer.put(batch, source(offsets[0], len(offsets), partition=partition)).result(30)


TEXT_QUERIES: list[dict[str, Any]] = [
    {"text": "kilo"},
    {"text": "juniper inlet"},
    {"text": "kilo juniper heath", "k": 7},
    {"text": "lima dune", "k": 25},
    {"text": "mike kilo", "phrase": True},
    {"text": "papa grove kilo", "filter": "n > 1100", "k": 12},
    {"text": "fjord", "k": 1},
]


def test_text_across_pods_scores_as_one_process_holding_every_shard(
    pods3: Callable[[], tuple[Pod, Pod, Pod]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """BM25 across pods (statistics over the whole corpus, one round trip per owner) gives
    exactly the scores of a single process that holds every shard: each returned row's
    score is that row's single-process score, and the k scores are the single-process k
    scores (a tie at the k-th may be broken by another row)."""
    a, b, c = pods3()
    wa, wb, wc = a.open(0), b.open(1), c.open(2)
    put_varied(a, wa, list(range(300)), 0)
    a.flush(wa)
    a.table.dataset().create_scalar_index("text", "INVERTED", with_position=True)
    put_varied(a, wa, list(range(300, 380)), 0)
    put_varied(b, wb, list(range(1000, 1150)), 1)
    put_varied(c, wc, list(range(2000, 2150)), 2)
    single = Reader(a.spec, a.table, lambda: [wa, wb, wc])  # every shard, no fan-out
    posts: list[str] = []
    real_post = a.fanout.post
    monkeypatch.setattr(
        a.fanout, "post", lambda url, *args: posts.append(url) or real_post(url, *args)
    )
    try:
        for coordinator in (a, b, a):  # a twice: the second time with a warm estimate
            for query in TEXT_QUERIES:
                q = dict(query)
                text, k = q.pop("text"), q.pop("k", 10)
                got = coordinator.reader.search_text(text, k=k, columns=["_offset"], **q)
                want = single.search_text(text, k=k, columns=["_offset"], **q)
                everything = single.search_text(text, k=1000, columns=["_offset"], **q)
                score_of = dict(
                    zip(
                        everything["_offset"].to_pylist(),
                        everything["_score"].to_pylist(),
                        strict=True,
                    )
                )
                assert got["_score"].to_pylist() == want["_score"].to_pylist(), query
                for offset, score in zip(
                    got["_offset"].to_pylist(), got["_score"].to_pylist(), strict=True
                ):
                    assert score_of[offset] == score, (query, offset)
                assert any(o >= 1000 for o in score_of), "the owners' rows are not scored"
        # Owners that were only asked by other pods tokenise their memtables in the
        # background too.
        assert c.reader.text.tokenizer.thread is not None
        # One request per owner pod and query: statistics and rows come together.
        posts.clear()
        a.reader.search_text("kilo juniper heath", k=7, columns=["_offset"])
        assert sorted(posts) == sorted([b.url, c.url])
    finally:
        single.close()


def test_a_text_estimate_far_off_asks_the_owners_again(
    pods3: Callable[[], tuple[Pod, Pod, Pod]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Owners rank their rows by the coordinator's estimate of the statistics; when it is
    so far off that a row they did not return might make the top k, the coordinator asks
    again with the exact statistics, and the answer is still the single-process one."""
    a, b, c = pods3()
    wa, wb, wc = a.open(0), b.open(1), c.open(2)
    put_varied(a, wa, list(range(200)), 0)
    put_varied(b, wb, list(range(1000, 1300)), 1)
    put_varied(c, wc, list(range(2000, 2300)), 2)
    single = Reader(a.spec, a.table, lambda: [wa, wb, wc])
    text_search = a.reader.text
    real_hint = text_search.hint

    def inverted(*args: Any) -> tuple[dict[str, float], float]:
        idf, avgdl = real_hint(*args)
        return {t: 1 / v for t, v in idf.items()}, avgdl * 50  # rare terms look common

    monkeypatch.setattr(text_search, "hint", inverted)
    posts: list[str] = []
    real_post = a.fanout.post
    monkeypatch.setattr(
        a.fanout, "post", lambda url, *args: posts.append(url) or real_post(url, *args)
    )
    try:
        for text in ("kilo juniper", "juniper fjord heath", "kilo lima mike"):
            posts.clear()
            got = a.reader.search_text(text, k=5, columns=["_offset"])
            want = single.search_text(text, k=5, columns=["_offset"])
            assert got["_score"].to_pylist() == want["_score"].to_pylist(), text
            assert len(posts) > 2, f"{text}: no owner was asked again"
    finally:
        single.close()


HYBRID_QUERIES: list[dict[str, Any]] = [
    {"vector": 1005, "text": "kilo juniper"},
    {"vector": 2010, "text": "lima dune", "k": 15},
    {"vector": 42, "text": "papa grove kilo", "filter": "n > 1100", "k": 12},
    {"vector": 330, "text": "mike kilo", "phrase": True, "k": 5},
]


def test_hybrid_across_pods_is_one_request_per_owner_with_the_single_process_answer(
    pods3: Callable[[], tuple[Pod, Pod, Pod]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hybrid query (vector and text) to any pod gives the answer of one process holding
    every shard (both fused lists: the vector half's rows and distances, the text half's
    scores), and asks each owner pod ONCE per query: one `parts` request carrying both
    halves, answered from one snapshot on the owner."""
    a, b, c = pods3()
    wa, wb, wc = a.open(0), b.open(1), c.open(2)
    put_varied(a, wa, list(range(300)), 0)
    a.flush(wa)
    put_varied(a, wa, list(range(300, 380)), 0)
    put_varied(b, wb, list(range(1000, 1150)), 1)
    put_varied(c, wc, list(range(2000, 2150)), 2)
    single = Reader(a.spec, a.table, lambda: [wa, wb, wc])  # every shard, no fan-out
    kinds: dict[str, list[str]] = {}
    for pod in (a, b, c):
        real_post = pod.fanout.post

        def counted(url: str, body: bytes, timeout_s: float, _real: Any = real_post) -> bytes:
            kinds.setdefault(url, []).append(str(unpack(body)[1]["kind"]))
            return bytes(_real(url, body, timeout_s))

        monkeypatch.setattr(pod.fanout, "post", counted)
    settings_ = QuerySettings(auth_token=SecretStr(TOKEN))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with TestClient(create_query_app(single, settings_)) as one:
            for coordinator in (a, b, c, a):  # a twice: the second time with a warm estimate
                owners = sorted({a.url, b.url, c.url} - {coordinator.url})
                for query in HYBRID_QUERIES:
                    body = {**query, "vector": vectors(np.array([query["vector"]]), DIM)[0]}
                    body = {**body, "vector": body["vector"].tolist(), "columns": ["_offset"]}
                    kinds.clear()
                    got = httpx.post(
                        f"{coordinator.url}/v1/search", json=body, headers=headers, timeout=60
                    )
                    assert got.status_code == 200, got.text
                    assert sorted(kinds) == owners, query
                    for url in owners:  # a text second round would be a second "text" request
                        assert kinds[url] in (["parts"], ["parts", "text"]), (query, kinds)
                    want = one.post("/v1/search", json=body, headers=headers)
                    assert want.status_code == 200, want.text
                    assert got.json()["rows"] == want.json()["rows"], query
                    assert "partial" not in got.json()
                    # The engine's two lists, each the single-process one.
                    k, q = (
                        body.get("k", 10),
                        {x: body[x] for x in ("filter", "phrase") if x in body},
                    )
                    near, scored = coordinator.reader.search_hybrid(
                        body["vector"], body["text"], k=k, columns=["_offset"], **q
                    )
                    f = q.get("filter")
                    v = single.search_vector(body["vector"], k=k, filter=f, columns=["_offset"])
                    t = single.search_text(body["text"], k=k, columns=["_offset"], **q)
                    assert near.to_pydict() == v.to_pydict(), query
                    assert scored["_score"].to_pylist() == t["_score"].to_pylist(), query
        # With a warm estimate, one request per owner and hybrid query, and no other.
        kinds.clear()
        body = {"vector": vectors(np.array([7]), DIM)[0].tolist(), "text": "kilo juniper heath"}
        a.reader.search_hybrid(body["vector"], body["text"], k=7)
        assert kinds == {b.url: ["parts"], c.url: ["parts"]}
    finally:
        single.close()


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 3), st.integers(1, 30)),
        min_size=1,
        max_size=60,
    ),
    idf=st.lists(st.floats(0.01, 12), min_size=3, max_size=3),
    avgdl=st.floats(1, 40),
)
def test_the_frontier_bounds_every_row_under_any_statistics(
    rows: list[tuple[int, int, int, int]], idf: list[float], avgdl: float
) -> None:
    """The best score of the frontier (what an owner sends for the rows it did not return)
    is the best score of all the rows, whatever the corpus statistics."""
    signatures = np.array(rows, dtype=np.int64)
    terms = ["x", "y", "z"]
    term_idf = dict(zip(terms, idf, strict=True))
    points = bm25.frontier(signatures)
    assert len(points) <= len({tuple(r[:-1]) for r in rows})
    every = bm25.bm25_rows(signatures[:, :-1], signatures[:, -1], terms, term_idf, avgdl)
    best = bm25.frontier_best(points.tolist(), terms, term_idf, avgdl)
    assert best == float(every.max())


def test_a_remote_upsert_and_tombstone_shadow_the_base(
    pods: Callable[..., tuple[Pod, Pod]],
) -> None:
    a, b = pods(mode="upsert")
    wa, wb = a.open(0), b.open(1)
    keys = {o: f"k{o}" for o in range(100)}
    b.put(wb, list(range(100)), 1, key_of=keys.get)
    b.flush(wb)  # base holds k0..k99 version 0
    # On pod B (memtable): k7 updated (version 1), k8 deleted.
    b.put(wb, [100], 1, key_of=lambda o: "k7", version=1)
    b.put(wb, [101], 1, key_of=lambda o: "k8", deletes={101})
    a.put(wa, [500], 0, key_of=lambda o: "kA")
    r = a.reader  # pod A has none of these memtables
    found = r.lookup(["k7", "k8", "k9", "kA"], columns=["id", "_offset"])
    assert sorted(
        zip(found.column("id").to_pylist(), found.column("_offset").to_pylist(), strict=True)
    ) == [
        ("k7", 100),
        ("k9", 9),
        ("kA", 500),
    ]
    rows = r.scan(columns=["id", "_offset"], limit=1000)
    ids = rows.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 100  # k0..k99 less k8, plus kA; k7 once
    assert "k8" not in ids
    assert dict(zip(ids, rows.column("_offset").to_pylist(), strict=True))["k7"] == 100
    # kNN with the deleted row's own vector: never returned; the updated key once, new row.
    q8 = vectors(np.array([8]), DIM)[0]
    got = r.search_vector(q8, k=100, columns=["id", "_offset"])
    assert "k8" not in got.column("id").to_pylist()
    q7 = vectors(np.array([7]), DIM)[0]  # the base version of k7
    got = r.search_vector(q7, k=100, columns=["id", "_offset"])
    pairs = list(zip(got.column("id").to_pylist(), got.column("_offset").to_pylist(), strict=True))
    assert [p for p in pairs if p[0] == "k7"] == [("k7", 100)]
    hit = r.search_text("row8", k=5, columns=["id"])  # k8's base text
    assert "k8" not in hit.column("id").to_pylist()


def test_a_flush_between_the_base_snapshot_and_the_owners_view(
    pods: Callable[..., tuple[Pod, Pod]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pod B flushes its memtable after pod A opened the base (version V) and before B
    takes its view: B answers `stale_base`, A runs the query again on a newer base, and the
    flushed rows are returned once (not lost with V, not twice with the newer base). A
    hybrid query runs again as a whole: both its lists hold the flushed rows once."""
    a, b = pods()
    wa, wb = a.open(0), b.open(1)
    a.put(wa, list(range(10)), 0)
    a.flush(wa)
    opened: list[int] = []
    real = a.reader.ctx.open_base

    def open_then_flush_b(version: int | None = None) -> Any:
        base = real(version)
        opened.append(int(base.version))
        if len(opened) == 1:
            b.flush(wb)  # into a version above the one just opened
        return base

    monkeypatch.setattr(a.reader.ctx, "open_base", open_then_flush_b)
    queries = {
        "scan": lambda new: a.reader.scan(columns=["_offset"], limit=1000),
        "lookup": lambda new: a.reader.lookup([["t", 1, o] for o in new], columns=["_offset"]),
        "vector": lambda new: a.reader.search_vector(
            vectors(np.array([new[3]]), DIM)[0], k=1000, columns=["_offset"]
        ),
        "hybrid": lambda new: a.reader.search_hybrid(
            vectors(np.array([new[3]]), DIM)[0], "v0", k=1000, columns=["_offset"]
        ),
    }
    first = 1000
    for name, query in queries.items():
        new = list(range(first, first + 30))
        first += 30
        b.put(wb, new, 1)  # in B's memtable only, until the flush inside the query
        opened.clear()
        answer = query(new)
        # A hybrid query's text list: rows with a text (`rows_batch`: null when % 11 == 5).
        texts = [o for o in new if o % 11 != 5]
        for table, want in (
            [(answer[0], new), (answer[1], texts)] if name == "hybrid" else [(answer, new)]
        ):
            got = offsets(table)
            assert len(got) == len(set(got)), f"{name}: a row twice"
            assert set(want) <= set(got), f"{name}: rows lost in the flush"
        assert len(opened) >= 2, f"{name}: the query did not run again"
        assert opened[-1] > opened[0]
    # Each query ran again once (the metric operators see), and B counted its answers.
    assert a.events.stale_base == len(queries)
    assert "fresh" in b.events.kinds
    assert "fresh" not in a.events.kinds


def test_a_query_asks_the_owners_before_it_waits_for_base_fragments(
    pods: Callable[..., tuple[Pod, Pod]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vector (text) query sends its fan-out request before it waits for the base
    fragments no index covers to be held (loaded, read back): a fragment just flushed by
    another pod may take a while to load, and the owner searches its memtables meanwhile.
    Before, the query loaded first and asked after: it took the sum of the two."""
    a, b = pods()
    wa, wb = a.open(0), b.open(1)
    a.put(wa, list(range(10)), 0)
    a.flush(wa)  # a base fragment no index covers
    b.put(wb, list(range(1000, 1010)), 1)
    asked = threading.Event()
    answer = b.reader.fresh.answer

    def answer_noting(body: bytes) -> bytes:
        asked.set()
        return answer(body)

    monkeypatch.setattr(b.reader.fresh, "answer", answer_noting)
    waited: list[bool] = []  # at each wait for the base fragments: was the owner asked?
    assert a.reader.unindexed is not None
    assert a.reader.flushed_text is not None
    covering, views = a.reader.unindexed.covering, a.reader.flushed_text.views
    monkeypatch.setattr(
        a.reader.unindexed, "covering", lambda base: waited.append(asked.wait(5)) or covering(base)
    )
    monkeypatch.setattr(
        a.reader.flushed_text,
        "views",
        lambda base, column: waited.append(asked.wait(5)) or views(base, column),
    )
    found = a.reader.search_vector(vectors(np.array([1003]), DIM)[0], k=30, columns=["_offset"])
    assert waited == [True]
    assert set(offsets(found)) == {*range(10), *range(1000, 1010)}
    asked.clear()
    waited.clear()
    found = a.reader.search_text("v0", k=30, columns=["_offset"])
    assert waited == [True]
    assert {o for o in offsets(found) if o >= 1000}, "the owner's rows are in the answer"


def test_an_owner_that_does_not_answer_is_named_within_the_deadline(
    pods: Callable[..., tuple[Pod, Pod]],
) -> None:
    a, b = pods(timeout_ms=500)
    wa, wb = a.open(0), b.open(1)
    a.put(wa, list(range(10)), 0)
    b.put(wb, list(range(1000, 1010)), 1)
    # Pod B's query port now accepts connections and never answers (like a SIGSTOPped pod).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        stale = dataclasses.replace(
            b.config, advertised_url=f"http://127.0.0.1:{silent.getsockname()[1]}"
        )
        b.writers.remove(wb)
        wb.close(flush=False, timeout=10)
        wb2 = ShardWriter.open(
            wb.shard, b.spec, b.table, b.storage, stale, BlockingValve(1 << 40), b.flusher
        )
        b.writers.append(wb2)
        report = FanoutReport()
        started = time.monotonic()
        got = a.reader.scan(columns=["_offset"], report=report)
        assert time.monotonic() - started < 2.0
        assert offsets(got) == list(range(10))
        [missing] = report.missing
        assert missing.shard == wb.shard
        assert "no answer within 500 ms" in missing.reason
        assert a.events.missing == [(wb.shard, "timeout")]
        with pytest.raises(FreshRowsUnavailable, match=wb.shard):
            a.reader.scan(columns=["_offset"], report=FanoutReport(allow_partial=False))
        # Over HTTP: partial with the shard named, or 503 when partial answers are refused.
        headers = {"Authorization": f"Bearer {TOKEN}"}
        r = httpx.post(
            f"{a.url}/v1/search",
            json={"filter": "_offset >= 0", "k": 100},
            headers=headers,
            timeout=10,
        )
        assert r.status_code == 200
        body = r.json()
        assert body["partial"] is True
        assert [m["shard"] for m in body["missing"]] == [wb.shard]
        r = httpx.post(
            f"{a.url}/v1/lookup",
            json={"keys": [["t", 0, 1]], "allow_partial": False},
            headers=headers,
            timeout=10,
        )
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "fresh_rows_unavailable"


def test_a_scan_this_pods_memtables_fill_does_not_wait_for_the_owners(
    pods: Callable[..., tuple[Pod, Pod]],
) -> None:
    """Any `limit` matching rows answer a scan: when the coordinator's own memtables hold
    them, a silent owner neither delays the answer nor makes it partial; when they do not,
    the owner is waited for (and named)."""
    a, b = pods(timeout_ms=2000)
    wa, wb = a.open(0), b.open(1)
    a.put(wa, list(range(10)), 0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        stale = dataclasses.replace(
            b.config, advertised_url=f"http://127.0.0.1:{silent.getsockname()[1]}"
        )
        wb.close(flush=False, timeout=10)
        b.writers.remove(wb)
        b.writers.append(
            ShardWriter.open(
                wb.shard, b.spec, b.table, b.storage, stale, BlockingValve(1 << 40), b.flusher
            )
        )
        report = FanoutReport()
        started = time.monotonic()
        got = a.reader.scan(filter="_offset >= 3", columns=["_offset"], limit=5, report=report)
        assert time.monotonic() - started < 1.0
        assert len(offsets(got)) == 5
        assert set(offsets(got)) <= set(range(3, 10))
        assert report.missing == []
        # Not even asked: a request left unawaited would hold a fan-out thread for the
        # timeout, and queue other queries' requests behind it.
        silent.settimeout(0.3)
        with pytest.raises(TimeoutError):
            silent.accept()
        report = FanoutReport()
        got = a.reader.scan(filter="_offset >= 3", columns=["_offset"], limit=50, report=report)
        assert offsets(got) == list(range(3, 10))
        assert [m.shard for m in report.missing] == [wb.shard]


def test_a_malformed_fan_out_request_is_400_naming_what_is_wrong(
    pods: Callable[..., tuple[Pod, Pod]],
) -> None:
    """Every field of an owner request is checked before it is used: a missing `fetch`, a
    negative `limit`, a vector of another dimension, a base version that does not exist
    were 500s (KeyError, numpy, Lance errors), and `limit: -5` or `k: 10**9` were run."""
    a, _ = pods()
    writer = a.open(0)
    a.put(writer, list(range(10)), 0)
    version = a.table.dataset().version
    shards = {writer.shard: writer.epoch}
    headers = {"Authorization": f"Bearer {TOKEN}"}

    def post(meta: dict[str, Any]) -> httpx.Response:
        body = pack(pa.table({}), {"base_version": version, "shards": shards, **meta})
        return httpx.post(f"{a.url}/internal/v1/fresh", content=body, headers=headers, timeout=10)

    scan = {"kind": "scan", "filter": None, "limit": 5, "fetch": ["_offset"]}
    vector = {"kind": "vector", "k": 3, "fetch": ["_offset"], "vector": [0.5] * DIM}
    text = {
        "kind": "text", "column": "text", "terms": ["alpha"], "words": [["alpha", 0]],
        "idf": {"alpha": 1.0}, "avgdl": 4.0, "phrase": False, "k": 3, "fetch": ["_offset"],
    }  # fmt: skip
    for good in (scan, vector, text):
        r = post(good)
        assert r.status_code == 200, r.text
    assert unpack(post(scan).content)[0].num_rows == 5
    bad = [
        ({**scan, "fetch": None}, "'fetch' is not a list"),
        ({k: v for k, v in scan.items() if k != "limit"}, "no 'limit'"),
        ({**scan, "limit": -5}, "k must be between"),
        ({**scan, "limit": "5"}, "'limit' is not a int"),
        ({**scan, "filter": 7}, "'filter' is not a string"),
        ({**vector, "k": 10**9}, "k must be between"),
        ({**vector, "vector": [0.5] * 3}, f"not {DIM} finite numbers"),
        ({**vector, "vector": ["x"] * DIM}, "not a number"),
        ({**text, "column": "id"}, "is not a text column"),
        ({**text, "words": [["alpha"]]}, "not [term, position]"),
        ({**text, "avgdl": "4"}, "'avgdl' is not a float"),
        ({**text, "phrase": 1}, "'phrase' is not a bool"),
        ({**scan, "base_version": version + 1000}, f"base version {version + 1000}"),
    ]
    for meta, says in bad:
        r = post(meta)
        assert r.status_code == 400, (meta, r.text)
        assert says in r.text, (says, r.text)


def test_the_internal_endpoint_needs_the_token(pods: Callable[..., tuple[Pod, Pod]]) -> None:
    a, _ = pods()
    r = httpx.post(f"{a.url}/internal/v1/fresh", content=b"x", timeout=10)
    assert r.status_code == 401


@pytest.mark.parametrize("known", [True, False], ids=["partitions-listed", "not-yet-listed"])
def test_a_shard_claimed_after_the_owners_were_read_is_asked(tmp_path: Path, known: bool) -> None:
    """Pod B claims a new shard and makes rows durable after pod A read the owners: a
    query to pod A routes to it at once. Routing by A's cached copy, which does not list
    the shard, lost those rows with no `partial` (seen in a rebalance under load)."""
    spec = read_spec(str(tmp_path / "table.lance"), "append", DIM)
    storage = open_storage(str(tmp_path / "wal"))
    shards = {f"t-{p}-fanout" for p in (0, 1)}  # every partition's shard (from the brokers)
    a = Pod(spec, storage, expected=lambda: shards if known else None)
    b = Pod(spec, storage)
    try:
        a.owners.refresh_s = 3600  # the copy is never old: only `need` makes A re-read it
        wa = a.open(0)
        a.put(wa, list(range(10)), 0)
        assert offsets(a.reader.scan(columns=["_offset"])) == list(range(10))
        wb = b.open(1)
        b.put(wb, list(range(1000, 1005)), 1)  # durable: its offsets may be committed
        report = FanoutReport()
        got = a.reader.scan(columns=["_offset"], report=report)
        assert offsets(got) == [*range(10), *range(1000, 1005)]
        assert report.missing == []
    finally:
        b.close()
        a.close()


def test_local_mode_makes_no_request(
    pods: Callable[..., tuple[Pod, Pod]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod that holds every listed shard answers without a network hop."""
    a, _ = pods()
    wa0, wa1 = a.open(0), a.open(1)
    a.put(wa0, list(range(10)), 0)
    a.put(wa1, list(range(10, 20)), 1)
    posted: list[str] = []
    monkeypatch.setattr(a.fanout, "post", lambda url, *args: posted.append(url) or b"")
    assert offsets(a.reader.scan(columns=["_offset"])) == list(range(20))
    assert posted == []


def test_a_fenced_owner_serves_nothing(pods: Callable[..., tuple[Pod, Pod]]) -> None:
    """The manifest names a newer epoch than the owner pod's writer holds (a new writer
    claimed the shard; the old one has not noticed): the old writer's rows are not served,
    and the shard is reported missing rather than answered from a stale writer."""
    a, b = pods()
    # Pod B's writer checks for a fence only now and then (wal.fence_check_interval_ms):
    # until it does, only the epoch tells it is stale.
    b.config = dataclasses.replace(b.config, fence_check_interval_s=3600)
    wa, wb = a.open(0), b.open(1)
    a.put(wa, list(range(10)), 0)
    b.put(wb, list(range(1000, 1010)), 1)
    assert offsets(a.reader.scan(columns=["_offset"])) == [*range(10), *range(1000, 1010)]
    ManifestStore(b.storage, wb.shard).claim(b.url)  # epoch 2, listed at pod B's URL
    deadline = time.monotonic() + 10
    while a.owners.current()[wb.shard].epoch != 2:  # the listing is re-read in the background
        assert time.monotonic() < deadline, "the owners were never re-read"
        time.sleep(0.01)
    report = FanoutReport()
    got = a.reader.scan(columns=["_offset"], report=report)
    assert offsets(got) == list(range(10))
    [missing] = report.missing
    assert missing.shard == wb.shard
    assert missing.cause == "unheld"
    assert "fenced (epoch 1 < 2)" in missing.reason


def test_a_shard_whose_writer_advertised_no_url_is_named_missing(
    pods: Callable[..., tuple[Pod, Pod]],
) -> None:
    """Pod B's writer recorded no URL (its query API off, or an earlier build): its fresh
    rows are in no other pod's answer, and the answer says so, naming the partition. It
    used to leave them out silently."""
    a, b = pods()
    b.config = dataclasses.replace(b.config, advertised_url="")
    wa, wb = a.open(0), b.open(1)
    a.put(wa, list(range(10)), 0)
    b.put(wb, list(range(1000, 1010)), 1)
    assert a.owners.current()[wb.shard].url == ""
    report = FanoutReport()
    got = a.reader.scan(columns=["_offset"], report=report)
    assert offsets(got) == list(range(10))
    [missing] = report.missing
    assert (missing.shard, missing.cause, missing.owner) == (wb.shard, "unadvertised", "")
    assert missing.partitions == ("t:1",)  # from the manifest's origin: nothing flushed yet
    assert "advertised no URL" in missing.reason
    assert a.events.missing == [(wb.shard, "unadvertised")]
    b.flush(wb)  # flushed: in the base, and still unadvertised (its memtables unasked)
    report = FanoutReport()
    got = a.reader.scan(columns=["_offset"], report=report)
    assert offsets(got) == [*range(10), *range(1000, 1010)]
    assert [m.cause for m in report.missing] == ["unadvertised"]
