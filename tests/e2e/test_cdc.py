"""Debezium change events through the real `lance-sink run` into a real Lance table: the
table ends as the simulated source table's final state (every surviving key with its last
image, no deleted key) across a SIGKILL and a rebalance with maintenance on, and the same
events delivered again (a connector restart) end in the same table."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import time
from pathlib import Path
from typing import Any

import lance
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from sink.cdc import logical_value
from tests.e2e.test_fanout import TOKEN, post, wait_serving
from tests.e2e.test_maintenance_role import metrics
from tests.support import debezium as dbz
from tests.support.brokers import Broker, free_ports
from tests.support.kafka import committed_offsets, produce
from tests.support.registry import FakeRegistry
from tests.support.sink import SinkProcess, table_rows, wait_caught_up, write_config
from tests.unit.test_decode_cdc import AVRO_ENVELOPE, AVRO_KEY

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]

DIM = 8
SCHEMA = dbz.envelope_schema()
TABLE = """[table]
uri = {uri}
mode = "upsert"
primary_key = ["id"]
fts_columns = ["name"]
columns = [
  {{ name = "id", type = "int64", nullable = false }},
  {{ name = "name", type = "string" }},
  {{ name = "price", type = "float64" }},
  {{ name = "added", type = "timestamp" }},
  {{ name = "updated", type = "timestamp" }},
  {{ name = "changed_at", type = "timestamp" }},
  {{ name = "lsn", type = "int64" }},
]
vector = {{ column = "vec", dim = {dim}, metric = "l2" }}
"""


def cdc_config(
    tmp_path: Path,
    bootstrap: str,
    topic: str,
    group: str,
    name: str = "sink",
    extra: dict[str, dict[str, Any]] | None = None,
) -> tuple[Path, str]:
    """The products table fed by `topic`'s change events (maintenance on)."""
    uri = str(tmp_path / "products.lance")
    sections: dict[str, dict[str, Any]] = {
        "source": {
            "envelope": "debezium",
            "columns": {
                "vec": "$.after.embedding",
                "changed_at": "$.source.ts_ms",
                "lsn": "$.source.lsn",
            },
        },
        "kafka": {"consume_batch_size": 300},
        "memtable": {"max_rows": 400},
        "maintenance": {"scalar_indexes": {"lsn": "BTREE"}},
    }
    for section, values in (extra or {}).items():
        sections.setdefault(section, {}).update(values)
    path = write_config(
        tmp_path / f"{name}.toml",
        bootstrap=bootstrap,
        topics=[topic],
        group=group,
        table_uri=uri,
        extra=sections,
    )
    text = path.read_text()
    text = text[: text.index("[table]")] + TABLE.format(uri=f'"{uri}"', dim=DIM)
    path.write_text(text)
    return path, uri


def check_table(uri: str, final: dict[int, dict[str, Any]]) -> None:
    """The table holds exactly the source table's final rows, each its last image."""
    rows = table_rows(uri)
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows), "a key is in the table twice"
    assert sorted(by_id) == sorted(final), "deleted keys present or surviving keys missing"
    for id_, image in final.items():
        row = by_id[id_]
        assert row["name"] == image["name"], id_
        price = logical_value(
            "org.apache.kafka.connect.data.Decimal", {"scale": "2"}, image["price"], "float64"
        )
        assert row["price"] == float(decimal.Decimal(price)), id_
        assert row["added"] == dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
            days=image["added"]
        )
        assert row["updated"] == dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
            milliseconds=image["updated"] // 1000
        )
        assert row["vec"] == pytest.approx(image["embedding"], rel=1e-6, abs=1e-7)
        assert row["lsn"] is not None
        assert row["changed_at"] is not None


def test_change_history_across_a_sigkill_and_a_rebalance_then_redelivered(
    mock_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    events, final = dbz.history(4000, 1000, DIM, seed=41)
    ever = {id_ for key, _ in events for id_ in [dbz.key_id(key)]}
    assert len(ever) - len(final) > 50, "the history must end with deleted keys"
    config, uri = cdc_config(tmp_path, mock_broker.bootstrap, topic, group)
    half = len(events) // 2
    produce(mock_broker.bootstrap, topic, events[:half])
    first = SinkProcess(config, tmp_path / "first.log")
    second: SinkProcess | None = None
    try:
        deadline = time.monotonic() + 90
        while sum(committed_offsets(mock_broker.bootstrap, group, topic, 4).values()) < half // 4:
            assert first.alive(), first.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "nothing was committed"
            time.sleep(0.05)
        # A second member joins (a rebalance), then the first is killed mid-stream.
        second = SinkProcess(config, tmp_path / "second.log")
        produce(mock_broker.bootstrap, topic, events[half : 3 * half // 2])
        time.sleep(3)
        first.kill()
        produce(mock_broker.bootstrap, topic, events[3 * half // 2 :])
        wait_caught_up(mock_broker.bootstrap, group, topic, timeout=180, procs=[second])
    finally:
        first.kill()
        code = second.stop() if second is not None else 0
    assert code == 0, second.log_path.read_text()[-3000:] if second else ""
    check_table(uri, final)

    # The connector restarts and delivers the whole history again: the same table. The
    # redelivered changes stay in memtables (no flush until the stop), where a lookup
    # already answers with each key's newest image, and without the deleted keys.
    port, metrics_port = free_ports(2)
    fresh, _ = cdc_config(
        tmp_path,
        mock_broker.bootstrap,
        topic,
        group,
        name="fresh",
        extra={
            "memtable": {"max_rows": 1_000_000, "max_age_s": 3600},
            "query": {"enabled": True, "port": port},
            "observability": {"metrics_port": metrics_port},
        },
    )
    # Then two changes no table holds yet: an insert and an update (memtable rows only).
    source = dbz.pg_source(10**9, 1_800_000_000_000)
    survivor = min(final)
    final[survivor] = dbz.product_image(survivor, 999, DIM)
    final[10_000] = dbz.product_image(10_000, 1, DIM)
    news = [
        (dbz.key(survivor), dbz.value(dbz.envelope("u", None, final[survivor], source), SCHEMA)),
        (dbz.key(10_000), dbz.value(dbz.envelope("c", None, final[10_000], source), SCHEMA)),
        (None, dbz.value(dbz.envelope("t", None, None, source), SCHEMA)),  # skipped, counted
    ]
    produce(mock_broker.bootstrap, topic, [*events, *news])
    third = SinkProcess(fresh, tmp_path / "third.log", env={"LANCE_SINK__QUERY__AUTH_TOKEN": TOKEN})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_caught_up(mock_broker.bootstrap, group, topic, timeout=180, procs=[third])
        wait_serving([third], [url])
        gone = sorted(ever - set(final))[:20]
        last = [dbz.key_id(key) for key, value in events[-40:] if value is not None]
        kept = sorted({i for i in last if i in final} | {survivor, 10_000})
        got = post(url, "/v1/lookup", {"keys": kept + gone, "columns": ["id", "name"]})
        assert {r["id"]: r["name"] for r in got["rows"]} == {i: final[i]["name"] for i in kept}
        sample = f'lance_sink_cdc_truncates_total{{topic="{topic}"}} 1.0'
        assert sample in metrics(metrics_port).splitlines()
    finally:
        assert third.stop() == 0, third.log_path.read_text()[-3000:]
    check_table(uri, final)
    for sink in (second, third):  # (no dead-letter topic: a bad message would stop there)
        events = {e.get("event") for e in sink.events()}
        assert "partition_stopped_on_bad_message" not in events


# -- Avro through the registry, the columns derived and evolved -----------------------


def test_avro_change_events_derive_the_table_and_evolve_it(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """Debezium with Confluent's AvroConverter, no table.columns: the table is derived from
    the envelope's after image; the source table gains a column mid-stream (a new writer
    schema) and the sink restarts itself to add it; the table ends as the source table."""
    registry = FakeRegistry().start()
    client = SchemaRegistryClient({"url": registry.url})
    newer = json.loads(json.dumps(AVRO_ENVELOPE))
    newer["fields"][0]["type"][1]["fields"].append(
        {"name": "color", "type": ["null", "string"], "default": None}
    )
    values = {
        1: AvroSerializer(client, json.dumps(AVRO_ENVELOPE)),
        2: AvroSerializer(client, json.dumps(newer)),
    }
    keys = AvroSerializer(client, json.dumps(AVRO_KEY))
    vctx = SerializationContext(topic, MessageField.VALUE)
    kctx = SerializationContext(topic, MessageField.KEY)
    final: dict[int, dict[str, Any]] = {}

    def change(version: int, op: str, id_: int, lsn: int) -> list[tuple[bytes, bytes | None]]:
        image = None
        if op != "d":
            image = {
                "id": id_,
                "name": f"product {id_} at {lsn}",
                "price": decimal.Decimal(f"{id_}.{lsn % 100:02d}"),
                "added": id_ - 100,  # days: some before 1970
                "updated": lsn * 1_000_000,
                "embedding": [float(id_), float(lsn), 0.5],
            }
            if version == 2:
                image["color"] = f"c{lsn}"
            final[id_] = image
        else:
            final.pop(id_, None)
        event = {
            "before": {"id": id_} | dict.fromkeys(("name", "price", "added", "updated"))
            if op == "d"
            else None,
            "after": image,
            "source": {"ts_ms": lsn, "table": "products", "lsn": lsn},
            "op": op,
            "ts_ms": lsn,
        }
        key = keys({"id": id_}, kctx)
        out = [(key, values[version](event, vctx))]
        return [*out, (key, None)] if op == "d" else out  # Debezium's tombstone

    first = [m for i in range(60) for m in change(1, "r", i, 1000 + i)]
    first += [m for i in range(0, 60, 3) for m in change(1, "d", i, 2000 + i)]
    try:
        produce(kafka_broker.bootstrap, topic, first)
        path = write_config(
            tmp_path / "sink.toml",
            bootstrap=kafka_broker.bootstrap,
            topics=[topic],
            group=group,
            table_uri="unused",
            extra={
                "source": {
                    "format": "avro",
                    "key_format": "avro",
                    "envelope": "debezium",
                    "schema_registry": {"url": registry.url},
                    "columns": {"vec": "$.after.embedding", "lsn": "$.source.lsn"},
                },
                "maintenance": {"scalar_indexes": {"lsn": "BTREE"}},
            },
        )
        uri = str(tmp_path / "products.lance")
        text = path.read_text()
        path.write_text(
            text[: text.index("[table]")]
            + f'[table]\nuri = "{uri}"\nmode = "upsert"\nprimary_key = ["id"]\nevolve = true\n'
            'vector = { column = "vec", dim = 3, metric = "l2" }\n'
        )
        sink = SinkProcess(path, tmp_path / "sink.log")
        try:
            wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
            columns = set(lance.dataset(uri).schema.names)
            assert {"id", "name", "price", "added", "updated", "lsn", "vec"} <= columns
            assert "color" not in columns
            # ALTER TABLE products ADD COLUMN color: the connector's next events carry it.
            later = [m for i in range(1, 60, 2) for m in change(2, "u", i, 3000 + i)]
            later += [m for i in range(60, 70) for m in change(2, "c", i, 4000 + i)]
            produce(kafka_broker.bootstrap, topic, later)
            wait_caught_up(kafka_broker.bootstrap, group, topic, timeout=120, procs=[sink])
        finally:
            assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    finally:
        registry.stop()
    events = [e.get("event") for e in sink.events()]
    assert "schema_evolution_restart" in events
    assert "table_evolved" in events
    rows = {r["id"]: r for r in table_rows(uri)}
    assert sorted(rows) == sorted(final)
    for id_, image in final.items():
        row = rows[id_]
        assert (row["name"], row["color"]) == (image["name"], image.get("color")), id_
        assert row["price"] == float(image["price"])
        assert row["added"] == dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
            days=image["added"]
        )
        assert row["updated"] == dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
            seconds=image["updated"] // 1_000_000
        )
        assert row["vec"] == pytest.approx(image["embedding"])


def test_json_change_events_derive_the_table_from_schema_blocks_and_evolve_it(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    """The JSON converter with schemas.enable, no table.columns: the table is derived from
    the schema blocks of the topic's newest events; the source table gains a column
    mid-stream (events with a new block) and the sink restarts itself to add it (the
    block's fields passed on to the restarted process); the table ends as the source."""
    fields = [*dbz.PRODUCT_FIELDS, ("color", "string", None, None)]
    newer = dbz.envelope_schema(fields)
    final: dict[int, dict[str, Any]] = {}

    def change(schema: dict[str, Any], op: str, id_: int, lsn: int) -> list[Any]:
        image = None
        if op != "d":
            image = dbz.product_image(id_, lsn, DIM)
            if schema is newer:
                image["color"] = f"c{lsn}"
            final[id_] = image
        else:
            final.pop(id_, None)
        source = dbz.pg_source(lsn, 1_700_000_000_000 + lsn)
        before = {"id": id_} if op == "d" else None
        value = dbz.value(dbz.envelope(op, before, image, source), schema)
        out = [(dbz.key(id_), value)]
        return [*out, (dbz.key(id_), None)] if op == "d" else out

    first = [m for i in range(60) for m in change(SCHEMA, "r", i, 1000 + i)]
    first += [m for i in range(0, 60, 3) for m in change(SCHEMA, "d", i, 2000 + i)]
    produce(kafka_broker.bootstrap, topic, first)
    path = write_config(
        tmp_path / "sink.toml",
        bootstrap=kafka_broker.bootstrap,
        topics=[topic],
        group=group,
        table_uri="unused",
        extra={
            "source": {
                "envelope": "debezium",
                "columns": {
                    "vec": "$.after.embedding",
                    "lsn": "$.source.lsn",
                    "changed_at": "$.source.ts_ms",  # (derived: int64)
                },
            },
            "maintenance": {"scalar_indexes": {"lsn": "BTREE"}},
        },
    )
    uri = str(tmp_path / "products.lance")
    text = path.read_text()
    path.write_text(
        text[: text.index("[table]")]
        + f'[table]\nuri = "{uri}"\nmode = "upsert"\nprimary_key = ["id"]\nevolve = true\n'
        f'vector = {{ column = "vec", dim = {DIM}, metric = "l2" }}\n'
    )
    sink = SinkProcess(path, tmp_path / "sink.log")
    try:
        wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
        columns = set(lance.dataset(uri).schema.names)
        assert {"id", "name", "price", "added", "updated", "attrs", "lsn", "vec"} <= columns
        assert "color" not in columns
        later = [m for i in range(1, 60, 2) for m in change(newer, "u", i, 3000 + i)]
        later += [m for i in range(60, 70) for m in change(newer, "c", i, 4000 + i)]
        produce(kafka_broker.bootstrap, topic, later)
        wait_caught_up(kafka_broker.bootstrap, group, topic, timeout=120, procs=[sink])
    finally:
        assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    events = [e.get("event") for e in sink.events()]
    assert "schema_blocks_peeked" in events
    assert "schema_evolution_restart" in events
    assert "table_evolved" in events
    check_table(uri, final)
    rows = {r["id"]: r for r in table_rows(uri)}
    assert {i: rows[i]["color"] for i in final} == {i: final[i].get("color") for i in final}
