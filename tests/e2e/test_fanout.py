"""Fan-out reads across real processes: three `lance-sink run` in one consumer group on one
table (local directory), each serving the query API on its own port and advertising it in
the shard manifests. A row committed by any of them is returned by a query to every one of
them (vector, text, filter, lookup) before its memtable is flushed; a key updated or deleted
in one pod's memtable shadows its base row in every pod's answers; and a SIGSTOPped owner
makes a query return within its deadline, naming the partitions it lacks (I18). Each test
runs with maintenance off and on (production runs it: index builds, compaction and cleanup
commit to the base while pods read it and flush into it)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
import lance
import pytest

from tests.support.brokers import Broker, free_ports
from tests.support.kafka import committed_offsets, produce
from tests.support.maintenance import (
    MAINTENANCE,
    MAINTENANCE_OFF,
    MAINTENANCE_ON,
    assert_maintained_without_flush_failures,
    assert_no_flush_failures,
    maintenance_done,
)
from tests.support.sink import SinkProcess, message, wait_caught_up, write_config

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

TOKEN = "fan-out-token"
PARTITIONS = 4
FIRST = 80  # rows per partition flushed into the base (memtable.max_rows)


def vector_of(i: int) -> list[float]:
    return list(json.loads(message(i)[1])["vec"])


def start_pods(
    tmp_path: Path,
    bootstrap: str,
    topic: str,
    group: str,
    names: str = "abc",
    memtable: dict[str, Any] | None = None,
    table_uri: str | None = None,
    storage_options: dict[str, str] | None = None,
    maintenance: dict[str, Any] | None = None,
    advertise: bool = True,
) -> tuple[list[SinkProcess], list[str]]:
    """Sink processes named by `names`, each with its query API on its own port; with
    `advertise` False, a plain query section (no host, no advertised URL: derived)."""
    procs, urls = [], []
    # The query and the metrics ports picked together, all distinct: with metrics_port 0 a
    # pod's metrics server could be given the port just picked for its query server.
    ports = free_ports(2 * len(names))
    for name, port, metrics_port in zip(names, ports[::2], ports[1::2], strict=True):
        url = f"http://127.0.0.1:{port}"
        config = write_config(
            tmp_path / f"{name}.toml",
            bootstrap=bootstrap,
            topics=[topic],
            group=group,
            table_uri=table_uri or str(tmp_path / "table.lance"),
            mode="upsert",
            extra={
                # Fresh rows stay in memtables: only each partition's first FIRST rows flush.
                "memtable": memtable or {"max_rows": FIRST, "max_age_s": 3600},
                "query": {
                    "enabled": True,
                    "port": port,
                    "fanout_timeout_ms": 1000,
                    "owners_refresh_ms": 200,
                    "max_k": 100_000,
                    **({"host": "127.0.0.1", "advertised_url": url} if advertise else {}),
                },
                "maintenance": maintenance or {},  # {}: on (write_config's default)
                "observability": {"metrics_port": metrics_port},
            },
        )
        env = {"LANCE_SINK__QUERY__AUTH_TOKEN": TOKEN}
        for key, value in (storage_options or {}).items():  # the table's, and the WAL's
            env[f"LANCE_SINK__TABLE__STORAGE_OPTIONS__{key.upper()}"] = value
        procs.append(SinkProcess(config, tmp_path / f"{name}.log", env=env))
        urls.append(url)
    return procs, urls


def owners(procs: list[SinkProcess]) -> dict[int, int]:
    """partition -> index of the process that holds it now (from their logs)."""
    latest: dict[int, tuple[str, int]] = {}
    for i, proc in enumerate(procs):
        for e in proc.events():
            if e.get("event") == "partition_assigned":
                seen = latest.get(e["partition"])
                if seen is None or e["timestamp"] > seen[0]:
                    latest[e["partition"]] = (e["timestamp"], i)
    return {p: i for p, (_, i) in latest.items()}


def wait_serving(procs: list[SinkProcess], urls: list[str], timeout: float = 90) -> None:
    """Until every process answers queries (its query server is up)."""
    deadline = time.monotonic() + timeout
    for proc, url in zip(procs, urls, strict=True):
        while True:
            assert proc.alive(), proc.log_path.read_text()[-3000:]
            try:
                httpx.get(url + "/openapi.json", timeout=2)
            except httpx.TransportError:
                assert time.monotonic() < deadline, f"{url} never served"
                time.sleep(0.2)
            else:
                break


def post(url: str, path: str, body: dict[str, Any], timeout: float = 20) -> dict[str, Any]:
    r = httpx.post(
        url + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=timeout
    )
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


#: Maintenance on for a base of PARTITIONS * FIRST rows, the vector index included (built
#: once every partition's first rows are in: IVF_PQ on fewer than 256 rows is an empty
#: index), so base rows are found through every kind of index the base can have.
MAINTENANCE_ON_SMALL_BASE = {**MAINTENANCE_ON, "vector_index_min_rows": PARTITIONS * FIRST}
#: What maintenance must have done to the base before the queries are asked: the tasks,
#: and the columns whose index holds base rows.
BASE_MAINTAINED = {"vector_index", "fts_index", "key_index", "scalar_indexes", "compact"}
BASE_INDEXED = {"vec", "text", "id", "n"}


@pytest.mark.parametrize(
    "maintenance",
    [
        pytest.param(MAINTENANCE_OFF, id="maintenance-off"),
        pytest.param(MAINTENANCE_ON_SMALL_BASE, id="maintenance-on"),
    ],
)
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_any_pod_answers_with_every_committed_row(
    mock_broker: Broker,
    topic: str,
    group: str,
    tmp_path: Path,
    where: str,
    maintenance: dict[str, Any],
    request: pytest.FixtureRequest,
) -> None:
    """Every pod answers with every committed row: its own memtables', the other pods'
    (fan-out) and the base's, with updates and deletes in memtables shadowing base rows.
    With maintenance on, the queries are asked once the base is indexed (vector, text, key,
    scalar) and compacted: base rows come through the indexes, memtable rows do not."""
    bootstrap = mock_broker.bootstrap
    table_uri, options = str(tmp_path / "table.lance"), None
    if where == "s3":
        bucket: str = request.getfixturevalue("s3_bucket")
        options = request.getfixturevalue("s3_storage_options")
        table_uri = f"s3://{bucket}/fanout/table.lance"
    # Every partition exists before the group forms (the mock cluster creates 4).
    for p in range(PARTITIONS):
        produce(bootstrap, topic, [message(p)], partition=p)
    key_partition = {i: i % PARTITIONS for i in range(10_000)}
    procs, urls = start_pods(
        tmp_path,
        bootstrap,
        topic,
        group,
        table_uri=table_uri,
        storage_options=options,
        maintenance=maintenance,
    )
    try:
        deadline = time.monotonic() + 90
        while len(set(owners(procs).values())) < 3 or len(owners(procs)) < PARTITIONS:
            assert time.monotonic() < deadline, f"partitions not spread: {owners(procs)}"
            for proc in procs:
                assert proc.alive(), proc.log_path.read_text()[-3000:]
            time.sleep(0.5)

        def send(ids: list[int], **overrides: Any) -> None:
            for p in range(PARTITIONS):
                rows: list[tuple[bytes, bytes | None]] = []
                for i in ids:
                    if key_partition[i] != p:
                        continue
                    key, value = message(i)
                    if i in overrides.get("deleted", ()):
                        rows.append((key, None))
                        continue
                    if i in overrides.get("updated", ()):
                        body = json.loads(value)
                        body.update(n=10_000 + i, text="updated value")
                        value = json.dumps(body).encode()
                    rows.append((key, value))
                produce(bootstrap, topic, rows, partition=p)

        # Each partition's first FIRST rows (the 4 produced above included) fill one memtable,
        # sealed by the next put and flushed into the base; the rest stay in the owners'
        # memtables (the next seal would need FIRST more rows, or an hour).
        send(list(range(PARTITIONS, PARTITIONS * FIRST)))
        wait_caught_up(bootstrap, group, topic, procs=procs)
        fresh = list(range(PARTITIONS * FIRST, PARTITIONS * FIRST + 20))
        send([5, 6], updated={5}, deleted={6})
        send(fresh)
        wait_caught_up(bootstrap, group, topic, procs=procs)

        def base_rows() -> int:
            return int(lance.dataset(table_uri, storage_options=options).count_rows())

        deadline = time.monotonic() + 60
        while base_rows() < PARTITIONS * FIRST:
            assert time.monotonic() < deadline, "the first memtables were not flushed"
            time.sleep(0.2)

        def indexed() -> set[str]:
            """The columns whose index holds rows of the base."""
            ds = lance.dataset(table_uri, storage_options=options)
            return {c for i in ds.describe_indices() if i.num_rows_indexed for c in i.field_names}

        if maintenance["enabled"]:
            deadline = time.monotonic() + 60
            while True:
                done, columns = maintenance_done(procs), indexed()
                if done >= BASE_MAINTAINED and columns >= BASE_INDEXED:
                    break
                assert time.monotonic() < deadline, f"maintenance did {done}, indexed {columns}"
                time.sleep(0.5)
        time.sleep(1)
        assert base_rows() == PARTITIONS * FIRST  # no more flushed

        expected = {f"m-{i}" for i in range(PARTITIONS * FIRST) if i != 6} | {
            f"m-{i}" for i in fresh
        }
        for url in urls:
            rows = post(url, "/v1/search", {"filter": "n >= 0", "k": 1000, "columns": ["id", "n"]})
            assert "partial" not in rows, rows.get("missing")
            ids = [r["id"] for r in rows["rows"]]
            assert len(ids) == len(set(ids)), f"{url}: a row twice"
            assert set(ids) == expected, f"{url}: {sorted(expected ^ set(ids))[:10]}"
            assert {r["id"]: r["n"] for r in rows["rows"]}["m-5"] == 10_005
            # vector: a fresh row from every partition is its own nearest neighbour
            for i in fresh[:PARTITIONS]:
                got = post(url, "/v1/search", {"vector": vector_of(i), "k": 1, "columns": ["id"]})
                assert got["rows"][0]["id"] == f"m-{i}", (url, i)
            got = post(url, "/v1/search", {"vector": vector_of(6), "k": 20, "columns": ["id"]})
            assert "m-6" not in [r["id"] for r in got["rows"]]
            # text: the fresh row's own number, and the update's words
            i = fresh[-1]
            got = post(url, "/v1/search", {"text": f"number {i}", "k": 1, "columns": ["id"]})
            assert got["rows"][0]["id"] == f"m-{i}"
            got = post(url, "/v1/search", {"text": "updated", "k": 5, "columns": ["id"]})
            assert [r["id"] for r in got["rows"]] == ["m-5"]
            # lookup
            keys = ["m-5", "m-6", f"m-{fresh[1]}", f"m-{fresh[2]}", "m-1"]
            got = post(url, "/v1/lookup", {"keys": keys, "columns": ["id", "n"]})
            assert {r["id"]: r["n"] for r in got["rows"]} == {
                "m-5": 10_005,
                f"m-{fresh[1]}": fresh[1],
                f"m-{fresh[2]}": fresh[2],
                "m-1": 1,
            }

        # An owner stopped with SIGSTOP: a query to another pod returns within its deadline
        # and names the partitions whose fresh rows it lacks.
        held = owners(procs)
        stopped = held[0]
        asked = next(i for i in range(3) if i != stopped)
        lacking = sorted(f"{topic}:{p}" for p, i in held.items() if i == stopped)
        os.kill(procs[stopped].proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            got = post(
                urls[asked], "/v1/search", {"filter": "n >= 0", "k": 1000, "columns": ["id"]}
            )
            took = time.monotonic() - started
            assert took < 3.0, took
            assert got["partial"] is True
            named = sorted(p for m in got["missing"] for p in m["partitions"])
            assert named == lacking, got["missing"]
            r = httpx.post(
                urls[asked] + "/v1/lookup",
                json={"keys": ["m-1"], "allow_partial": False},
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=20,
            )
            assert r.status_code == 503
            assert r.json()["error"]["type"] == "fresh_rows_unavailable"
        finally:
            os.kill(procs[stopped].proc.pid, signal.SIGCONT)
    finally:
        codes = [p.stop() for p in procs]
    assert codes == [0, 0, 0]
    if maintenance["enabled"]:
        assert_maintained_without_flush_failures(procs)
    else:
        assert_no_flush_failures(procs)


def test_a_plain_config_fans_out_and_names_a_process_that_advertises_nothing(
    mock_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """Three processes with a plain query section (no host, no advertised URL) each derive
    their URL, so a query to any of them returns every committed row with no partial
    answer: before, each answered with its own partitions' fresh rows alone (25-50 % of
    the rows), silently. A fourth process with the query API off advertises nothing: the
    others' answers then say partial and name its partition (cause unadvertised)."""
    bootstrap = mock_broker.bootstrap
    for p in range(PARTITIONS):  # every partition exists before the group forms
        produce(bootstrap, topic, [message(p)], partition=p)
    procs, urls = start_pods(
        tmp_path, bootstrap, topic, group, maintenance=MAINTENANCE_OFF, advertise=False
    )
    try:
        deadline = time.monotonic() + 90
        while len(set(owners(procs).values())) < 3 or len(owners(procs)) < PARTITIONS:
            assert time.monotonic() < deadline, f"partitions not spread: {owners(procs)}"
            time.sleep(0.5)
        for proc, url in zip(procs, urls, strict=True):
            [derived] = [e for e in proc.events() if e["event"] == "advertised_url_derived"]
            assert derived["url"] == url, derived  # the route to the broker on 127.0.0.1
        rows = [message(i) for i in range(PARTITIONS, 100)]
        for p in range(PARTITIONS):
            produce(bootstrap, topic, rows[p::PARTITIONS], partition=p)
        wait_caught_up(bootstrap, group, topic, procs=procs)
        everything = {f"m-{i}" for i in range(100)}
        wait_serving(procs, urls)
        for url in urls:  # every row is in some process's memtables (max_rows 80 per shard)
            got = post(url, "/v1/search", {"filter": "n >= 0", "k": 1000, "columns": ["id"]})
            assert "partial" not in got, got.get("missing")
            assert sorted(r["id"] for r in got["rows"]) == sorted(everything), url

        quiet = write_config(
            tmp_path / "d.toml",
            bootstrap=bootstrap,
            topics=[topic],
            group=group,
            table_uri=str(tmp_path / "table.lance"),
            mode="upsert",
            extra={
                "memtable": {"max_rows": FIRST, "max_age_s": 3600},
                "maintenance": MAINTENANCE_OFF,
            },  # the query API off (write_config's default)
        )
        procs.append(SinkProcess(quiet, tmp_path / "d.log"))
        deadline = time.monotonic() + 90
        while 3 not in owners(procs).values():
            assert procs[3].alive(), procs[3].log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the fourth process holds nothing: {owners(procs)}"
            time.sleep(0.5)
        wait_caught_up(bootstrap, group, topic, procs=procs)
        more = [message(i) for i in range(100, 140)]
        for p in range(PARTITIONS):
            produce(bootstrap, topic, more[p::PARTITIONS], partition=p)
        wait_caught_up(bootstrap, group, topic, procs=procs)
        held = owners(procs)
        unadvertised = sorted(f"{topic}:{p}" for p, i in held.items() if i == 3)
        for url in urls:
            # A pod's copy of the owners read before the fourth claimed its shard names the
            # old owner (partial too, cause unheld) until it is re-read (owners_refresh_ms).
            deadline = time.monotonic() + 10
            while True:
                got = post(url, "/v1/search", {"filter": "n >= 0", "k": 1000, "columns": ["id"]})
                assert got["partial"] is True, got
                if all("advertised no URL" in m["reason"] for m in got["missing"]):
                    break
                assert time.monotonic() < deadline, got["missing"]
                time.sleep(0.2)
            named = sorted(p for m in got["missing"] for p in m["partitions"])
            assert named == unadvertised, got["missing"]
            assert {m["owner"] for m in got["missing"]} == {""}
            ids = {r["id"] for r in got["rows"]}  # every row but the unadvertised fresh ones
            assert {f"m-{i}" for i in range(140)} - ids <= {
                f"m-{i}" for i in range(140) if f"{topic}:{i % PARTITIONS}" in unadvertised
            }
    finally:
        codes = [p.stop() for p in procs]
    assert codes == [0] * len(procs)


#: What maintenance must have done while a stream of queries ran: index builds, and a
#: compaction of indexed fragments.
UNDER_QUERIES = {"fts_index", "key_index", "scalar_indexes", "compact"}


@MAINTENANCE
def test_rebalance_and_kill_during_a_stream_of_queries(
    mock_broker: Broker, topic: str, group: str, tmp_path: Path, maintenance: dict[str, Any]
) -> None:
    """Queries to the live pods while messages stream in, a pod joins and another is
    SIGKILLed: no answer holds a row twice, and no answer lacks a row whose offset was
    committed before the query started, unless it says it is partial. With maintenance on,
    index builds and compactions commit to the base under the queries and the flushes."""
    bootstrap = mock_broker.bootstrap
    for p in range(PARTITIONS):
        produce(bootstrap, topic, [message(p)], partition=p)
    small = {"max_rows": 300, "max_age_s": 3600}  # flushes happen during the stream too
    procs, urls = start_pods(
        tmp_path, bootstrap, topic, group, "ab", small, maintenance=maintenance
    )
    wait_serving(procs, urls)
    total, sent = 2_400, [PARTITIONS]
    # Message i goes to partition i % PARTITIONS at local index i // PARTITIONS.

    def stream() -> None:
        while sent[0] < total:
            chunk = range(sent[0], min(sent[0] + 80, total))
            for p in range(PARTITIONS):
                produce(bootstrap, topic, [message(i) for i in chunk if i % PARTITIONS == p], p)
            sent[0] = chunk.stop
            time.sleep(0.25)

    producer = threading.Thread(target=stream, daemon=True)
    producer.start()
    answers = {"complete": 0, "partial": 0}
    killed: set[int] = set()

    def query_round() -> None:
        committed = committed_offsets(bootstrap, group, topic, PARTITIONS)
        must = {
            f"m-{i}" for i in range(sent[0]) if i // PARTITIONS < committed.get(i % PARTITIONS, -1)
        }
        for k, url in enumerate(urls):
            if k in killed:
                continue
            rows = post(url, "/v1/search", {"filter": "n >= 0", "k": 100_000, "columns": ["id"]})
            ids = [r["id"] for r in rows["rows"]]
            assert len(ids) == len(set(ids)), f"{url}: a row twice"
            if rows.get("partial"):
                answers["partial"] += 1
                continue
            answers["complete"] += 1
            lost = must - set(ids)
            assert not lost, f"{url}: committed rows missing: {sorted(lost)[:10]}"

    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            query_round()
        more, more_urls = start_pods(
            tmp_path, bootstrap, topic, group, "c", small, maintenance=maintenance
        )
        wait_serving(more, more_urls)
        procs += more
        urls += more_urls
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the join's rebalance
            query_round()
        procs[0].kill()
        killed.add(0)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # the session timeout, then replay elsewhere
            query_round()
        # With maintenance on, the queries go on until it has indexed and compacted the
        # base (it begins after them, at the first flush): its commits land among them.
        deadline = time.monotonic() + 60
        while maintenance["enabled"] and not (done := maintenance_done(procs)) >= UNDER_QUERIES:
            assert time.monotonic() < deadline, f"maintenance did only {done}"
            query_round()
        producer.join(60)
        wait_caught_up(bootstrap, group, topic, timeout=120, procs=procs[1:])
        query_round()
        assert answers["complete"] >= 5, answers
    finally:
        codes = [p.stop() for k, p in enumerate(procs) if k not in killed]
    assert codes == [0] * len(codes)
    if maintenance["enabled"]:
        assert_maintained_without_flush_failures(procs)
    else:
        assert_no_flush_failures(procs)
