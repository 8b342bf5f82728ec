"""Debezium change events (source.envelope = "debezium", sink.cdc) into upserts and deletes:
every op, both JSON converter shapes (with and without schemas), PostgreSQL's and MySQL's
events, the logical types with their edge values, and the settings that refuse a table
change events cannot drive."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
import uuid
from pathlib import Path
from typing import Any, cast

import numpy as np
import orjson
import pytest
import structlog
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from config.loader import load_settings
from config.settings import KeyedError, SchemaRegistrySettings, Settings, SourceSettings
from engine.schema import OP_DELETE, OP_UPSERT, TableSpec
from sink.cdc import connect_leaves, logical_value
from sink.decode import Decoder
from sink.formats.registry import build_client
from tests.support import debezium as dbz
from tests.unit.test_decode import Msg, decode, spec_for

UTC = dt.UTC
SCHEMA = dbz.envelope_schema()
PG = dbz.pg_source(lsn=24023128, ts_ms=1_559_033_904_863)
MYSQL = dbz.mysql_source(pos=154, ts_ms=1_559_033_904_863)

PRODUCTS = [
    {"name": "id", "type": "int64", "nullable": False},
    {"name": "name", "type": "string"},
    {"name": "price", "type": "float64"},
    {"name": "added", "type": "timestamp"},
    {"name": "updated", "type": "timestamp"},
    {"name": "attrs", "type": "string"},
]
MAPPING = {"vec": "$.after.embedding"}


def row(id_: int, name: str = "widget", price: str = "12.50", **extra: Any) -> dict[str, Any]:
    """A products row as Debezium writes it."""
    out: dict[str, Any] = {
        "id": id_,
        "name": name,
        "price": dbz.decimal_b64(price, 2),
        "added": dbz.days(dt.date(2024, 2, 29)),
        "updated": dbz.micros(dt.datetime(2024, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)),
        "attrs": '{"color": "red"}',
        "embedding": [0.5, -1.0, 2.0],
    }
    out.update(extra)
    return out


def cdc(
    messages: list[Msg],
    columns: list[dict[str, Any]] | None = None,
    mapping: dict[str, str] | None = None,
    primary_key: list[str] | None = None,
    **source: Any,
) -> tuple[Any, list[dict[str, Any]]]:
    extra = {} if primary_key is None else {"primary_key": primary_key}
    spec = spec_for(columns or PRODUCTS, mode="upsert", dim=3, **extra)
    return decode(
        spec,
        messages,
        envelope="debezium",
        columns=MAPPING if mapping is None else mapping,
        **source,
    )


def event(op: str | None, before: Any, after: Any, source: dict[str, Any] = PG) -> dict:
    return dbz.envelope(op, before, after, source)


@pytest.mark.parametrize("schemas", [True, False])
@pytest.mark.parametrize("op", ["c", "r", "u"])
def test_create_read_and_update_upsert_the_after_image(op: str, schemas: bool) -> None:
    schema = SCHEMA if schemas else None
    before = {"id": 7} if op == "u" else None
    image = row(7, price="-3.07")
    if not schemas:  # decimal.handling.mode = double: the number itself
        image["price"] = -3.07
        del image["added"], image["updated"]
    value = dbz.value(event(op, before, image), schema)
    out, rows = cdc([Msg(value, 10, dbz.key(7, schemas))], mapping={"vec": "$.after.embedding"})
    assert out.dead_letters == []
    (got,) = rows
    assert (got["id"], got["name"], got["_op"]) == (7, "widget", OP_UPSERT)
    assert got["vec"] == [0.5, -1.0, 2.0]
    assert got["attrs"] == '{"color": "red"}'
    assert got["price"] == -3.07
    if schemas:  # the schema block says how to read the date and the timestamp
        assert got["added"] == dt.datetime(2024, 2, 29, tzinfo=UTC)
        assert got["updated"] == dt.datetime(2024, 3, 1, 12, 0, 0, 123000, tzinfo=UTC)


def test_without_schemas_logical_values_are_read_as_they_are() -> None:
    # No schema block: the sink cannot tell a Date from an integer, nor decode a Decimal.
    value = dbz.value(event("c", None, row(1)))
    columns = [
        {"name": "id", "type": "int64", "nullable": False},
        {"name": "added", "type": "int64"},
        {"name": "price", "type": "string"},
    ]
    out, rows = cdc([Msg(value, 0)], columns=columns)
    assert out.dead_letters == []
    assert rows[0]["added"] == dbz.days(dt.date(2024, 2, 29))
    assert rows[0]["price"] == dbz.decimal_b64("12.50", 2)
    out, _ = cdc([Msg(value, 0)])
    assert [d.reason for d in out.dead_letters] == ["wrong_type"]
    assert "'price' ($.after.price)" in out.dead_letters[0].detail


def test_snapshot_insert_update_delete_tombstone_in_offset_order() -> None:
    messages = [
        Msg(dbz.value(event("r", None, row(1), dbz.pg_source(1, 1, snapshot="true")), SCHEMA), 0),
        Msg(dbz.value(event("c", None, row(2)), SCHEMA), 1, dbz.key(2)),
        Msg(dbz.value(event("u", {"id": 1}, row(1, name="renamed")), SCHEMA), 2, dbz.key(1)),
        # PostgreSQL's default replica identity: before holds the key columns only.
        Msg(dbz.value(event("d", {"id": 2}, None), SCHEMA), 3, dbz.key(2)),
        Msg(None, 4, dbz.key(2)),  # Debezium's tombstone after the delete: a no-op
    ]
    out, rows = cdc(messages, mapping={"vec": "$.after.embedding", "name": "$.after.name"})
    assert out.dead_letters == []
    assert out.skipped_offsets == [4]
    assert [(r["_offset"], r["id"], r["_op"]) for r in rows] == [
        (0, 1, OP_UPSERT),
        (1, 2, OP_UPSERT),
        (2, 1, OP_UPSERT),
        (3, 2, OP_DELETE),
    ]
    assert rows[2]["name"] == "renamed"
    assert (rows[3]["name"], rows[3]["vec"]) == (None, None)


def test_mysql_events_carry_the_whole_row_in_before() -> None:
    old, new = row(5, name="old"), row(5, name="new")
    messages = [
        Msg(dbz.value(event("u", old, new, MYSQL), SCHEMA), 0, dbz.key(5)),
        Msg(dbz.value(event("d", new, None, MYSQL), SCHEMA), 1, dbz.key(5)),
    ]
    mapping = {"vec": "$.after.embedding", "binlog_pos": "$.source.pos"}
    columns = [*PRODUCTS, {"name": "binlog_pos", "type": "int64"}]
    out, rows = cdc(messages, columns=columns, mapping=mapping)
    assert out.dead_letters == []
    assert [(r["id"], r["_op"], r["name"], r["binlog_pos"]) for r in rows] == [
        (5, OP_UPSERT, "new", 154),
        (5, OP_DELETE, None, None),
    ]


@pytest.mark.parametrize("schemas", [True, False])
def test_a_delete_without_before_takes_the_kafka_key(schemas: bool) -> None:
    # REPLICA IDENTITY NOTHING (or a before without the key): the key is in the Kafka key.
    value = dbz.value(event("d", None, None), SCHEMA)
    out, rows = cdc([Msg(value, 3, dbz.key(42, schemas))])
    assert out.dead_letters == []
    assert [(r["id"], r["_op"]) for r in rows] == [(42, OP_DELETE)]


@pytest.mark.parametrize(
    ("before", "key", "says"),
    [
        (None, None, "the Kafka key is missing"),
        ({"name": "x"}, b'{"other": 1}', "before holds not all of them"),
        (None, b"not json", "the Kafka key null"),
        (None, b"[1, 2]", "the Kafka key [1, 2], not an object"),
    ],
)
def test_a_delete_without_a_key_is_a_dead_letter(before: Any, key: bytes | None, says: str) -> None:
    out, rows = cdc([Msg(dbz.value(event("d", before, None), SCHEMA), 3, key)])
    assert rows == []
    (dead,) = out.dead_letters
    assert dead.reason == "cdc_missing_key"
    assert "primary key (id)" in dead.detail
    assert says in dead.detail


def test_a_delete_key_of_the_wrong_type_is_a_dead_letter() -> None:
    out, rows = cdc([Msg(dbz.value(event("d", {"id": "seven"}, None)), 3)])
    assert rows == []
    assert [d.reason for d in out.dead_letters] == ["wrong_type"]
    assert "primary key 'id'" in out.dead_letters[0].detail


def test_composite_keys_delete_with_every_key_column() -> None:
    columns = [
        {"name": "tenant", "type": "string", "nullable": False},
        {"name": "id", "type": "int64", "nullable": False},
        {"name": "name", "type": "string"},
    ]
    messages = [
        Msg(dbz.value(event("c", None, {"tenant": "t1", "id": 1, "vec": [1, 2, 3]})), 0),
        Msg(dbz.value(event("d", {"tenant": "t1", "id": 1}, None)), 1),
        Msg(dbz.value(event("d", {"tenant": "t1"}, None)), 2, b'{"id": 1}'),
    ]
    out, rows = cdc(messages, columns=columns, mapping={}, primary_key=["tenant", "id"])
    assert [(r["tenant"], r["id"], r["_op"]) for r in rows] == [
        ("t1", 1, OP_UPSERT),
        ("t1", 1, OP_DELETE),
    ]
    assert [(d.offset, d.reason) for d in out.dead_letters] == [(2, "cdc_missing_key")]


def test_truncate_is_skipped_by_default_and_a_dead_letter_with_dlq(
    capsys: pytest.CaptureFixture[str],
) -> None:
    value = dbz.value(event("t", None, None), SCHEMA)
    out, rows = cdc([Msg(value, 9)])
    assert (rows, out.dead_letters, out.skipped_offsets) == ([], [], [9])
    assert out.truncates == 1  # (counted by the consumer loop: lance_sink_cdc_truncates_total)
    assert "cdc_truncate_skipped" in capsys.readouterr().out
    # Debezium's tombstones are skipped offsets too, but not truncates.
    out, _ = cdc([Msg(value, 9), Msg(None, 10, dbz.key(1)), Msg(value, 11)])
    assert (out.skipped_offsets, out.truncates) == ([9, 10, 11], 2)
    out, rows = cdc([Msg(value, 9)], truncate="dlq")
    assert [d.reason for d in out.dead_letters] == ["cdc_truncate"]
    assert (out.skipped_offsets, out.truncates) == ([], 0)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (dbz.value(event(None, None, row(1)), SCHEMA), "cdc_missing_op"),
        (dbz.value(event(None, None, row(1))), "cdc_missing_op"),
        (dbz.value(event("m", None, None)), "cdc_unknown_op"),
        (dbz.value(event("x", None, row(1))), "cdc_unknown_op"),
        (dbz.value({**event("c", None, row(1)), "op": 1}), "cdc_unknown_op"),
        (dbz.value(event("c", None, None), SCHEMA), "cdc_missing_after"),
        (dbz.value(event("u", {"id": 1}, None)), "cdc_missing_after"),
        (dbz.value(event("c", None, [1])), "cdc_missing_after"),
        (b'{"schema": null, "payload": null}', "not_an_object"),
        (b"[1]", "not_an_object"),
        (b"null", "not_an_object"),
        (b"{", "invalid_json"),
        (b'{"op": "c", "after": {"id": 1}, "x": 01}', "invalid_json"),
        (b'{"op": "c", "after": {"id": "\xff"}}', "invalid_utf8"),
        (dbz.value(event("c", None, {"name": "no key"})), "missing_primary_key"),
        (dbz.value(event("c", None, row(1, embedding=[1.0, 2.0]))), "wrong_vector_dimension"),
        (dbz.value(event("c", None, row(1, embedding=None))), "missing_required"),
    ],
)
def test_what_is_not_a_change_event_is_a_dead_letter(value: bytes, reason: str) -> None:
    out, rows = cdc([Msg(value, 0)], columns=PRODUCTS[:2], mapping=MAPPING)
    assert rows == []
    assert [d.reason for d in out.dead_letters] == [reason], out.dead_letters


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e39"])
def test_nan_or_infinity_in_a_vector_is_a_dead_letter(literal: bytes) -> None:
    text = dbz.value(event("c", None, row(1, embedding=[1.0, 2.0, 3.0])))
    value = text.replace(b"[1.0,2.0,3.0]", b"[1.0," + literal + b",3.0]")
    assert value != text
    out, rows = cdc([Msg(value, 0)], columns=PRODUCTS[:2])
    assert rows == []
    assert [d.reason for d in out.dead_letters] == ["nan_in_vector"]
    out, rows = cdc([Msg(value, 0)], columns=PRODUCTS[:2], mapping=MAPPING)
    assert [d.reason for d in out.dead_letters] == ["nan_in_vector"]


def test_metadata_paths_address_the_envelope() -> None:
    columns = [
        {"name": "id", "type": "int64", "nullable": False},
        {"name": "op", "type": "string"},
        {"name": "changed_at", "type": "timestamp"},
        {"name": "lsn", "type": "int64"},
        {"name": "source_table", "type": "string"},
        {"name": "emitted", "type": "int64"},
        {"name": "title", "type": "string"},
    ]
    mapping = {
        "vec": "$.after.embedding",
        "op": "$.op",
        "changed_at": "$.source.ts_ms",
        "lsn": "$.source.lsn",
        "source_table": "$.source.table",
        "emitted": "$.ts_ms",
        "title": "$.after.name",
    }
    for schema in (SCHEMA, None):
        value = dbz.value(event("u", None, row(3, name="lamp")), schema)
        out, rows = cdc([Msg(value, 0)], columns=columns, mapping=mapping)
        assert out.dead_letters == []
        got = rows[0]
        assert (got["op"], got["lsn"], got["source_table"], got["title"]) == (
            "u",
            24023128,
            "products",
            "lamp",
        )
        assert got["changed_at"] == dt.datetime(2019, 5, 28, 8, 58, 24, 863000, tzinfo=UTC)
        assert got["emitted"] == 1_700_000_000_000


def _one(logical: str, raw: Any, type_name: str, params: dict[str, str] | None = None) -> Any:
    """`raw` of Connect schema name `logical` through a whole decode into a column
    (``time.X``/``data.X`` are Debezium's ``io.debezium.*``, ``connect.X`` Connect's)."""
    if logical.startswith("connect."):
        logical = "org.apache.kafka.connect.data." + logical.removeprefix("connect.")
    elif not logical.startswith("org."):
        logical = "io.debezium." + logical
    fields = [
        ("id", "int32", None, None),
        ("v", "int64" if not isinstance(raw, str) else "string", logical, params),
        ("embedding", "array", "io.debezium.data.DoubleVector", None),
    ]
    schema = dbz.envelope_schema(fields)
    value = dbz.value(event("c", None, {"id": 1, "v": raw, "embedding": [1, 2, 3]}), schema)
    columns = [
        {"name": "id", "type": "int64", "nullable": False},
        {"name": "v", "type": type_name},
    ]
    out, rows = cdc([Msg(value, 0)], columns=columns)
    assert out.dead_letters == [], out.dead_letters
    return rows[0]["v"]


def _ms(n: int) -> dt.timedelta:
    return dt.timedelta(milliseconds=n)


def _ts(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)  # type: ignore[misc]


LAST_MS_OF_1969 = dt.datetime(1969, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
NOON_123 = dt.datetime(2024, 3, 1, 12, 0, 0, 123000, tzinfo=UTC)
UUID = "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"


@pytest.mark.parametrize(
    ("logical", "raw", "type_name", "expected"),
    [
        ("time.Date", 0, "timestamp", _ts(1970, 1, 1)),
        ("time.Date", -25567, "timestamp", _ts(1900, 1, 1)),
        ("time.Date", -1, "string", "1969-12-31"),
        ("time.Date", 19782, "int32", 19782),
        ("connect.Date", 19782, "timestamp", _ts(2024, 2, 29)),
        ("time.Time", 3_723_004, "timestamp", _ts(1970, 1, 1, 1, 2, 3) + _ms(4)),
        ("time.MicroTime", 86_399_999_999, "string", "23:59:59.999999"),
        ("time.NanoTime", 1_500_000, "timestamp", _ts(1970, 1, 1) + _ms(1)),
        ("time.MicroTime", 5, "int64", 5),
        ("time.Timestamp", -1, "timestamp", LAST_MS_OF_1969),
        ("time.MicroTimestamp", -1, "timestamp", LAST_MS_OF_1969),
        ("time.MicroTimestamp", 1_001_999, "timestamp", _ts(1970, 1, 1, 0, 0, 1, 1000)),
        ("time.NanoTimestamp", 1_709_294_400_123_456_789, "timestamp", NOON_123),
        ("time.MicroTimestamp", -2_208_988_800_000_000, "string", "1900-01-01T00:00:00"),
        ("time.ZonedTimestamp", "2024-03-01T12:00:00.123456789Z", "timestamp", NOON_123),
        ("time.ZonedTimestamp", "2024-03-01T14:00:00+02:00", "timestamp", _ts(2024, 3, 1, 12)),
        ("time.ZonedTimestamp", "1969-12-31T23:59:59.9995-00:00", "timestamp", LAST_MS_OF_1969),
        ("time.ZonedTimestamp", "2024-03-01T14:00:00+02:00", "string", "2024-03-01T14:00:00+02:00"),
        ("data.Json", '{"a": [1, 2]}', "string", '{"a": [1, 2]}'),
        ("data.Uuid", UUID, "string", UUID),
        ("data.Enum", "shipped", "string", "shipped"),
    ],
)  # fmt: skip
def test_temporal_and_text_logical_types(
    logical: str, raw: Any, type_name: str, expected: Any
) -> None:
    assert _one(logical, raw, type_name) == expected


@pytest.mark.parametrize(
    ("number", "scale", "type_name", "expected"),
    [
        ("-12.50", 2, "float64", -12.5),
        ("-12.50", 2, "string", "-12.50"),
        ("0.01", 2, "string", "0.01"),
        ("-0.01", 2, "float64", -0.01),
        ("-128", 0, "int64", -128),
        ("255", 0, "int32", 255),
        ("123456789012345678901234567890", 0, "string", "123456789012345678901234567890"),
        ("-0.0000000001", 10, "string", "-0.0000000001"),
        ("12345678901234567890.1234567890", 10, "string", "12345678901234567890.1234567890"),
        ("3.1415926535", 10, "float64", 3.1415926535),
    ],
)
def test_decimals(number: str, scale: int, type_name: str, expected: Any) -> None:
    params = {"scale": str(scale), "connect.decimal.precision": "38"}
    raw = dbz.decimal_b64(number, scale)
    got = _one("org.apache.kafka.connect.data.Decimal", raw, type_name, params)
    assert got == expected
    assert type(got) is type(expected)


def test_decimal_handling_modes_and_variable_scale() -> None:
    # decimal.handling.mode = double / string: plain numbers and text, no schema name.
    value = dbz.value(event("c", None, {"id": 1, "price": -0.5, "embedding": [1, 2, 3]}))
    _, rows = cdc([Msg(value, 0)], columns=PRODUCTS[:3])
    assert rows[0]["price"] == -0.5
    # VariableScaleDecimal (PostgreSQL numeric without a scale).
    raw = {"scale": 3, "value": dbz.decimal_b64("-1.234", 3)}
    assert logical_value("io.debezium.data.VariableScaleDecimal", {}, raw, "string") == "-1.234"
    assert logical_value("io.debezium.data.VariableScaleDecimal", {}, raw, "float64") == (
        decimal.Decimal("-1.234")
    )
    # Not base64, or not what the logical type holds: left for the column to refuse.
    bad = "not base64!"
    assert (
        logical_value("org.apache.kafka.connect.data.Decimal", {"scale": "2"}, bad, "float64")
        == bad
    )
    assert logical_value("io.debezium.time.Date", {}, True, "timestamp") is True


def test_events_of_two_schema_blocks_interleaved_read_each_by_its_own() -> None:
    """The block of the event before is reused only when the next event carries it: a
    batch alternating two table versions (added a Date, then a plain int32) reads each
    event by its own block."""
    as_int = [f if f[0] != "added" else ("added", "int32", None, None) for f in dbz.PRODUCT_FIELDS]
    blocks = [SCHEMA, dbz.envelope_schema(as_int)]
    messages = [
        Msg(dbz.value(event("c", None, row(i, added=18_000 + i)), blocks[i % 2]), i)
        for i in range(6)
    ]
    out, rows = cdc(messages)
    assert out.dead_letters == []
    epoch = dt.datetime(1970, 1, 1, tzinfo=UTC)
    assert [r["added"] for r in rows] == [
        epoch
        + (dt.timedelta(days=18_000 + i) if i % 2 == 0 else dt.timedelta(milliseconds=18_000 + i))
        for i in range(6)
    ]


def test_a_zoned_timestamp_that_is_not_text_is_left_to_its_column() -> None:
    """An integer where ZonedTimestamp holds ISO text (found by fuzzing the converters):
    the general path raised KeyError, so the event became a decode_error dead letter
    asking for a report; now the value goes to its column as any other integer."""
    zoned = [
        f if f[0] != "updated" else ("updated", "string", "io.debezium.time.ZonedTimestamp", None)
        for f in dbz.PRODUCT_FIELDS
    ]
    schema = dbz.envelope_schema(zoned)
    messages = [
        Msg(dbz.value(event("c", None, row(1, updated=5)), schema), 0),
        Msg(dbz.value(event("c", None, row(2, updated="2024-03-01T12:00:00Z")), schema), 1),
    ]
    out, rows = cdc(messages)
    assert out.dead_letters == []
    assert [r["updated"] for r in rows] == [
        dt.datetime(1970, 1, 1, 0, 0, 0, 5000, tzinfo=UTC),
        dt.datetime(2024, 3, 1, 12, tzinfo=UTC),
    ]
    out, rows = cdc(messages, columns=[*PRODUCTS[:4], {"name": "updated", "type": "string"}])
    assert [d.reason for d in out.dead_letters] == ["wrong_type"]
    assert [r["id"] for r in rows] == [2]


def test_a_date_beyond_the_timestamp_range_is_wrong_type() -> None:
    fields = [("id", "int32", None, None), ("v", "int32", "io.debezium.time.Date", None)]
    value = dbz.value(
        event("c", None, {"id": 1, "v": 2**31 - 1, "embedding": [1, 2, 3]}),
        dbz.envelope_schema([*fields, ("embedding", "array", None, None)]),
    )
    columns = [
        {"name": "id", "type": "int64", "nullable": False},
        {"name": "v", "type": "timestamp"},
    ]
    out, rows = cdc([Msg(value, 0)], columns=columns)
    assert rows == []
    assert [d.reason for d in out.dead_letters] == ["wrong_type"]
    assert "outside the timestamp range" in out.dead_letters[0].detail


def test_logical_key_values_in_before_are_converted() -> None:
    # A date primary key kept as text: before's Date deletes the row its after upserted.
    fields = [("day", "int32", "io.debezium.time.Date", None), ("embedding", "array", None, None)]
    schema = dbz.envelope_schema(fields)
    day = dbz.days(dt.date(1969, 7, 20))
    messages = [
        Msg(dbz.value(event("c", None, {"day": day, "embedding": [1, 2, 3]}), schema), 0),
        Msg(dbz.value(event("d", {"day": day}, None), schema), 1),
    ]
    columns = [{"name": "day", "type": "string", "nullable": False}]
    out, rows = cdc(messages, columns=columns, primary_key=["day"])
    assert out.dead_letters == []
    assert [r["day"] for r in rows] == ["1969-07-20"] * 2
    assert [r["_op"] for r in rows] == [OP_UPSERT, OP_DELETE]


def test_vectors_from_pgvector_arrays() -> None:
    vec = [1e-7, -3.5, 2.0]
    value = dbz.value(event("c", None, row(1, embedding=vec)), SCHEMA)
    _, rows = cdc([Msg(value, 0)], columns=PRODUCTS[:1])
    assert rows[0]["vec"] == [pytest.approx(v, rel=1e-6) for v in vec]
    assert not any(math.isnan(v) for v in rows[0]["vec"])


def _fates(decoder: Decoder, messages: list[Msg]) -> dict[int, Any]:
    """Each message's fate by offset: its row (floats by their bits) or dead letter."""
    out = decoder.decode(messages)
    fates: dict[int, Any] = {d.offset: (d.reason, d.detail) for d in out.dead_letters}
    if out.batch is not None:
        for r in out.batch.to_pylist():
            vec = r["vec"] and np.asarray(r["vec"], np.float32).view(np.uint32).tolist()
            fates[r["_offset"]] = (r["id"], r["_op"], vec)
    return fates


#: A vector component whose double (1 + 2^-24, what orjson reads) is halfway between two
#: float32 values though the decimal is above it: rounded from the double (ties to even)
#: it is 1.0, rounded straight from the decimal (Arrow's reader) 1.0000001.
HALFWAY = b"1.00000005960464477539062500001"


@pytest.mark.parametrize("schemas", [True, False])
def test_a_vector_gets_the_same_float32_alone_in_a_batch_and_unscanned(schemas: bool) -> None:
    spec = spec_for(PRODUCTS[:1], mode="upsert", dim=3, source_columns=True)
    source = SourceSettings(envelope="debezium", columns=MAPPING)
    schema = SCHEMA if schemas else None
    halfway = dbz.value(event("c", None, row(1, embedding=[0.25, 0.5, 0.75])), schema)
    halfway = halfway.replace(b"0.75", HALFWAY)
    messages = [
        Msg(dbz.value(event("c", None, row(i, embedding=[i, 0.5, -2.0])), schema), 10 * i)
        for i in range(2, 6)
    ]
    messages.insert(2, Msg(halfway, 25))
    scanned = Decoder(spec, source)
    whole = Decoder(spec, source, vector_fast_path=False)
    in_batch = _fates(scanned, messages)
    alone: dict[int, Any] = {}
    for m in messages:
        alone.update(_fates(scanned, [m]))
    assert in_batch == alone == _fates(whole, messages)
    assert in_batch[25][2] == np.array([0.25, 0.5, 1.0], np.float32).view(np.uint32).tolist()


@pytest.mark.parametrize("schemas", [True, False])
def test_a_batch_of_change_events_reads_its_vectors_with_the_scan(schemas: bool) -> None:
    spec = spec_for(PRODUCTS[:1], mode="upsert", dim=3)
    decoder = Decoder(spec, SourceSettings(envelope="debezium", columns=MAPPING))
    assert decoder._cdc is not None
    schema = SCHEMA if schemas else None
    values = [
        dbz.value(event("c", None, row(1, embedding=[1.0, 2.0, 3.0])), schema),
        dbz.value(event("d", {"id": 1}, None), schema),
        dbz.value(event("u", None, row(2, embedding=[1.0, 7.25, 3.0])), schema),
        dbz.value(event("u", None, row(3, embedding=[-0.5, 2.5, 3.0])), schema),
    ]
    values[2] = values[2].replace(b"7.25", b"NaN")
    split = decoder._cdc.split(values, lambda pos: None)
    assert split.upserts == [0, 2, 3]
    assert split.vectors is not None
    at, matrix = split.vectors
    assert at.tolist() == [0, 2]  # (NaN is not read by the scan: orjson's, as before)
    assert matrix.tolist() == [[1.0, 2.0, 3.0], [-0.5, 2.5, 3.0]]
    vectors = [r["after"]["embedding"] for r in split.records]
    assert vectors[0] is None
    assert vectors[2] is None
    assert math.isnan(vectors[1][1])


def test_a_vector_with_a_null_component_has_one_fate_whatever_its_neighbours() -> None:
    """A vector the record path builds value by value (a neighbour's component beyond 64
    bits makes the bulk conversion refuse the batch) is checked as in bulk."""
    spec = spec_for(PRODUCTS[:1], mode="upsert", dim=3, source_columns=True)
    decoder = Decoder(spec, SourceSettings(envelope="debezium", columns=MAPPING))
    short = dbz.value(event("c", None, row(1, embedding=[0.5, None])))
    nulls = dbz.value(event("c", None, row(2, embedding=[0.5, None, 1.0])))
    huge = dbz.value(event("c", None, row(3, embedding=[0.5, 2**64, "x"])))
    messages = [Msg(short, 0), Msg(nulls, 1), Msg(huge, 2)]
    alone: dict[int, Any] = {}
    for m in messages:
        alone.update(_fates(decoder, [m]))
    assert _fates(decoder, messages) == alone
    assert alone[0] == (
        "wrong_vector_dimension",
        "vector 'vec' ($.after.embedding) has 2 components, expected 3",
    )
    assert alone[1] == ("wrong_type", "vector 'vec' ($.after.embedding) component 1 is null")


def _settings(**over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "kafka": {"bootstrap_servers": "localhost:9092", "topics": ["dbserver1.public.products"]},
        "source": {"envelope": "debezium", "columns": {"vec": "$.after.embedding"}},
        "table": {
            "uri": "/tmp/unused",
            "mode": "upsert",
            "primary_key": ["id"],
            "columns": [{"name": "id", "type": "int64", "nullable": False}],
            "vector": {"column": "vec", "dim": 3},
        },
    }
    for key, value in over.items():
        section, name = key.split("__")
        raw[section][name] = value
    return raw


APPEND = {"table__mode": "append", "table__primary_key": None, "table__source_columns": True}


def test_settings_take_a_debezium_upsert_table() -> None:
    settings = Settings.model_validate(_settings())
    assert (settings.source.envelope, settings.source.truncate) == ("debezium", "skip")
    # A registry format may leave the columns out: derived from the after image at start.
    derived = Settings.model_validate(
        _settings(
            source__format="avro", source__schema_registry={"url": "mock://x"}, table__columns=[]
        )
    )
    assert (derived.source.format, derived.table.columns) == ("avro", [])
    # json too (from the schema blocks of the topic's events), but no other format.
    assert Settings.model_validate(_settings(table__columns=[])).table.columns == []
    with pytest.raises(Exception, match="only the registry formats"):
        Settings.model_validate(_settings(source__envelope="none", table__columns=[]))


@pytest.mark.parametrize(
    ("over", "key", "says"),
    [
        (APPEND, "table.mode", "upsert table"),
        ({"source__columns": {"id": "$.source.lsn"}}, "source.columns.id", "a field of the row"),
        ({"source__columns": {"id": "@key"}}, "source.columns.id", "a field of the row"),
        ({"source__format": "raw", "source__columns": {"id": "@value"}}, "source.envelope", "raw"),
    ],
)  # fmt: skip
def test_settings_refuse_what_change_events_cannot_drive(
    over: dict[str, Any], key: str, says: str
) -> None:
    with pytest.raises(Exception) as caught:  # noqa: PT011 - pydantic wraps KeyedError
        Settings.model_validate(_settings(**over))
    error = caught.value
    cause = error if isinstance(error, KeyedError) else _keyed(error)
    assert cause is not None, error
    assert says in str(cause)
    assert key.endswith(cause.key), (key, cause.key)


def _keyed(error: BaseException) -> KeyedError | None:
    for item in getattr(error, "errors", list)():
        ctx = item.get("ctx") or {}
        if isinstance(ctx.get("error"), KeyedError):
            return ctx["error"]
    return None


def test_the_kafka_key_alone_is_enough_for_mysql_deletes_with_schemas_off() -> None:
    value = orjson.dumps({"op": "d", "before": None, "after": None, "source": MYSQL})
    _, rows = cdc([Msg(value, 0, b'{"id": 9}')])
    assert [(r["id"], r["_op"]) for r in rows] == [(9, OP_DELETE)]


def test_the_postgres_example_mirrors_a_products_table() -> None:
    settings = load_settings(
        Path(__file__).resolve().parents[2] / "config/examples/postgres-cdc.toml"
    )
    spec = TableSpec.from_settings(settings.table)
    fields = [
        ("id", "int32", None, None),
        ("name", "string", None, None),
        ("price", "bytes", "org.apache.kafka.connect.data.Decimal", {"scale": "2"}),
        ("status", "string", "io.debezium.data.Enum", {"allowed": "draft,active"}),
        ("added", "int32", "io.debezium.time.Date", None),
        ("updated", "int64", "io.debezium.time.MicroTimestamp", None),
        ("embedding", "array", "io.debezium.data.DoubleVector", None),
    ]
    image = {
        "id": 1,
        "name": "lamp",
        "price": dbz.decimal_b64("19.99", 2),
        "status": "active",
        "added": dbz.days(dt.date(1999, 12, 31)),
        "updated": dbz.micros(dt.datetime(2024, 5, 1, 8, 30, tzinfo=UTC)),
        "embedding": [0.25] * 384,
    }
    schema = dbz.envelope_schema(fields)
    messages = [
        Msg(dbz.value(event("c", None, image), schema), 0, dbz.key(1)),
        Msg(dbz.value(event("d", {"id": 1}, None), schema), 1, dbz.key(1)),
        Msg(None, 2, dbz.key(1)),
    ]
    out = Decoder(spec, settings.source).decode(messages)
    assert out.dead_letters == []
    assert out.skipped_offsets == [2]
    assert out.batch is not None
    rows = out.batch.to_pylist()
    assert [(r["id"], r["_op"]) for r in rows] == [(1, OP_UPSERT), (1, OP_DELETE)]
    first = rows[0]
    assert (first["price"], first["status"], first["op"], first["lsn"]) == (
        19.99,
        "active",
        "c",
        24023128,
    )
    assert first["added"] == dt.datetime(1999, 12, 31, tzinfo=UTC)
    assert first["changed_at"] == dt.datetime(2019, 5, 28, 8, 58, 24, 863000, tzinfo=UTC)


# -- Avro through the registry (Debezium's AvroConverter) ------------------------------

AVRO_VALUE = {
    "type": "record",
    "name": "Value",
    "namespace": "dbserver1.public.products",
    "fields": [
        {"name": "id", "type": "int"},
        {"name": "name", "type": ["null", "string"], "default": None},
        {
            "name": "price",
            "type": [
                "null",
                {
                    "type": "bytes",
                    "scale": 2,
                    "precision": 10,
                    "connect.version": 1,
                    "connect.parameters": {"scale": "2", "connect.decimal.precision": "10"},
                    "connect.name": "org.apache.kafka.connect.data.Decimal",
                    "logicalType": "decimal",
                },
            ],
            "default": None,
        },
        {
            "name": "added",
            "type": [
                "null",
                {"type": "int", "connect.version": 1, "connect.name": "io.debezium.time.Date"},
            ],
            "default": None,
        },
        {
            "name": "updated",
            "type": [
                "null",
                {
                    "type": "long",
                    "connect.version": 1,
                    "connect.name": "io.debezium.time.MicroTimestamp",
                },
            ],
            "default": None,
        },
        {"name": "embedding", "type": ["null", {"type": "array", "items": "double"}]},
    ],
    "connect.name": "dbserver1.public.products.Value",
}
AVRO_ENVELOPE = {
    "type": "record",
    "name": "Envelope",
    "namespace": "dbserver1.public.products",
    "fields": [
        {"name": "before", "type": ["null", AVRO_VALUE], "default": None},
        {"name": "after", "type": ["null", "Value"], "default": None},
        {
            "name": "source",
            "type": {
                "type": "record",
                "name": "Source",
                "namespace": "io.debezium.connector.postgresql",
                "fields": [
                    {"name": "ts_ms", "type": "long"},
                    {"name": "table", "type": "string"},
                    {"name": "lsn", "type": ["null", "long"], "default": None},
                ],
            },
        },
        {"name": "op", "type": "string"},
        {"name": "ts_ms", "type": ["null", "long"], "default": None},
    ],
    "connect.name": "dbserver1.public.products.Envelope",
}
AVRO_KEY = {
    "type": "record",
    "name": "Key",
    "namespace": "dbserver1.public.products",
    "fields": [{"name": "id", "type": "int"}],
}


def test_avro_change_events_through_the_registry() -> None:
    url = f"mock://{uuid.uuid4().hex}"
    client = build_client(SchemaRegistrySettings(url=url))
    topic = "dbserver1.public.products"
    values = AvroSerializer(client, json.dumps(AVRO_ENVELOPE))
    keys = AvroSerializer(client, json.dumps(AVRO_KEY))

    def value(op: str, before: Any, after: Any) -> bytes:
        event = {
            "before": before,
            "after": after,
            "source": {"ts_ms": 1_559_033_904_863, "table": "products", "lsn": 77},
            "op": op,
            "ts_ms": 1,
        }
        return values(event, SerializationContext(topic, MessageField.VALUE))

    def key(id_: int) -> bytes:
        return keys({"id": id_}, SerializationContext(topic, MessageField.KEY))

    image = {
        "id": 3,
        "name": "lamp",
        "price": decimal.Decimal("-12.50"),
        "added": -1,
        "updated": -1,
        "embedding": [0.5, 1.0, 2.0],
    }
    with_key = {"id": 3, **dict.fromkeys(("name", "price", "added", "updated", "embedding"))}
    messages = [
        Msg(value("r", None, image), 0, key(3)),
        Msg(value("u", with_key, {**image, "name": "desk"}), 1, key(3)),
        Msg(value("d", with_key, None), 2, key(3)),
        Msg(None, 3, key(3)),
        Msg(value("d", None, None), 4, key(9)),  # the key from the Avro Kafka key
        Msg(value("t", None, None), 5, None),
        Msg(b"\x00\x00\x00\x00\x07garbage", 6, None),
    ]
    columns = [*PRODUCTS[:5], {"name": "lsn", "type": "int64"}, {"name": "op", "type": "string"}]
    spec = spec_for(columns, mode="upsert", dim=3)
    mapping = {"vec": "$.after.embedding", "lsn": "$.source.lsn", "op": "$.op"}
    registry = {"url": url}
    out = Decoder(
        spec,
        SourceSettings(
            format="avro",
            key_format="avro",
            envelope="debezium",
            schema_registry=registry,
            columns=mapping,
        ),
    ).decode(messages)
    assert out.batch is not None
    rows = out.batch.to_pylist()
    assert [(r["_offset"], r["id"], r["_op"], r["name"]) for r in rows] == [
        (0, 3, OP_UPSERT, "lamp"),
        (1, 3, OP_UPSERT, "desk"),
        (2, 3, OP_DELETE, None),
        (4, 9, OP_DELETE, None),
    ]
    first = rows[0]
    assert (first["price"], first["lsn"], first["op"]) == (-12.5, 77, "r")
    assert first["added"] == dt.datetime(1969, 12, 31, tzinfo=UTC)
    assert first["updated"] == LAST_MS_OF_1969
    assert out.skipped_offsets == [3, 5]
    assert [(d.offset, d.reason) for d in out.dead_letters] == [(6, "unknown_schema_id")]
    # Without a key_format the Avro key is not JSON: a delete without before has no key.
    out = Decoder(
        spec,
        SourceSettings(
            format="avro", envelope="debezium", schema_registry=registry, columns=mapping
        ),
    ).decode(messages[4:5])
    assert [d.reason for d in out.dead_letters] == ["cdc_missing_key"]


TRICKY = [',"payload":', ',"payload":{"op":"c"}}', '"}', "\\", ',"payload":null}']


@pytest.mark.parametrize("where", ["doc", "name", "data", "both"])
@pytest.mark.parametrize("text", TRICKY)
def test_the_schema_block_read_once_reads_as_the_whole_value(where: str, text: str) -> None:
    """The compact wrapper is cut at ``,"payload":`` (the schema block's logical types are
    kept by its bytes): text like that inside the schema or the row changes nothing; the
    same value with a space in front (parsed whole) gives the same row."""
    schema = dbz.envelope_schema()
    if where in ("doc", "both"):
        schema = {**schema, "doc": text}
    image = row(4, name=text if where in ("name", "both") else "plain")
    if where == "data":
        image["attrs"] = text
    value = dbz.value(event("c", None, image), schema)
    assert value.startswith(b'{"schema":')
    spaced = b" " + value
    out, rows = cdc([Msg(value, 0), Msg(value, 1), Msg(spaced, 2)])
    assert out.dead_letters == []
    assert [r["added"] for r in rows] == [dt.datetime(2024, 2, 29, tzinfo=UTC)] * 3
    assert [{k: v for k, v in r.items() if k != "_offset"} for r in rows[1:]] == [
        {k: v for k, v in rows[0].items() if k != "_offset"}
    ] * 2


def test_a_broken_wrapper_is_read_whole() -> None:
    good = dbz.value(event("c", None, row(1)), SCHEMA)
    payload = good[good.index(b',"payload":') + len(b',"payload":') : -1]
    cases = {
        # a second payload key: the last one wins, as in the whole parse
        good[:-1] + b',"payload":' + payload + b"}": None,
        good[:-1] + b',"extra":1}': "cdc_missing_op",  # three keys: not the wrapper
        good[:-1] + b"}}": "invalid_json",
        good.replace(b'"op":"c"', b'"op":NaN'): "cdc_unknown_op",
    }
    for value, reason in cases.items():
        out, rows = cdc([Msg(value, 0)])
        assert [d.reason for d in out.dead_letters] == ([] if reason is None else [reason])
        assert len(rows) == (1 if reason is None else 0)


# -- JSON Schema through the registry (Confluent's JsonSchemaConverter) --------------


def _opt(schema: dict[str, Any], index: int) -> dict[str, Any]:
    """An optional Connect field as JsonSchemaData writes it: oneOf null and the type."""
    return {"oneOf": [{"type": "null"}, schema], "connect.index": index}


JS_VALUE = {
    "type": "object",
    "title": "dbserver1.public.products.Value",
    "properties": {
        "id": {"type": "integer", "connect.index": 0, "connect.type": "int32"},
        "name": _opt({"type": "string"}, 1),
        "price": _opt(
            {
                "type": "number",
                "title": "org.apache.kafka.connect.data.Decimal",
                "connect.version": 1,
                "connect.parameters": {"scale": "2", "connect.decimal.precision": "10"},
                "connect.type": "bytes",
            },
            2,
        ),
        "added": _opt(
            {
                "type": "integer",
                "title": "io.debezium.time.Date",
                "connect.version": 1,
                "connect.type": "int32",
            },
            3,
        ),
        "updated": _opt(
            {
                "type": "integer",
                "title": "io.debezium.time.MicroTimestamp",
                "connect.version": 1,
                "connect.type": "int64",
            },
            4,
        ),
        "changed": _opt(
            {"type": "string", "title": "io.debezium.time.ZonedTimestamp", "connect.version": 1},
            5,
        ),
        "embedding": _opt(
            {
                "type": "array",
                "title": "io.debezium.data.DoubleVector",
                "items": {"type": "number", "connect.type": "float64"},
            },
            6,
        ),
    },
}
JS_ENVELOPE = {
    "type": "object",
    "title": "dbserver1.public.products.Envelope",
    "properties": {
        "before": _opt(JS_VALUE, 0),
        "after": _opt(JS_VALUE, 1),
        "source": {
            "type": "object",
            "title": "io.debezium.connector.postgresql.Source",
            "properties": {
                "ts_ms": {"type": "integer", "connect.index": 0, "connect.type": "int64"},
                "table": {"type": "string", "connect.index": 1},
                "lsn": _opt({"type": "integer", "connect.type": "int64"}, 2),
            },
            "connect.index": 2,
        },
        "op": {"type": "string", "connect.index": 3},
        "ts_ms": _opt({"type": "integer", "connect.type": "int64"}, 4),
    },
}
JS_KEY = {
    "type": "object",
    "title": "dbserver1.public.products.Key",
    "properties": {"id": {"type": "integer", "connect.index": 0, "connect.type": "int32"}},
}
CDC_COLUMNS = [
    *PRODUCTS[:5],
    {"name": "changed", "type": "timestamp"},
    {"name": "lsn", "type": "int64"},
    {"name": "op", "type": "string"},
]
CDC_MAPPING = {"vec": "$.after.embedding", "lsn": "$.source.lsn", "op": "$.op"}
TOPIC = "dbserver1.public.products"


def _registry_cdc(
    fmt: str, value: Any, key: Any, rows: list[tuple[str, Any, Any, Any]], **source: Any
) -> tuple[Any, list[dict[str, Any]]]:
    """Decode a history of (op, before, after, Kafka key id or None; None op: tombstone)
    written by `value` and `key` (serializers), with ``source.format = fmt``."""
    ctx = SerializationContext(TOPIC, MessageField.VALUE)
    kctx = SerializationContext(TOPIC, MessageField.KEY)
    messages = []
    for offset, (op, before, after, id_) in enumerate(rows):
        kafka_key = None if id_ is None else key({"id": id_}, kctx)
        if op is None:
            messages.append(Msg(None, offset, kafka_key))
            continue
        event = {
            "before": before,
            "after": after,
            "source": {"ts_ms": 1_559_033_904_863, "table": "products", "lsn": 77 + offset},
            "op": op,
            "ts_ms": 1,
        }
        messages.append(Msg(value(event, ctx), offset, kafka_key))
    spec = spec_for(CDC_COLUMNS, mode="upsert", dim=3)
    return decode(
        spec,
        messages,
        format=fmt,
        key_format=fmt,
        envelope="debezium",
        columns=CDC_MAPPING,
        **source,
    )


def _history(image: dict[str, Any], key_only: dict[str, Any]) -> list[tuple[str, Any, Any, Any]]:
    return [
        ("r", None, image, 3),
        ("c", None, {**image, "id": 4}, 4),
        ("u", key_only, {**image, "name": "desk"}, 3),
        ("d", key_only, None, 3),
        (None, None, None, 3),  # Debezium's tombstone
        ("d", None, None, 9),  # REPLICA IDENTITY NOTHING: the key from the Kafka key
        ("t", None, None, None),
    ]


def _check_history(out: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    assert out.dead_letters == []
    assert out.skipped_offsets == [4, 6]
    assert [(r["_offset"], r["id"], r["_op"], r["name"], r["op"]) for r in rows] == [
        (0, 3, OP_UPSERT, "lamp", "r"),
        (1, 4, OP_UPSERT, "lamp", "c"),
        (2, 3, OP_UPSERT, "desk", "u"),
        (3, 3, OP_DELETE, None, None),
        (5, 9, OP_DELETE, None, None),
    ]
    assert [r["lsn"] for r in rows[:3]] == [77, 78, 79]
    assert rows[0]["vec"] == [0.5, 1.0, 2.0]
    return rows[0]


def test_json_schema_change_events_through_the_registry() -> None:
    url = f"mock://{uuid.uuid4().hex}"
    client = build_client(SchemaRegistrySettings(url=url))
    # Kafka Connect's converter does not validate what it writes: with its default
    # decimal.format (BASE64) a Decimal is base64 text where its schema says number.
    no_check = {"validate": False}
    values = JSONSerializer(json.dumps(JS_ENVELOPE), client, conf=no_check)
    keys = JSONSerializer(json.dumps(JS_KEY), client)
    image = {
        "id": 3,
        "name": "lamp",
        "price": dbz.decimal_b64("-12.50", 2),
        "added": -1,
        "updated": -1,
        "changed": "2024-03-01T14:00:00+02:00",
        "embedding": [0.5, 1.0, 2.0],
    }
    key_only = {"id": 3, **dict.fromkeys(("name", "price", "added", "updated", "changed"))}
    out, rows = _registry_cdc(
        "json_schema", values, keys, _history(image, key_only), schema_registry={"url": url}
    )
    first = _check_history(out, rows)
    assert first["price"] == -12.5
    assert first["added"] == dt.datetime(1969, 12, 31, tzinfo=UTC)
    assert first["updated"] == LAST_MS_OF_1969
    assert first["changed"] == dt.datetime(2024, 3, 1, 12, tzinfo=UTC)
    # decimal.format = NUMERIC: the number itself, valid against the schema.
    numeric = JSONSerializer(json.dumps(JS_ENVELOPE), client)
    out, rows = _registry_cdc(
        "json_schema",
        numeric,
        keys,
        [("c", None, {**image, "price": -0.5}, 3)],
        schema_registry={"url": url},
    )
    assert out.dead_letters == []
    assert rows[0]["price"] == -0.5


# -- Protobuf through the registry (Confluent's ProtobufConverter) --------------------


def _proto_envelope(extra: bool = False) -> Any:
    """The envelope as ProtobufData writes it for a products table (decimal.handling.mode
    precise: confluent.type.Decimal; time.precision.mode connect: google.type.Date,
    google.type.TimeOfDay, google.protobuf.Timestamp; the adaptive mode's
    MicroTimestamp is a plain int64, its name lost), with optional.for.nullables on."""
    from confluent_kafka.schema_registry.confluent.type import decimal_pb2  # noqa: PLC0415
    from google.protobuf import descriptor_pb2, timestamp_pb2  # noqa: PLC0415
    from google.protobuf.descriptor_pool import DescriptorPool  # noqa: PLC0415
    from google.protobuf.message_factory import GetMessageClass  # noqa: PLC0415
    from google.type import date_pb2, timeofday_pb2  # noqa: PLC0415

    f = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(
        name="dbserver1.public.products.Envelope.proto" + ("2" if extra else ""),
        package="dbserver1.public.products",
        syntax="proto3",
        dependency=[
            "confluent/type/decimal.proto",
            "google/type/date.proto",
            "google/type/timeofday.proto",
            "google/protobuf/timestamp.proto",
        ],
    )
    env = fd.message_type.add(name="Envelope")

    def optional(msg: Any, name: str, number: int, type_: int, type_name: str = "") -> None:
        """A nullable field: a message (presence of its own) or a proto3 optional."""
        if type_name:
            msg.field.add(
                name=name, number=number, type=type_, label=f.LABEL_OPTIONAL, type_name=type_name
            )
            return
        msg.field.add(
            name=name, number=number, type=type_, label=f.LABEL_OPTIONAL, proto3_optional=True,
            oneof_index=len(msg.oneof_decl),
        )  # fmt: skip
        msg.oneof_decl.add(name=f"_{name}")

    value = env.nested_type.add(name="Value")
    value.field.add(name="id", number=1, type=f.TYPE_INT32, label=f.LABEL_OPTIONAL)
    optional(value, "name", 2, f.TYPE_STRING)
    optional(value, "price", 3, f.TYPE_MESSAGE, ".confluent.type.Decimal")
    optional(value, "added", 4, f.TYPE_MESSAGE, ".google.type.Date")
    optional(value, "updated", 5, f.TYPE_MESSAGE, ".google.protobuf.Timestamp")
    optional(value, "opens", 6, f.TYPE_MESSAGE, ".google.type.TimeOfDay")
    optional(value, "micros", 7, f.TYPE_INT64)
    value.field.add(name="embedding", number=8, type=f.TYPE_DOUBLE, label=f.LABEL_REPEATED)
    if extra:
        optional(value, "color", 9, f.TYPE_STRING)
    source = env.nested_type.add(name="Source")
    source.field.add(name="ts_ms", number=1, type=f.TYPE_INT64, label=f.LABEL_OPTIONAL)
    source.field.add(name="table", number=2, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    optional(source, "lsn", 3, f.TYPE_INT64)
    env.field.add(name="before", number=1, type=f.TYPE_MESSAGE, type_name="Value")
    env.field.add(name="after", number=2, type=f.TYPE_MESSAGE, type_name="Value")
    env.field.add(name="source", number=3, type=f.TYPE_MESSAGE, type_name="Source")
    env.field.add(name="op", number=4, type=f.TYPE_STRING)
    optional(env, "ts_ms", 5, f.TYPE_INT64)
    key = descriptor_pb2.FileDescriptorProto(
        name="dbserver1.public.products.Key.proto", package="dbserver1.public.products",
        syntax="proto3",
    )  # fmt: skip
    key.message_type.add(name="Key").field.add(
        name="id", number=1, type=f.TYPE_INT32, label=f.LABEL_OPTIONAL
    )
    pool = DescriptorPool()
    for dep in (decimal_pb2, date_pb2, timeofday_pb2, timestamp_pb2):
        pool.AddSerializedFile(dep.DESCRIPTOR.serialized_pb)
    pool.Add(fd)
    pool.Add(key)
    return (
        GetMessageClass(pool.FindMessageTypeByName("dbserver1.public.products.Envelope")),
        GetMessageClass(pool.FindMessageTypeByName("dbserver1.public.products.Key")),
    )


def _proto_serializers(client: Any, extra: bool = False) -> tuple[Any, Any]:
    from google.protobuf import json_format  # noqa: PLC0415

    envelope_cls, key_cls = _proto_envelope(extra)
    conf = {"use.deprecated.format": False}
    values = ProtobufSerializer(envelope_cls, client, conf)
    keys = ProtobufSerializer(key_cls, client, conf)

    def value(event: dict[str, Any], ctx: Any) -> bytes:
        return values(json_format.ParseDict(_no_nulls(event), envelope_cls()), ctx)

    def key(record: dict[str, Any], ctx: Any) -> bytes:
        return keys(key_cls(**record), ctx)

    return value, key


def _no_nulls(value: Any) -> Any:
    """A record without its null fields (unset in the message)."""
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    return value


def _proto_decimal(number: str) -> dict[str, Any]:
    """confluent.type.Decimal in protobuf's JSON form (bytes as base64)."""
    exact = decimal.Decimal(number)
    scale = -exact.as_tuple().exponent  # type: ignore[operator]
    return {"value": dbz.decimal_b64(number, scale), "precision": 10, "scale": scale}


PROTO_IMAGE = {
    "id": 3,
    "name": "lamp",
    "price": _proto_decimal("-12.50"),
    "added": {"year": 1969, "month": 12, "day": 31},
    "updated": "1969-12-31T23:59:59.999Z",
    "opens": {"hours": 9, "minutes": 30, "seconds": 5, "nanos": 250_000_000},
    "micros": -1,
    "embedding": [0.5, 1.0, 2.0],
}


def test_protobuf_change_events_through_the_registry() -> None:
    url = f"mock://{uuid.uuid4().hex}"
    client = build_client(SchemaRegistrySettings(url=url))
    value, key = _proto_serializers(client)
    out, rows = _registry_cdc(
        "protobuf", value, key, _history(PROTO_IMAGE, {"id": 3}), schema_registry={"url": url}
    )
    first = _check_history(out, rows)
    assert first["price"] == -12.5
    assert first["added"] == dt.datetime(1969, 12, 31, tzinfo=UTC)
    assert first["updated"] == LAST_MS_OF_1969
    # A time of day and the adaptive mode's plain integers, into string and int64 columns.
    columns = [
        {"name": "id", "type": "int64", "nullable": False},
        {"name": "opens", "type": "string"},
        {"name": "micros", "type": "int64"},
        {"name": "price", "type": "string"},
        {"name": "added", "type": "string"},
    ]
    ctx = SerializationContext(TOPIC, MessageField.VALUE)
    event = {"after": PROTO_IMAGE, "source": {"ts_ms": 1, "table": "t"}, "op": "c"}
    out, rows = decode(
        spec_for(columns, mode="upsert", dim=3),
        [Msg(value(event, ctx), 0)],
        format="protobuf",
        envelope="debezium",
        schema_registry={"url": url},
        columns={"vec": "$.after.embedding"},
    )
    assert out.dead_letters == []
    got = rows[0]
    assert (got["opens"], got["micros"], got["price"], got["added"]) == (
        "09:30:05.250000",
        -1,
        "-12.50",
        "1969-12-31",
    )


def test_protobuf_change_events_from_a_descriptor_set(tmp_path: Path) -> None:
    from confluent_kafka.schema_registry.confluent.type import decimal_pb2  # noqa: PLC0415
    from google.protobuf import descriptor_pb2, json_format, timestamp_pb2  # noqa: PLC0415
    from google.type import date_pb2, timeofday_pb2  # noqa: PLC0415

    envelope_cls, _ = _proto_envelope()
    files = descriptor_pb2.FileDescriptorSet()
    for dep in (decimal_pb2, date_pb2, timeofday_pb2, timestamp_pb2):
        files.file.add().ParseFromString(dep.DESCRIPTOR.serialized_pb)
    files.file.add().ParseFromString(envelope_cls.DESCRIPTOR.file.serialized_pb)
    path = tmp_path / "products.desc"
    path.write_bytes(files.SerializeToString())
    event = {"after": PROTO_IMAGE, "source": {"ts_ms": 1, "table": "t"}, "op": "r"}
    value = json_format.ParseDict(event, envelope_cls()).SerializeToString()
    out, rows = decode(
        spec_for(PRODUCTS[:5], mode="upsert", dim=3),
        [Msg(value, 0), Msg(value, 1)],
        format="protobuf",
        envelope="debezium",
        protobuf={"descriptor_set": str(path), "message": "dbserver1.public.products.Envelope"},
        columns={"vec": "$.after.embedding"},
    )
    assert out.dead_letters == []
    assert [(r["price"], r["added"]) for r in rows] == [
        (-12.5, dt.datetime(1969, 12, 31, tzinfo=UTC))
    ] * 2


# -- derived columns: the after image's fields (table.columns left out) ---------------


def _envelope_values(fmt: str, url: str, extra: bool = False) -> Any:
    """The products envelope's serializer in `fmt` (`extra`: its Value with a new field
    ``color``), registering it as ``<topic>-value``: event -> framed value."""
    client = build_client(SchemaRegistrySettings(url=url))
    ctx = SerializationContext(TOPIC, MessageField.VALUE)
    if fmt == "protobuf":
        value, _ = _proto_serializers(client, extra)
        return lambda event: value(event, ctx)
    schema: Any = AVRO_ENVELOPE if fmt == "avro" else JS_ENVELOPE
    if extra:
        schema = json.loads(json.dumps(schema))
        if fmt == "avro":
            row_ = schema["fields"][0]["type"][1]
            row_["fields"].append({"name": "color", "type": ["null", "string"], "default": None})
        else:
            for which in ("before", "after"):
                props = schema["properties"][which]["oneOf"][1]["properties"]
                props["color"] = _opt({"type": "string"}, 7)
    serializer = (
        AvroSerializer(client, json.dumps(schema))
        if fmt == "avro"
        else JSONSerializer(json.dumps(schema), client, conf={"validate": False})
    )
    return lambda event: serializer(event, ctx)


def _registered_envelope(fmt: str, url: str, extra: bool = False) -> bytes:
    """`_envelope_values` registered by writing an insert of id 1 (returned)."""
    return cast(
        "bytes",
        _envelope_values(fmt, url, extra)(
            {
                "before": None,
                "after": {"id": 1, "embedding": [1.0, 2.0, 3.0]},
                "source": {"ts_ms": 1, "table": "t"},
                "op": "c",
            }
        ),
    )


def _derived_settings(tmp_path: Path, fmt: str, url: str, **table: Any) -> Settings:
    return Settings.model_validate(
        {
            "kafka": {"bootstrap_servers": "localhost:9092", "topics": [TOPIC]},
            "source": {
                "format": fmt,
                "envelope": "debezium",
                "schema_registry": {"url": url},
                "columns": CDC_MAPPING,
            },
            "table": {
                "uri": str(tmp_path / "products.lance"),
                "mode": "upsert",
                "primary_key": ["id"],
                "vector": {"column": "vec", "dim": 3},
                **table,
            },
        }
    )


#: The derived columns of each format's products envelope, by Debezium's logical types
#: (the vector column is table.vector's; embedding's array gets none).
DERIVED_COLUMNS = {
    "avro": {
        "id": "int32",
        "name": "string",
        "price": "float64",
        "added": "timestamp",
        "updated": "timestamp",
    },
    "json_schema": {
        "id": "int64",
        "name": "string",
        "price": "float64",
        "added": "timestamp",
        "updated": "timestamp",
        "changed": "timestamp",
    },
    "protobuf": {
        "id": "int32",
        "name": "string",
        "price": "float64",
        "added": "timestamp",
        "updated": "timestamp",
        "opens": "string",
        "micros": "int64",
    },
}


@pytest.mark.parametrize("fmt", sorted(DERIVED_COLUMNS))
def test_derived_columns_are_the_after_images_fields(fmt: str, tmp_path: Path) -> None:
    from sink.formats.derive import derive_settings  # noqa: PLC0415

    url = f"mock://{uuid.uuid4().hex}"
    _registered_envelope(fmt, url)
    derived = derive_settings(_derived_settings(tmp_path, fmt, url))
    got = {c.name: c.type for c in derived.table.columns}
    assert got == {**DERIVED_COLUMNS[fmt], "lsn": "int64", "op": "string"}
    # Each reads its field of after; the mapped ones stay as mapped.
    assert derived.source.columns == {
        **{name: f"$.after.{name}" for name in DERIVED_COLUMNS[fmt]},
        **CDC_MAPPING,
    }
    spec = TableSpec.from_settings(derived.table)
    client = build_client(SchemaRegistrySettings(url=url))
    ctx = SerializationContext(TOPIC, MessageField.VALUE)
    image: dict[str, Any]
    if fmt == "protobuf":
        value, _ = _proto_serializers(client)
        image = PROTO_IMAGE
    else:
        value = (
            AvroSerializer(client, json.dumps(AVRO_ENVELOPE))
            if fmt == "avro"
            else JSONSerializer(json.dumps(JS_ENVELOPE), client, conf={"validate": False})
        )
        image = {
            "id": 3,
            "name": "lamp",
            "price": decimal.Decimal("-12.50") if fmt == "avro" else dbz.decimal_b64("-12.5", 2),
            "added": -1,
            "updated": -1,
            "embedding": [0.5, 1.0, 2.0],
        }
    event = {"after": image, "source": {"ts_ms": 1, "table": "t", "lsn": 5}, "op": "r"}
    if fmt == "protobuf":
        event["before"] = None
    else:
        event.update(before=None, ts_ms=1)
    out = Decoder(spec, derived.source, schema_check="evolve").decode([Msg(value(event, ctx), 0)])
    assert out.dead_letters == []
    assert out.batch is not None
    (got_row,) = out.batch.to_pylist()
    assert (got_row["id"], got_row["name"], got_row["price"], got_row["lsn"]) == (
        3,
        "lamp",
        -12.5,
        5,
    )
    assert got_row["added"] == dt.datetime(1969, 12, 31, tzinfo=UTC)
    assert got_row["updated"] == LAST_MS_OF_1969
    assert got_row["vec"] == [0.5, 1.0, 2.0]


@pytest.mark.parametrize("fmt", sorted(DERIVED_COLUMNS))
def test_evolve_adds_a_column_when_the_source_table_gains_one(fmt: str, tmp_path: Path) -> None:
    import lance  # noqa: PLC0415

    from sink.formats import SchemaEvolution  # noqa: PLC0415
    from sink.formats.derive import derive_settings  # noqa: PLC0415

    url = f"mock://{uuid.uuid4().hex}"
    _registered_envelope(fmt, url)
    first = derive_settings(_derived_settings(tmp_path, fmt, url))
    spec = TableSpec.from_settings(first.table)
    lance.write_dataset(spec.table_schema.empty_table(), first.table.uri)
    # The source table gains a column: a new writer schema with it in after (and before).
    newer = _registered_envelope(fmt, url, extra=True)
    event = _registered_envelope(fmt, url)  # an event of the first schema: nothing new
    schema_id = int.from_bytes(newer[1:5], "big")
    for mode, settings_ in (("evolve", first), ("warn", first)):
        decoder = Decoder(spec, settings_.source, schema_check=mode)
        assert decoder.decode([Msg(event, 0)]).dead_letters == []
        if mode == "evolve":
            with pytest.raises(SchemaEvolution) as caught:
                decoder.decode([Msg(newer, 1)])
            assert caught.value.schema_ids == (schema_id,)
            assert "after.color (new, string)" in caught.value.message
        else:  # without table.evolve: read without it, logged once per schema
            with structlog.testing.capture_logs() as logs:
                out = decoder.decode([Msg(newer, 1), Msg(newer, 2)])
            assert out.dead_letters == []
            assert [e["fields"] for e in logs if e["event"] == "schema_fields_not_in_table"] == [
                ["after.color (new, string)"]
            ]
    # The restart to evolve derives the new column from the schema the message named;
    # a start without evolve keeps the table's columns, read from after.
    evolved = derive_settings(_derived_settings(tmp_path, fmt, url, evolve=True), (schema_id,))
    kept = derive_settings(_derived_settings(tmp_path, fmt, url))
    assert {c.name: c.type for c in evolved.table.columns} == {
        **{c.name: c.type for c in first.table.columns},
        "color": "string",
    }
    assert evolved.source.columns["color"] == "$.after.color"
    assert {c.name for c in kept.table.columns} == {c.name for c in first.table.columns}
    assert kept.source.columns == first.source.columns
    decoder = Decoder(TableSpec.from_settings(evolved.table), evolved.source, schema_check="evolve")
    assert decoder.decode([Msg(newer, 1)]).dead_letters == []


# -- derived columns from the JSON converter's schema blocks ---------------------------


def test_the_leaves_of_a_schema_block() -> None:
    leaves = dict(connect_leaves(SCHEMA))
    assert {path: t for path, t in leaves.items() if path[0] == "after"} == {
        ("after", "id"): "int32",
        ("after", "name"): "string",
        ("after", "price"): "float64",
        ("after", "added"): "timestamp",
        ("after", "updated"): "timestamp",
        ("after", "attrs"): "string",
        ("after", "embedding"): None,
    }
    assert (leaves[("source", "ts_ms")], leaves[("source", "lsn")], leaves[("op",)]) == (
        "int64",
        "int64",
        "string",
    )


def _json_settings(tmp_path: Path, **table: Any) -> Settings:
    return Settings.model_validate(
        {
            "kafka": {"bootstrap_servers": "localhost:9092", "topics": [TOPIC]},
            "source": {
                "envelope": "debezium",
                "columns": {"vec": "$.after.embedding", "lsn": "$.source.lsn"},
            },
            "table": {
                "uri": str(tmp_path / "products.lance"),
                "mode": "upsert",
                "primary_key": ["id"],
                "vector": {"column": "vec", "dim": 3},
                **table,
            },
        }
    )


def test_json_change_events_evolve_the_table_by_their_schema_blocks(tmp_path: Path) -> None:
    import lance  # noqa: PLC0415

    from sink.formats import SchemaEvolution  # noqa: PLC0415
    from sink.formats.derive import derive_settings  # noqa: PLC0415

    # The table as a first start derived it from the products' schema block.
    first = derive_settings(_json_settings(tmp_path), leaves=tuple(connect_leaves(SCHEMA)))
    assert {c.name: c.type for c in first.table.columns} == {
        "id": "int32",
        "name": "string",
        "price": "float64",
        "added": "timestamp",
        "updated": "timestamp",
        "attrs": "string",
        "lsn": "int64",
    }
    spec = TableSpec.from_settings(first.table)
    lance.write_dataset(spec.table_schema.empty_table(), first.table.uri)
    again = derive_settings(_json_settings(tmp_path))  # the table exists: no peek
    assert again.table.columns == first.table.columns
    assert again.source.columns == first.source.columns
    # ALTER TABLE products ADD COLUMN color: events with a new schema block.
    fields = [*dbz.PRODUCT_FIELDS, ("color", "string", None, None)]
    newer = dbz.envelope_schema(fields)
    value = dbz.value(event("c", None, row(4, color="red")), newer)
    old = dbz.value(event("c", None, row(5)), SCHEMA)
    for compact in (True, False):  # the wrapper cut once per block, or parsed whole
        payload = value if compact else b" " + value
        decoder = Decoder(spec, first.source, schema_check="evolve")
        assert decoder.decode([Msg(old, 0)]).dead_letters == []
        with pytest.raises(SchemaEvolution) as caught:
            decoder.decode([Msg(payload, 1)])
        assert caught.value.schema_ids == ()
        assert (("after", "color"), "string") in caught.value.leaves
        assert "after.color (new, string)" in caught.value.message
        with structlog.testing.capture_logs() as logs:
            out = Decoder(spec, first.source, schema_check="warn").decode(
                [Msg(payload, 1), Msg(payload, 2)]
            )
        assert out.dead_letters == []
        assert [e["fields"] for e in logs if e["event"] == "schema_fields_not_in_table"] == [
            ["after.color (new, string)"]
        ]
    # The restart to evolve: the leaves the decoder met add the column.
    evolved = derive_settings(_json_settings(tmp_path, evolve=True), (), caught.value.leaves)
    assert {c.name: c.type for c in evolved.table.columns}["color"] == "string"
    evolved_spec = TableSpec.from_settings(evolved.table)
    out = Decoder(evolved_spec, evolved.source, schema_check="evolve").decode([Msg(value, 1)])
    assert out.batch is not None
    assert out.batch.to_pylist()[0]["color"] == "red"
