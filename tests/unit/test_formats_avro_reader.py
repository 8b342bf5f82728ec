"""`AvroFormat` reads framed payloads with fastavro directly (one parsed schema per id):
it must give exactly the records and faults of confluent-kafka's `AvroDeserializer` called
per message, on a corpus of several writer schemas, logical types, unions, maps, enums,
fixed, bytes vectors, primitive schemas, GUID framing and bad payloads."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import numpy as np
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from config.settings import SchemaRegistrySettings
from sink import formats
from sink.formats import records as record_columns
from sink.formats.avro import AvroFormat
from sink.formats.registry import build_client, decode_framed
from tests.unit.test_decode import Msg, decode, spec_for

TOPIC = "corpus"

META = {
    "type": "record",
    "name": "Meta",
    "fields": [
        {"name": "n", "type": "int"},
        {"name": "price", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9,
                                   "scale": 2}},
    ],
}  # fmt: skip
V1 = [
    {"name": "id", "type": "string"},
    {"name": "n", "type": ["null", "long"], "default": None},
    {"name": "vec", "type": {"type": "array", "items": "float"}},
]
V2 = [
    *V1,
    {"name": "text", "type": ["null", "string"], "default": None},
    {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "at_us", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
    {"name": "day", "type": {"type": "int", "logicalType": "date"}},
    {"name": "uid", "type": {"type": "string", "logicalType": "uuid"}},
    {"name": "meta", "type": ["null", META], "default": None},
    {"name": "color", "type": {"type": "enum", "name": "Color", "symbols": ["RED", "BLUE"]}},
    {"name": "tags", "type": {"type": "map", "values": "int"}},
    {"name": "blob", "type": {"type": "fixed", "name": "F2", "size": 2}},
]
V3 = [  # the vector as little-endian float32 bytes, n widened to double
    {"name": "id", "type": "string"},
    {"name": "n", "type": ["null", "double"], "default": None},
    {"name": "vec", "type": "bytes"},
    {"name": "ok", "type": "boolean"},
]


def record(fields: list[dict[str, Any]], name: str) -> str:
    return json.dumps({"type": "record", "name": name, "fields": fields})


def corpus(url: str | None = None) -> tuple[SchemaRegistryClient, list[bytes]]:
    """Payloads written into the mock registry at `url` (a new one if None)."""
    client = build_client(SchemaRegistrySettings(url=url or f"mock://{uuid.uuid4().hex}"))

    def serializer(schema: str, topic: str = TOPIC) -> Any:
        ser = AvroSerializer(client, schema)
        context = SerializationContext(topic, MessageField.VALUE)
        return lambda value: ser(value, context)

    v1 = serializer(record(V1, "Doc"))
    v2 = serializer(record(V2, "Doc"))
    v3 = serializer(record(V3, "Doc"))
    raw = serializer('"bytes"', "raw")
    text = serializer('"string"', "text")
    vec = np.arange(4, dtype="<f4") / 3
    at = datetime(2026, 3, 1, 12, 0, 0, 123_999, tzinfo=UTC)
    full = {
        "id": "v2", "n": None, "vec": [0.5, -1.0], "text": "héllo", "at": at, "at_us": at,
        "day": date(2026, 3, 2), "uid": str(uuid.UUID(int=7)),
        "meta": {"n": 5, "price": Decimal("12.34")}, "color": "BLUE", "tags": {"a": 1},
        "blob": b"\x01\x02",
    }  # fmt: skip
    good = [
        v1({"id": "v1", "n": 3, "vec": [1.0, 2.5]}),
        v2(full),
        v2({**full, "id": "v2-nulls", "text": None, "at_us": None, "meta": None, "tags": {}}),
        v3({"id": "v3", "n": 1.5, "vec": vec.tobytes(), "ok": True}),
        v3({"id": "v3-odd", "n": None, "vec": vec.tobytes()[:6], "ok": False}),
        raw(b"\x00\x01raw bytes"),
        text("a plain string"),
    ]
    guid = client.get_latest_version(f"{TOPIC}-value").guid
    by_guid = b"\x01" + uuid.UUID(guid).bytes + good[1][5:]
    unknown_guid = b"\x01" + uuid.UUID(int=1).bytes + good[1][5:]
    unknown_id = b"\x00\x00\x00\x03\xe7" + good[0][5:]  # schema id 999
    bad_union = bytearray(good[0])
    bad_union[5 + 1 + len("v1")] = 0x08  # union branch 4 of a 2-branch union
    bad_utf8 = bytearray(good[0])
    bad_utf8[6:8] = b"\xff\xfe"  # the id's characters
    bad = [
        b"",
        b'{"id": "json"}',
        b"\x02" + good[0][1:],  # an unknown magic byte
        good[0][:5],  # the framing alone
        good[1][:-7],  # truncated
        good[0] + b"trailing",  # decodes, as with the deserializer
        unknown_id,
        bytes(bad_union),
        bytes(bad_utf8),
        by_guid,
        unknown_guid,
        good[3][:5] + b"\x80",  # a varint that never ends
    ]
    # Interleaved, with repeats, so cached readers and per-call faults are both exercised.
    payloads = [p for pair in zip(good + good, bad + bad[:2], strict=False) for p in pair]
    return client, payloads + bad + good


def reference(client: SchemaRegistryClient, payloads: list[bytes]) -> Any:
    """What confluent-kafka's AvroDeserializer, called per message, gives."""
    deserializer = AvroDeserializer(client)
    return decode_framed(payloads, lambda payload: deserializer(payload, None), "Avro")


def test_fast_reads_match_the_deserializer() -> None:
    client, payloads = corpus()
    expected = reference(client, payloads)
    fmt = AvroFormat(client)
    for _ in range(2):  # the second call reads with the readers cached per schema id
        positions, records, faults = fmt.records(payloads)
        assert positions == expected[0]
        assert records == expected[1]
        assert faults == expected[2]
    reasons = {reason for reason, _ in faults.values()}
    assert reasons == {"missing_magic_byte", "unknown_schema_id", "not_matching_schema"}
    # The corpus reaches every kind of value it is meant to.
    decoded = {r["id"] if isinstance(r, dict) else r for r in records}
    assert {"v1", "v2", "v2-nulls", "v3", "v3-odd", b"\x00\x01raw bytes"} <= decoded
    assert "a plain string" in decoded
    assert sum(1 for r in records if isinstance(r, dict) and r["id"] == "v2") == 5  # + GUID


def test_the_registry_is_asked_once_per_schema_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per message the deserializer looked each schema up in the client; the reader is kept
    per id, so a batch of many messages asks the client once per id."""
    client, payloads = corpus()
    asked: list[int] = []
    get_schema = client.get_schema

    def counting(schema_id: int, *args: Any, **kwargs: Any) -> Any:
        asked.append(schema_id)
        return get_schema(schema_id, *args, **kwargs)

    monkeypatch.setattr(client, "get_schema", counting)
    fmt = AvroFormat(client)
    fmt.records(payloads * 10)
    fmt.records(payloads)
    known = sorted(set(asked) - {999})
    assert sorted(asked) == sorted([*known, 999, 999])  # 999 is unknown: asked per call
    assert len(known) == 5  # v1, v2, v3, "bytes", "string"


def test_chunked_decoding_gives_the_rows_and_dead_letters_of_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`parse_records` decodes a batch in chunks (CPU caches): the rows, column faults and
    dead letters must be those of one pass over the whole batch."""
    reg = {"url": f"mock://{uuid.uuid4().hex}"}
    _, payloads = corpus(reg["url"])
    spec = spec_for(
        [
            {"name": "id", "type": "string", "nullable": False},
            {"name": "n", "type": "int64"},  # v3 writes a double: a column fault
            {"name": "text", "type": "string"},
            {"name": "at", "type": "timestamp"},
            {"name": "color", "type": "string"},
        ],
        dim=2,  # v3's bytes vectors have 4 components: dead letters
    )
    messages = [Msg(v, 100 + i) for i, v in enumerate(payloads * 3)]
    results = []
    for chunk in (10**9, 7):
        monkeypatch.setattr(formats, "_CHUNK", chunk)
        out, rows = decode(spec, messages, format="avro", schema_registry=reg)
        results.append((rows, [(d.offset, d.reason, d.detail) for d in out.dead_letters]))
    assert results[1] == results[0]
    rows, dead = results[0]
    assert len(rows) > 10
    assert {"wrong_type", "wrong_vector_dimension", "not_an_object"} <= {r for _, r, _ in dead}


STAMPS = [
    {"name": "id", "type": "string"},
    {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "opt", "type": ["null", {"type": "long", "logicalType": "timestamp-millis"}]},
    {"name": "inner", "type": {"type": "record", "name": "In", "fields": [
        {"name": "t", "type": {"type": "long", "logicalType": "local-timestamp-millis"}},
    ]}},
    {"name": "again", "type": "In"},  # the named type by reference: read as before
    {"name": "seen", "type": {"type": "record", "name": "Seen", "fields": [
        {"name": "t", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    ]}},
    {"name": "us", "type": {"type": "long", "logicalType": "timestamp-micros"}},
    {"name": "as_text", "type": ["null", {"type": "long", "logicalType": "timestamp-millis"}]},
]  # fmt: skip


def test_timestamp_millis_read_as_epoch_milliseconds_give_the_same_rows_and_dead_letters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a timestamp-millis long fills only a timestamp column it is read as epoch
    milliseconds, not as a datetime: the rows and dead letters must be those of the
    datetime reading, for values at the ends of the datetime range and beyond it (fastavro
    refuses those: the whole message is a dead letter), nulls, nested and referenced named
    records, and a string column reading one."""
    url = f"mock://{uuid.uuid4().hex}"
    client = build_client(SchemaRegistrySettings(url=url))
    ser = AvroSerializer(client, record(STAMPS, "Stamps"))
    context = SerializationContext(TOPIC, MessageField.VALUE)
    lowest, highest = -62_135_596_800_000, 253_402_300_799_999  # years 1 and 9999
    values = [1_700_000_000_123, 0, -1, lowest, highest, None]
    payloads = []
    beyond = [highest + 1, lowest - 1, 2**62]
    for i, ms in enumerate(values + beyond + beyond):
        stamp = ms if ms is not None else 5
        fields = {
            "id": f"r{i}", "at": stamp, "opt": ms, "inner": {"t": stamp},
            "again": {"t": stamp}, "seen": {"t": stamp}, "us": 7, "as_text": stamp,
        }  # fmt: skip
        if i < 3:  # rows: the string column holds no timestamp
            fields.update(as_text=None)
        if i >= len(values) + len(beyond):  # beyond the range only where it is epoch ms
            fields.update(again={"t": 5}, as_text=5)
        payloads.append(ser(fields, context))
    spec = spec_for(
        [
            {"name": "id", "type": "string", "nullable": False},
            {"name": "at", "type": "timestamp"},
            {"name": "opt", "type": "timestamp"},
            {"name": "inner_t", "type": "timestamp"},
            {"name": "again_t", "type": "timestamp"},
            {"name": "seen_t", "type": "timestamp"},
            {"name": "us", "type": "timestamp"},
            {"name": "as_text", "type": "string"},
        ],
        dim=None,
    )
    columns = {"inner_t": "$.inner.t", "again_t": "$.again.t", "seen_t": "$.seen.t"}
    messages = [Msg(v, 10 + i) for i, v in enumerate(payloads)]
    read: dict[str, Any] = {}
    real = formats.epoch_ms_paths
    # Only timestamp columns, and none that another path reads through or into.
    assert real(
        [(("at",), "timestamp", ""), (("n",), "int64", ""), (("a",), "timestamp", ""),
         (("a", "b"), "timestamp", ""), (("c", "d"), "timestamp", ""), (("c",), "string", "")]
    ) == {("at",)}  # fmt: skip
    for name, paths in (("datetimes", lambda _: frozenset()), ("epoch ms", real)):
        monkeypatch.setattr(formats, "epoch_ms_paths", paths)
        out, rows = decode(
            spec, messages, format="avro", schema_registry={"url": url}, columns=columns
        )
        read[name] = (rows, [(d.offset, d.reason, d.detail) for d in out.dead_letters])
    assert read["epoch ms"] == read["datetimes"]
    # The epoch ms reading did happen (a referenced named type is read as before).
    epoch = frozenset({("at",), ("opt",), ("inner", "t"), ("again", "t")})
    _, (first, *_), _ = AvroFormat(client).records(payloads[:1], epoch)
    assert (first["at"], first["opt"], first["inner"]) == (values[0], values[0], {"t": values[0]})
    assert isinstance(first["again"]["t"], datetime)
    rows, dead = read["datetimes"]
    # The string column refuses a datetime (a row fault: a dead letter), and the values
    # beyond the range fault their messages in fastavro.
    stamps = [datetime.fromtimestamp(ms / 1000, UTC) for ms in values[:3]]
    assert [(r["id"], r["at"], r["seen_t"]) for r in rows] == [
        (f"r{i}", stamp, stamp) for i, stamp in enumerate(stamps)
    ]
    reasons = {d[0]: d[1] for d in dead}
    assert sorted(reasons) == [10 + i for i in range(3, 12)]
    assert {reasons[10 + i] for i in range(3, 6)} == {"wrong_type"}
    assert {reasons[10 + i] for i in range(6, 12)} == {"not_matching_schema"}


def test_epoch_milliseconds_fill_a_timestamp_column_as_they_do_one_by_one() -> None:
    """A timestamp column of epoch milliseconds is built in one Arrow call (it was one
    datetime per value): the same instants, and the same faults beyond the range."""
    lowest, highest = -62_135_596_800_000, 253_402_300_799_999
    values = [0, -1, 1_700_000_000_123, lowest, highest, None]
    arr, faults = record_columns.to_column(values, "timestamp", "'t' ($.t)")
    assert faults == {}
    assert arr.to_pylist() == [record_columns.convert(v, "timestamp")[0] for v in values]
    beyond: list[int | None] = [1, highest + 1, None, lowest - 1, 2**64]
    arr, faults = record_columns.to_column(beyond, "timestamp", "'t' ($.t)")
    assert arr.to_pylist() == [datetime(1970, 1, 1, 0, 0, 0, 1000, tzinfo=UTC)] + [None] * 4
    assert faults == {
        pos: ("wrong_type", f"'t' ($.t) is {beyond[pos]}, outside the timestamp range")
        for pos in (1, 3, 4)
    }
