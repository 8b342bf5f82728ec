"""A rolling deploy that widens a column: a `lance-sink run` with the new settings (`n` as
int64, `table.evolve = true`) joins the group of one still running the old ones (`n` as
int32) on the same table. The newcomer widens the column as it opens the table; the old
pod goes on with its partitions until it is replaced. Every row of both is in the table
exactly once with its value, the old pod's flushes are not refused, and its queries answer
the values only the wider type holds (I17)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
import lance
import pyarrow as pa
import pytest

from tests.support.brokers import Broker, free_ports
from tests.support.kafka import produce
from tests.support.sink import SinkProcess, message, wait_caught_up, write_config

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

PARTITIONS = 4  # the test brokers' default for a topic created by producing to it
BIG = 2**40  # only int64 holds it


def pod(
    tmp_path: Path, name: str, bootstrap: str, topic: str, group: str, *, widened: bool
) -> tuple[SinkProcess, str]:
    port, metrics_port = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    path = write_config(
        tmp_path / f"{name}.toml",
        bootstrap=bootstrap,
        topics=[topic],
        group=group,
        table_uri=str(tmp_path / "table.lance"),
        extra={
            "memtable": {"max_rows": 20},  # flushes while both run
            "query": {
                "enabled": True,
                "port": port,
                "host": "127.0.0.1",
                "advertised_url": url,
                "owners_refresh_ms": 200,
                "max_k": 10_000,
            },
            "observability": {"metrics_port": metrics_port},
        },
    )
    text = path.read_text()
    if widened:
        text = text.replace('mode = "append"', 'mode = "append"\nevolve = true')
    else:
        text = text.replace('{ name = "n", type = "int64" }', '{ name = "n", type = "int32" }')
    path.write_text(text)
    return SinkProcess(path, tmp_path / f"{name}.log"), url


def holders(procs: list[SinkProcess]) -> dict[int, int]:
    """partition -> index of the process that holds it now (from their logs)."""
    latest: dict[int, tuple[str, int]] = {}
    for i, proc in enumerate(procs):
        for e in proc.events():
            if e.get("event") in ("partition_assigned", "partition_revoked"):
                seen = latest.get(e["partition"])
                if seen is None or e["timestamp"] >= seen[0]:
                    held = i if e["event"] == "partition_assigned" else -1
                    latest[e["partition"]] = (e["timestamp"], held)
    return {p: i for p, (_, i) in latest.items() if i >= 0}


def big(i: int) -> tuple[bytes, bytes]:
    _key, value = message(i)
    body: dict[str, Any] = json.loads(value)
    body.update(id=f"big-{i}", n=BIG + i)
    return f"big-{i}".encode(), json.dumps(body).encode()


def search(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/v1/search", json=body, timeout=20)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_a_rolling_deploy_that_widens_a_column(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    bootstrap = kafka_broker.bootstrap
    for p in range(PARTITIONS):
        produce(bootstrap, topic, [message(i) for i in range(p * 100, p * 100 + 40)], partition=p)
    old, old_url = pod(tmp_path, "old", bootstrap, topic, group, widened=False)
    procs = [old]
    try:
        wait_caught_up(bootstrap, group, topic, procs=procs)
        new, _ = pod(tmp_path, "new", bootstrap, topic, group, widened=True)
        procs.append(new)
        deadline = time.monotonic() + 90
        while True:  # the newcomer evolved the table and took some partitions
            held = holders(procs)
            if len(held) == PARTITIONS and set(held.values()) == {0, 1}:
                break
            assert time.monotonic() < deadline, held
            assert all(p.alive() for p in procs), new.log_path.read_text()[-3000:]
            time.sleep(0.2)
        assert lance.dataset(str(tmp_path / "table.lance")).schema.field("n").type == pa.int64()
        old_parts = sorted(p for p, i in held.items() if i == 0)
        new_parts = sorted(p for p, i in held.items() if i == 1)
        # The old pod's partitions go on with values its int32 holds, flushed (20 a
        # memtable) into the table the newcomer widened; the newcomer's take big ones.
        later = {p: range(p * 100 + 40, p * 100 + 100) for p in range(PARTITIONS)}
        for p in old_parts:
            produce(bootstrap, topic, [message(i) for i in later[p]], partition=p)
        for p in new_parts:
            produce(bootstrap, topic, [big(i) for i in later[p]], partition=p)
        wait_caught_up(bootstrap, group, topic, procs=procs)

        table = str(tmp_path / "table.lance")
        want_old = {f"m-{i}" for p in old_parts for i in later[p]}
        deadline = time.monotonic() + 60
        while True:  # the old pod's flushes land (they were refused until it was poisoned)
            ids = set(lance.dataset(table).to_table(columns=["id"]).column("id").to_pylist())
            if want_old - ids == set():
                break
            assert time.monotonic() < deadline, sorted(want_old - ids)[:10]
            assert old.alive(), old.log_path.read_text()[-3000:]
            time.sleep(0.5)
        # The old pod answers the values only int64 holds (its own settings say int32):
        # from the base and from the newcomer's memtables alike.
        got = search(old_url, {"filter": f"n >= {BIG}", "k": 1000, "columns": ["id", "n"]})
        assert "partial" not in got, got.get("missing")
        want_big = {f"big-{i}": BIG + i for p in new_parts for i in later[p]}
        assert {r["id"]: r["n"] for r in got["rows"]} == want_big
    finally:
        for proc in procs:
            assert proc.stop() == 0, proc.log_path.read_text()[-3000:]

    rows = lance.dataset(table).to_table(columns=["id", "n"]).to_pylist()
    assert len(rows) == len({r["id"] for r in rows}), "a row twice"
    expected = {f"m-{i}": i for p in range(PARTITIONS) for i in range(p * 100, p * 100 + 40)}
    expected |= {f"m-{i}": i for p in old_parts for i in later[p]}
    expected |= want_big
    assert {r["id"]: r["n"] for r in rows} == expected
    logs = "".join(p.log_path.read_text() for p in procs)
    assert '"event": "flush_failed"' not in logs
    assert '"event": "shard_poisoned"' not in logs
