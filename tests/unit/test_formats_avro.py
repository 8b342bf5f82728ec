"""Avro in the Confluent wire format (`sink.formats`), against confluent-kafka's in-process
``mock://`` registry: values produced with confluent-kafka's own `AvroSerializer`."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import numpy as np
import pytest
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from config.settings import SchemaRegistrySettings, SourceSettings
from engine.schema import OP_DELETE, OP_UPSERT
from sink.decode import Decoder
from sink.formats import SchemaEvolution
from sink.formats.registry import build_client
from tests.unit.test_decode import DIM, Msg, decode, spec_for

TOPIC = "orders"


def registry() -> dict[str, Any]:
    """A fresh in-process registry (one per test: a new mock URL)."""
    return {"url": f"mock://{uuid.uuid4().hex}"}


def record_schema(*fields: dict[str, Any], name: str = "Order") -> str:
    return json.dumps({"type": "record", "name": name, "fields": list(fields)})


BASE = (
    {"name": "id", "type": "string"},
    {"name": "n", "type": ["null", "long"], "default": None},
    {"name": "text", "type": ["null", "string"], "default": None},
    {"name": "vec", "type": {"type": "array", "items": "float"}},
)


def serializer(reg: dict[str, Any], schema: str) -> Any:
    client = build_client(SchemaRegistrySettings(**reg))
    ser = AvroSerializer(client, schema)
    ctx = SerializationContext(TOPIC, MessageField.VALUE)
    return lambda value: ser(value, ctx)


def msgs(*values: bytes | None, first: int = 100) -> list[Msg]:
    return [Msg(v, first + i) for i, v in enumerate(values)]


def source(reg: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"format": "avro", "schema_registry": reg, **extra}


def test_avro_records_fill_columns_like_json() -> None:
    reg = registry()
    ser = serializer(reg, record_schema(*BASE))
    values = [
        ser({"id": f"id-{i}", "n": i, "text": None if i == 1 else f"t{i}", "vec": [i, 0.5, -1, 2]})
        for i in range(3)
    ]
    out, rows = decode(spec_for(), msgs(*values), **source(reg))
    assert not out.dead_letters
    assert [r["id"] for r in rows] == ["id-0", "id-1", "id-2"]
    assert [r["n"] for r in rows] == [0, 1, 2]
    assert [r["text"] for r in rows] == ["t0", None, "t2"]
    assert rows[2]["vec"] == [2.0, 0.5, -1.0, 2.0]


def test_nested_paths_logical_types_and_metadata() -> None:
    reg = registry()
    schema = record_schema(
        {"name": "id", "type": {"type": "string", "logicalType": "uuid"}},
        {
            "name": "meta",
            "type": [
                "null",
                {
                    "type": "record",
                    "name": "Meta",
                    "fields": [
                        {"name": "n", "type": "int"},
                        {"name": "price", "type": {"type": "bytes", "logicalType": "decimal",
                                                    "precision": 9, "scale": 2}},
                    ],
                },
            ],
        },
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "blob", "type": {"type": "fixed", "name": "F", "size": 2}},
        {"name": "vec", "type": {"type": "array", "items": "double"}},
    )  # fmt: skip
    ser = serializer(reg, schema)
    uid = uuid.UUID(int=7)
    at = datetime(2026, 3, 1, 12, 0, 0, 123_999, tzinfo=UTC)
    values = [
        ser({"id": str(uid), "meta": {"n": 5, "price": Decimal("12.34")}, "at": at,
             "day": date(2026, 3, 2), "blob": b"\x01\x02", "vec": [1.0, 2.0, 3.0, 4.0]}),
        ser({"id": str(uid), "meta": None, "at": at, "day": date(2026, 3, 2), "blob": b"zz",
             "vec": [0.0] * 4}),
    ]  # fmt: skip
    spec = spec_for(
        [
            {"name": "id", "type": "string", "nullable": False},
            {"name": "n", "type": "int32"},
            {"name": "price", "type": "float64"},
            {"name": "at", "type": "timestamp"},
            {"name": "day", "type": "timestamp"},
            {"name": "blob", "type": "binary"},
            {"name": "kafka_ts", "type": "timestamp"},
            {"name": "k", "type": "string"},
        ]
    )
    columns = {
        "n": "$.meta.n",
        "price": "$.meta.price",
        "kafka_ts": "@timestamp",
        "k": "@key",
    }
    messages = [Msg(v, 10 + i, key_=b"key-%d" % i) for i, v in enumerate(values)]
    out, rows = decode(spec, messages, **source(reg, columns=columns))
    assert not out.dead_letters, out.dead_letters
    assert rows[0]["id"] == str(uid)
    assert [r["n"] for r in rows] == [5, None]
    assert rows[0]["price"] == 12.34
    assert rows[0]["at"] == datetime(2026, 3, 1, 12, 0, 0, 123_000, tzinfo=UTC)  # floored
    assert rows[0]["day"] == datetime(2026, 3, 2, tzinfo=UTC)
    assert rows[0]["blob"] == b"\x01\x02"
    assert rows[0]["kafka_ts"] == datetime.fromtimestamp(1_700_000_000, UTC)
    assert [r["k"] for r in rows] == ["key-0", "key-1"]


def test_vectors_from_little_endian_float32_bytes() -> None:
    reg = registry()
    schema = record_schema({"name": "id", "type": "string"}, {"name": "vec", "type": "bytes"})
    ser = serializer(reg, schema)
    vecs = np.arange(3 * DIM, dtype="<f4").reshape(3, DIM) / 3
    values = [ser({"id": f"id-{i}", "vec": vecs[i].tobytes()}) for i in range(3)]
    values.insert(1, ser({"id": "short", "vec": vecs[0].tobytes()[:6]}))  # not float32s
    values.insert(2, ser({"id": "dim", "vec": vecs[0].tobytes()[:8]}))  # 2 components
    out, rows = decode(spec_for(), msgs(*values), **source(reg))
    assert [r["id"] for r in rows] == ["id-0", "id-1", "id-2"]
    assert np.array([r["vec"] for r in rows], np.float32).tobytes() == vecs.tobytes()
    reasons = [(d.offset, d.reason) for d in out.dead_letters]
    assert reasons == [(101, "wrong_vector_dimension"), (102, "wrong_vector_dimension")]
    assert "6 bytes, not a whole number of float32" in out.dead_letters[0].detail
    assert "has 2 components, expected 4" in out.dead_letters[1].detail


def test_evolving_writer_schemas_fill_the_same_columns() -> None:
    """Messages written with an older schema (no `text`) and a newer one (an extra field)
    decode side by side; a field a message's schema lacks is null."""
    reg = registry()
    old = serializer(reg, record_schema(*(f for f in BASE if f["name"] != "text")))
    new = serializer(reg, record_schema(*BASE, {"name": "extra", "type": "int", "default": 0}))
    values = [
        old({"id": "a", "n": 1, "vec": [0.0] * 4}),
        new({"id": "b", "n": 2, "text": "hi", "vec": [1.0] * 4, "extra": 3}),
    ]
    out, rows = decode(spec_for(), msgs(*values), **source(reg))
    assert not out.dead_letters
    assert [(r["id"], r["text"]) for r in rows] == [("a", None), ("b", "hi")]


def test_bad_messages_get_specific_reasons() -> None:
    reg = registry()
    ser = serializer(reg, record_schema(*BASE))
    good = ser({"id": "good", "n": 1, "vec": [0.0] * 4})
    unknown_id = b"\x00\x00\x00\x03\xe7" + good[5:]  # schema id 999
    truncated = good[:-3]
    not_framed = b'{"id": "json"}'
    wrong_type = serializer(reg, record_schema(
        {"name": "id", "type": "string"}, {"name": "n", "type": "string"},
        {"name": "vec", "type": {"type": "array", "items": "float"}}, name="Other",
    ))({"id": "wt", "n": "seven", "vec": [0.0] * 4})  # fmt: skip
    no_id = ser({"id": "x", "n": 2, "vec": [0.0] * 4})
    values = [good, unknown_id, truncated, not_framed, wrong_type, b"", good, unknown_id, no_id]
    spec = spec_for(mode="upsert")
    out, rows = decode(spec, msgs(*values), **source(reg))
    assert [r["id"] for r in rows] == ["good", "good", "x"]
    got = {d.offset: (d.reason, d.detail) for d in out.dead_letters}
    assert got[101][0] == "unknown_schema_id"
    assert "schema id 999" in got[101][1]
    assert got[102][0] == "not_matching_schema"
    assert got[103][0] == "missing_magic_byte"
    assert got[104] == ("wrong_type", "'n' ($.n) is a string ('seven'), expected an integer")
    assert got[105][0] == "missing_magic_byte"
    assert got[107][0] == "unknown_schema_id"


def test_truncated_data_is_named_without_addresses() -> None:
    """A payload cut short says the data ends early, the same on every run: fastavro's own
    text named the stream object by its address ('cannot read double from <_io.BytesIO
    object at 0x7fd2aec82ac0>'), a different detail for every message."""
    reg = registry()
    schema = record_schema(
        *BASE, {"name": "score", "type": ["null", "double"], "default": None}, name="Scored"
    )
    ser = serializer(reg, schema)
    good = ser({"id": "a", "vec": [0.0] * 4, "score": 0.5})
    truncated = [good[:-3], good[:-2]]  # inside the double
    details = set()
    for _ in range(2):
        out, rows = decode(spec_for(), msgs(*truncated), **source(reg))
        assert not rows
        details |= {(d.reason, d.detail) for d in out.dead_letters}
    schema_id = int.from_bytes(good[1:5], "big")
    detail = f"value does not decode as Avro with schema id {schema_id}: the data ends early"
    assert details == {("not_matching_schema", detail + " (cannot read double)")}


def test_missing_required_and_primary_key() -> None:
    reg = registry()
    schema = record_schema(
        {"name": "id", "type": ["null", "string"]},
        {"name": "vec", "type": ["null", {"type": "array", "items": "float"}]},
    )
    ser = serializer(reg, schema)
    values = [ser({"id": None, "vec": [0.0] * 4}), ser({"id": "v", "vec": None})]
    out, _rows = decode(spec_for(mode="upsert"), msgs(*values), **source(reg))
    assert [d.reason for d in out.dead_letters] == ["missing_primary_key", "missing_required"]


def test_a_registry_format_needs_a_registry() -> None:
    with pytest.raises(ValueError, match=r"needs a \[source.schema_registry\] section"):
        SourceSettings(format="avro")


def test_decoder_accepts_record_paths_in_registry_formats() -> None:
    reg = registry()
    Decoder(spec_for(), SourceSettings(**source(reg, columns={"text": "$.a.b"})))


def test_writer_schemas_needing_evolution_are_signalled() -> None:
    """With derived columns and table.evolve, a writer schema with a new (or widened) field
    stops decoding with SchemaEvolution before anything is written; an incompatible type
    change is a dead letter per message naming the field."""
    reg = registry()
    spec = spec_for()
    dec = Decoder(spec, SourceSettings(**source(reg)), schema_check="evolve")
    same = serializer(reg, record_schema(*BASE))({"id": "a", "n": 1, "vec": [0.0] * 4})
    assert dec.decode(msgs(same)).batch is not None
    added = serializer(reg, record_schema(*BASE, {"name": "extra", "type": "int"}))
    with pytest.raises(SchemaEvolution, match=r"schema id 2: extra \(new, int32\)") as info:
        dec.decode(msgs(same, added({"id": "b", "n": 2, "vec": [0.0] * 4, "extra": 1})))
    assert info.value.schema_ids == (2,)
    changed = [{"name": "n", "type": "string"} if f["name"] == "n" else f for f in BASE]
    value = serializer(reg, record_schema(*changed))({"id": "c", "n": "x", "vec": [0.0] * 4})
    out = dec.decode(msgs(same, value))
    assert [(d.reason, d.detail) for d in out.dead_letters] == [
        ("wrong_type", "'n' ($.n) is a string ('x'), expected an integer")
    ]
    # Without evolve the new field is simply not read.
    plain = Decoder(spec, SourceSettings(**source(reg)))
    assert plain.decode(msgs(added({"id": "b", "n": 2, "vec": [0.0] * 4, "extra": 1}))).batch


def key_serializer(reg: dict[str, Any], schema: str) -> Any:
    client = build_client(SchemaRegistrySettings(**reg))
    ser = AvroSerializer(client, schema)
    ctx = SerializationContext(TOPIC, MessageField.KEY)
    return lambda value: ser(value, ctx)


def test_registry_encoded_keys_give_primary_keys_and_tombstones() -> None:
    """source.key_format: an Avro string key is the upsert primary key and the key a
    tombstone deletes; a key that does not decode is a dead letter."""
    reg = registry()
    key = key_serializer(reg, '"string"')
    value = serializer(reg, record_schema(*(f for f in BASE if f["name"] != "id")))
    messages = [
        Msg(value({"n": 1, "vec": [0.0] * 4}), 10, key_=key("a")),
        Msg(None, 11, key_=key("a")),  # tombstone
        Msg(value({"n": 2, "vec": [0.0] * 4}), 12, key_=b"plain"),
        Msg(None, 13, key_=b"\x00\x00\x00\x03\xe7x"),  # unknown schema id 999
    ]
    spec = spec_for(mode="upsert")
    out, rows = decode(spec, messages, **source(reg, key_format="avro", columns={"id": "@key"}))
    assert [(r["id"], r["_op"]) for r in rows] == [("a", OP_UPSERT), ("a", OP_DELETE)]
    assert [(d.offset, d.reason) for d in out.dead_letters] == [
        (12, "missing_magic_byte"),
        (13, "unknown_schema_id"),
    ]
    assert out.dead_letters[0].detail.startswith("key is not in the Confluent wire format")


def test_fields_of_a_record_key() -> None:
    reg = registry()
    key = key_serializer(reg, record_schema(
        {"name": "id", "type": "string"}, {"name": "region", "type": "string"}, name="Key"
    ))  # fmt: skip
    value = serializer(reg, record_schema(*(f for f in BASE if f["name"] != "id")))
    spec = spec_for(
        [
            {"name": "id", "type": "string", "nullable": False},
            {"name": "region", "type": "string"},
            {"name": "n", "type": "int64"},
        ],
        mode="upsert",
    )
    messages = [
        Msg(value({"n": 1, "vec": [0.0] * 4}), 1, key_=key({"id": "k1", "region": "eu"})),
        Msg(None, 2, key_=key({"id": "k1", "region": "eu"})),
    ]
    columns = {"id": "@key.id", "region": "@key.region"}
    out, rows = decode(spec, messages, **source(reg, key_format="avro", columns=columns))
    assert not out.dead_letters
    assert [(r["id"], r["region"], r["_op"]) for r in rows] == [
        ("k1", "eu", OP_UPSERT),
        ("k1", None, OP_DELETE),
    ]


def test_key_fields_need_a_key_format() -> None:
    with pytest.raises(ValueError, match=r"set source\.key_format"):
        SourceSettings(columns={"id": "@key.id"})


def test_a_double_beyond_float32_range_is_refused_by_a_float32_column() -> None:
    """An Avro double of 1e300 into a float32 column was stored as infinity, silently."""
    reg = registry()
    ser = serializer(reg, record_schema(
        {"name": "id", "type": "string"}, {"name": "f", "type": ["null", "double"]},
    ))  # fmt: skip
    values = [ser({"id": "a", "f": 1e300}), ser({"id": "b", "f": 2.5}), ser({"id": "c", "f": None})]
    spec = spec_for(
        columns=[{"name": "id", "type": "string"}, {"name": "f", "type": "float32"}], dim=None
    )
    for batch in (values, [*values, b"not framed"]):
        out, rows = decode(spec, msgs(*batch), **source(reg))
        got = [(d.offset, d.reason, d.detail) for d in out.dead_letters][:1]
        beyond = "beyond the float32 range (largest 3.402823e+38)"
        assert got == [(100, "wrong_type", f"'f' ($.f) is 1e+300, {beyond}")]
        assert [(r["id"], r["f"]) for r in rows] == [("b", 2.5), ("c", None)]
