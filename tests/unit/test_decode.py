"""`sink.decode`: messages of one topic-partition -> one batch + dead letters.

Every dead-letter reason is checked together with the good messages around it, which must
still decode to the right values. A Hypothesis test compares the decoder with a plain
per-row reference decoder written here.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import numpy as np
import orjson
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config.settings import SourceSettings, TableSettings
from engine.schema import OP_DELETE, OP_UPSERT, TableSpec
from sink import decode_plan, json_parse
from sink.decode import Decoded, Decoder

TOPIC = "orders"
PARTITION = 2
DIM = 4
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Msg:
    """A consumed message (the accessors of confluent_kafka.Message)."""

    value_: bytes | None
    offset_: int = 0
    key_: bytes | None = None
    timestamp_: tuple[int, int] = (1, 1_700_000_000_000)
    headers_: list[tuple[str, bytes | None]] | None = None
    topic_: str = TOPIC
    partition_: int = PARTITION

    def topic(self) -> str:
        return self.topic_

    def partition(self) -> int:
        return self.partition_

    def offset(self) -> int:
        return self.offset_

    def timestamp(self) -> tuple[int, int]:
        return self.timestamp_

    def key(self) -> bytes | None:
        return self.key_

    def value(self) -> bytes | None:
        return self.value_

    def headers(self) -> list[tuple[str, bytes | None]] | None:
        return self.headers_


def msgs(*values: bytes | dict[str, Any] | None, first: int = 100) -> list[Msg]:
    """Messages at consecutive offsets; dict values are JSON-encoded."""
    return [
        Msg(orjson.dumps(v) if isinstance(v, dict) else v, first + i) for i, v in enumerate(values)
    ]


def spec_for(
    columns: list[dict[str, Any]] | None = None,
    mode: str = "append",
    dim: int | None = DIM,
    allow_nan: bool = False,
    **extra: Any,
) -> TableSpec:
    raw: dict[str, Any] = {
        "uri": "/tmp/unused",
        "mode": mode,
        "columns": columns
        or [
            {"name": "id", "type": "string", "nullable": False},
            {"name": "n", "type": "int64"},
            {"name": "text", "type": "string"},
        ],
    }
    if dim is not None:
        raw["vector"] = {"column": "vec", "dim": dim, "allow_nan": allow_nan}
    if mode == "upsert":
        raw["primary_key"] = ["id"]
    raw.update(extra)
    return TableSpec.from_settings(TableSettings.model_validate(raw))


def decode(
    spec: TableSpec, messages: Sequence[Msg], **source: Any
) -> tuple[Decoded, list[dict[str, Any]]]:
    """Decode, check the engine accepts the batch and every offset is accounted once."""
    out = Decoder(spec, SourceSettings(**source)).decode(messages)
    rows: list[dict[str, Any]] = []
    if out.batch is not None:
        assert out.batch.schema.equals(spec.batch_schema)
        spec.validate(out.batch)
        rows = out.batch.to_pylist()
    accounted = (
        [r["_offset"] for r in rows if "_offset" in r]
        + [d.offset for d in out.dead_letters]
        + out.skipped_offsets
    )
    if "_offset" in spec.batch_schema.names:
        assert sorted(accounted) == [m.offset() for m in messages]
        assert [r["_offset"] for r in rows] == sorted(r["_offset"] for r in rows)
    assert out.first_offset == messages[0].offset()
    assert out.last_offset == messages[-1].offset()
    for dead in out.dead_letters:
        assert dead.topic == TOPIC
        assert dead.partition == PARTITION
    return out, rows


def good(i: int, **extra: Any) -> dict[str, Any]:
    return {"id": f"id-{i}", "n": i, "text": f"text {i}", "vec": [i, 0.5, -1.0, 2.0], **extra}


def expect_good(rows: list[dict[str, Any]], ids: list[int]) -> None:
    assert [r["id"] for r in rows] == [f"id-{i}" for i in ids]
    assert [r["n"] for r in rows] == ids
    assert [r["text"] for r in rows] == [f"text {i}" for i in ids]
    assert [r["vec"] for r in rows] == [[float(i), 0.5, -1.0, 2.0] for i in ids]


# -- dead letters: every reason, with good neighbours -------------------------------------

BAD_JSON = [
    ("invalid_json", b'{"id": "x", "n": '),
    ("invalid_json", b""),
    ("invalid_json", b"   \n "),
    ("invalid_json", b'{"id": "x"} {"id": "y"}'),
    ("invalid_json", b'{"id": "x", "vec": [1, 2, 3, 4]}garbage'),
    ("not_an_object", b"[1, 2]"),
    ("not_an_object", b"null"),
    ("not_an_object", b'"text"'),
    ("not_an_object", b"42"),
    ("wrong_type", orjson.dumps(good(9, n=1.5))),
    ("wrong_type", orjson.dumps(good(9, n="7"))),
    ("wrong_type", orjson.dumps(good(9, n=True))),
    ("wrong_type", orjson.dumps(good(9, n=2**63))),
    ("wrong_type", orjson.dumps(good(9, text=5))),
    ("wrong_type", orjson.dumps(good(9, text={"a": 1}))),
    ("wrong_type", orjson.dumps(good(9, vec="1,2,3,4"))),
    ("wrong_type", orjson.dumps(good(9, vec=[1, "2", 3, 4]))),
    ("wrong_type", orjson.dumps(good(9, vec=[1, None, 3, 4]))),
    ("wrong_type", orjson.dumps(good(9, vec=[1, True, 3, 4]))),
    ("wrong_vector_dimension", orjson.dumps(good(9, vec=[1, 2, 3]))),
    ("wrong_vector_dimension", orjson.dumps(good(9, vec=[]))),
    ("nan_in_vector", b'{"id": "x", "vec": [1, NaN, 3, 4]}'),
    ("nan_in_vector", b'{"id": "x", "vec": [1, 2, Infinity, 4]}'),
    ("nan_in_vector", b'{"id": "x", "vec": [1, 2, 3, -Infinity]}'),
    ("nan_in_vector", b'{"id": "x", "vec": [1, 2, 3, 1e999]}'),
    ("nan_in_vector", b'{"id": "x", "vec": [1, 2, 3, 1e39]}'),  # beyond float32
    ("missing_required", orjson.dumps({"n": 1, "vec": [1, 2, 3, 4]})),
    ("missing_required", orjson.dumps({"id": None, "vec": [1, 2, 3, 4]})),
    ("missing_required", orjson.dumps({"id": "x"})),
    ("missing_required", orjson.dumps({"id": "x", "vec": None})),
    ("invalid_utf8", b'{"id": "\xff\xfe", "vec": [1, 2, 3, 4]}'),
    ("invalid_utf8", b'{"id": "x", "other": "\xc3\x28", "vec": [1, 2, 3, 4]}'),
]


@pytest.mark.parametrize(("reason", "value"), BAD_JSON)
def test_dead_letter_reason_and_good_neighbours(reason: str, value: bytes) -> None:
    spec = spec_for()
    messages = msgs(good(0), good(1), value, good(3))
    out, rows = decode(spec, messages)
    assert [(d.offset, d.reason) for d in out.dead_letters] == [(102, reason)]
    dead = out.dead_letters[0]
    assert dead.value == value
    assert dead.key is None
    assert dead.timestamp_ms == 1_700_000_000_000
    assert dead.detail
    expect_good(rows, [0, 1, 3])
    assert [r["_offset"] for r in rows] == [100, 101, 103]
    assert {r["_topic"] for r in rows} == {TOPIC}
    assert {r["_partition"] for r in rows} == {PARTITION}


#: Parts of the vector details below.
VEC = "vector 'vec' ($.vec)"
INFINITE = "(infinite in the JSON or beyond the double range)"
F32 = "beyond the float32 range (largest 3.402823e+38); it would be stored as infinity"

#: Each reason's detail names the real cause and where it came from (column and source).
DETAILS = [
    (
        b'{"id": "x", "n": ',
        "invalid_json",
        "value is not JSON: Expecting value: line 1 column 18 (char 17)",
    ),
    (b"[1, 2]", "not_an_object", "value is a JSON array, not an object"),
    (b"null", "not_an_object", "value is JSON null, not an object"),
    (orjson.dumps(good(9, n=1.5)), "wrong_type", "'n' ($.n) is 1.5, expected an integer"),
    (b'{"id": "x", "n": NaN}', "wrong_type", "'n' ($.n) is NaN, expected an integer"),
    (
        orjson.dumps(good(9, n="7")),
        "wrong_type",
        "'n' ($.n) is a string ('7'), expected an integer",
    ),
    (orjson.dumps(good(9, n=True)), "wrong_type", "'n' ($.n) is a boolean, expected an integer"),
    (
        orjson.dumps(good(9, n=2**63)),
        "wrong_type",
        "'n' ($.n) is 9223372036854775808, outside the int64 range",
    ),
    (
        orjson.dumps(good(9, text={})),
        "wrong_type",
        "'text' ($.text) is an object, expected a string",
    ),
    (
        orjson.dumps(good(9, text=[1])),
        "wrong_type",
        "'text' ($.text) is an array, expected a string",
    ),
    (orjson.dumps(good(9, text=5)), "wrong_type", "'text' ($.text) is a number, expected a string"),
    (
        orjson.dumps(good(9, vec="1,2,3,4")),
        "wrong_type",
        "'vec' ($.vec) is a string ('1,2,3,4'), expected an array of numbers",
    ),
    (
        b'{"id": "x", "vec": NaN}',
        "wrong_type",
        "'vec' ($.vec) is NaN, expected an array of numbers",
    ),
    (
        orjson.dumps(good(9, vec=[1, "2", 3, 4])),
        "wrong_type",
        "'vec' ($.vec) component 1 is a string ('2'), expected a number",
    ),
    (
        orjson.dumps(good(9, vec=[1, 2, {}, 4])),
        "wrong_type",
        "'vec' ($.vec) component 2 is an object, expected a number",
    ),
    (orjson.dumps(good(9, vec=[1, 2, 3, None])), "wrong_type", f"{VEC} component 3 is null"),
    (
        orjson.dumps(good(9, vec=[1, 2, 3])),
        "wrong_vector_dimension",
        f"{VEC} has 3 components, expected 4",
    ),
    (b'{"id": "x", "vec": [1, NaN, 3, 4]}', "nan_in_vector", f"{VEC} component 1 is NaN"),
    (
        b'{"id": "x", "vec": [1, 2, Infinity, 4]}',
        "nan_in_vector",
        f"{VEC} component 2 is Infinity {INFINITE}",
    ),
    (
        b'{"id": "x", "vec": [1, 2, 3, -1e999]}',
        "nan_in_vector",
        f"{VEC} component 3 is -Infinity {INFINITE}",
    ),
    (b'{"id": "x", "vec": [1, 2, 3, 1e39]}', "nan_in_vector", f"{VEC} component 3 is 1e+39, {F32}"),
    (
        b'{"id": "x", "vec": [-4e38, 2, 3, 4]}',
        "nan_in_vector",
        f"{VEC} component 0 is -4e+38, {F32}",
    ),
    (
        b'{"id": "x", "vec": [1, 2, 3, 1' + b"0" * 50 + b"]}",
        "nan_in_vector",
        f"{VEC} component 3 is 100000000000... (51 digits), {F32}",
    ),
    (
        orjson.dumps({"id": None, "vec": [1, 2, 3, 4]}),
        "missing_required",
        "'id' ($.id) is null or missing",
    ),
    (
        b'{"id": "x", "other": "\xc3\x28", "vec": [1, 2, 3, 4]}',
        "invalid_utf8",
        "value is not UTF-8 (byte 0xc3 at offset 22)",
    ),
]


@pytest.mark.parametrize(("value", "reason", "detail"), DETAILS)
@pytest.mark.parametrize("alone", [True, False])
def test_dead_letter_details_name_the_cause_and_its_source(
    value: bytes, reason: str, detail: str, alone: bool
) -> None:
    """The same detail whichever path finds the fault: one message alone (the per-message
    screen) or among good ones in a chunk."""
    spec = spec_for()
    batch = [value] if alone else [orjson.dumps(good(i)) for i in range(20)] + [value]
    out, _ = decode(spec, msgs(*batch))
    assert [(d.reason, d.detail) for d in out.dead_letters] == [(reason, detail)]


def test_vector_faults_name_the_component_of_each_row() -> None:
    """Several bad vectors in one batch: each row's detail names its own first bad component."""
    spec = spec_for()
    values = [
        orjson.dumps(good(0)),
        b'{"id": "a", "vec": [NaN, 1, NaN, 1]}',
        b'{"id": "b", "vec": [1, 1, 1, 1e39]}',
        orjson.dumps(good(3)),
        orjson.dumps(good(4, vec=[None, 2, None, 4])),
        orjson.dumps(good(5, vec=[1, 2, 3, None])),
    ]
    out, rows = decode(spec, msgs(*values))
    assert [(d.offset, d.detail) for d in out.dead_letters] == [
        (101, f"{VEC} component 0 is NaN"),
        (102, f"{VEC} component 3 is 1e+39, {F32}"),
        (104, f"{VEC} component 0 is null"),
        (105, f"{VEC} component 3 is null"),
    ]
    expect_good(rows, [0, 3])


def test_every_bad_value_in_one_batch() -> None:
    """All faults at once: the chunk fails, so every message goes through the screen."""
    spec = spec_for()
    values: list[Any] = []
    for i, (_, value) in enumerate(BAD_JSON):
        values += [good(2 * i), value]
    out, rows = decode(spec, msgs(*values, first=0))
    assert [(d.offset, d.reason) for d in out.dead_letters] == [
        (2 * i + 1, reason) for i, (reason, _) in enumerate(BAD_JSON)
    ]
    expect_good(rows, [2 * i for i in range(len(BAD_JSON))])


def test_a_scalar_on_a_nested_path_names_where_it_stands() -> None:
    """The detail names the path up to the value that is not an object, exactly (the
    screening of a chunk that did not parse builds it only for the faulted value)."""
    spec = spec_for(
        columns=[{"name": "id", "type": "string"}, {"name": "deep", "type": "int64"}], dim=None
    )
    messages = msgs(
        {"id": "a", "a": {"b": {"c": 1}}},
        {"id": "b", "a": {"b": "s"}},
        {"id": "c", "a": [1]},
        {"id": "d", "a": {"b": None}},
        {"id": "e", "a": {"b": {"c": 2.5}}},
    )
    out, rows = decode(spec, messages, columns={"deep": "$.a.b.c"})
    assert [(r["id"], r["deep"]) for r in rows] == [("a", 1), ("d", None)]
    assert [(d.offset, d.reason, d.detail) for d in out.dead_letters] == [
        (101, "wrong_type", "'deep' ($.a.b.c): $.a.b is a string, not an object"),
        (102, "wrong_type", "'deep' ($.a.b.c): $.a is an array, not an object"),
        (104, "wrong_type", "'deep' ($.a.b.c) is 2.5, expected an integer"),
    ]


def test_dead_letter_details_name_column_and_path() -> None:
    spec = spec_for(
        columns=[
            {"name": "id", "type": "string", "nullable": False},
            {"name": "city", "type": "string"},
        ]
    )
    messages = msgs(
        {"id": "a", "addr": {"city": 5}, "vec": [1, 2, 3, 4]},
        {"id": "b", "addr": "flat", "vec": [1, 2, 3, 4]},
        {"id": "c", "vec": [1, 2]},
        {"vec": [1, 2, 3, 4]},
    )
    out, rows = decode(spec, messages, columns={"city": "$.addr.city"})
    assert rows == []
    details = {d.offset: (d.reason, d.detail) for d in out.dead_letters}
    assert details[100][0] == "wrong_type"
    assert "city" in details[100][1]
    assert "$.addr.city" in details[100][1]
    assert details[101][0] == "wrong_type"
    assert "$.addr" in details[101][1]
    assert details[102] == (
        "wrong_vector_dimension",
        "vector 'vec' ($.vec) has 2 components, expected 4",
    )
    assert details[103][0] == "missing_required"
    assert "'id'" in details[103][1]


def test_oversized() -> None:
    spec = spec_for()
    big = orjson.dumps(good(1, text="x" * 2000))
    out, rows = decode(spec, msgs(good(0), big, good(2)), max_message_bytes=1024)
    assert [(d.offset, d.reason) for d in out.dead_letters] == [(101, "oversized")]
    assert out.dead_letters[0].detail == (
        f"value is {len(big)} bytes, more than source.max_message_bytes (1024)"
    )
    expect_good(rows, [0, 2])


def test_missing_primary_key_on_upsert_rows_and_tombstones() -> None:
    spec = spec_for(mode="upsert")
    messages = [
        *msgs(good(0), {"n": 1, "vec": [1, 2, 3, 4]}, {"id": None, "vec": [1, 2, 3, 4]}),
        Msg(None, 103),  # tombstone without a key
        *msgs(good(4), first=104),
    ]
    out, rows = decode(spec, messages)
    assert [(d.offset, d.reason) for d in out.dead_letters] == [
        (101, "missing_primary_key"),
        (102, "missing_primary_key"),
        (103, "missing_primary_key"),
    ]
    expect_good(rows, [0, 4])
    assert [r["_op"] for r in rows] == [OP_UPSERT, OP_UPSERT]


def test_missing_primary_key_wins_over_other_faults() -> None:
    spec = spec_for(mode="upsert")
    out, _ = decode(spec, msgs({"n": "not an int", "vec": [1, 2]}))
    assert out.dead_letters[0].reason in {"missing_primary_key", "wrong_type"}
    out, _ = decode(spec, msgs({"n": 1, "vec": [1, 2]}))
    assert out.dead_letters[0].reason == "missing_primary_key"


def test_many_faults_in_a_large_batch_are_isolated() -> None:
    spec = spec_for()
    bad_at = {7: b"{", 500: b'{"id": 1}', 1501: b"[]", 2999: b'{"id": "x", "vec": [NaN]}'}
    values: list[bytes | dict[str, Any]] = [bad_at.get(i, good(i)) for i in range(3000)]  # type: ignore[misc]
    out, rows = decode(spec, msgs(*values, first=0))
    assert [(d.offset, d.reason) for d in out.dead_letters] == [
        (7, "invalid_json"),
        (500, "wrong_type"),
        (1501, "not_an_object"),
        (2999, "wrong_vector_dimension"),
    ]
    expect_good(rows, [i for i in range(3000) if i not in bad_at])


@contextmanager
def tiny_chunks(chunk_bytes: int = 2_000, block_bytes: int = 256) -> Iterator[None]:
    """Parse in many small chunks of several blocks, so threads and chunking are exercised."""
    with (
        mock.patch.object(json_parse, "_PARSE_CHUNK_BYTES", chunk_bytes),
        mock.patch.object(json_parse, "_MIN_BLOCK_BYTES", block_bytes),
    ):
        yield


@pytest.mark.parametrize("chunk_bytes", [300, 2_000, 1 << 22])
def test_faults_across_many_chunks(chunk_bytes: int) -> None:
    spec = spec_for()
    faulty: dict[int, tuple[bytes | None, str | None]] = {
        3: (b"{", "invalid_json"),
        40: (b'{"id": "\xff"}', "invalid_utf8"),
        41: (orjson.dumps(good(41, n="x")), "wrong_type"),
        90: (None, None),  # skipped tombstone
        91: (orjson.dumps(good(91, vec=[1])), "wrong_vector_dimension"),
        150: (
            b'{"id": "id-150", "n": 150, "text": "text 150", "vec": [NaN, 0.5, -1, 2]}',
            "nan_in_vector",
        ),
        199: (b"[]", "not_an_object"),
    }
    values: list[Any] = [faulty[i][0] if i in faulty else good(i) for i in range(200)]
    with tiny_chunks(chunk_bytes):
        out, rows = decode(spec, msgs(*values, first=0))
    assert [(d.offset, d.reason) for d in out.dead_letters] == [
        (i, reason) for i, (_, reason) in faulty.items() if reason is not None
    ]
    assert out.skipped_offsets == [90]
    expect_good(rows, [i for i in range(200) if i not in faulty])


def test_dead_letter_carries_the_raw_message() -> None:
    spec = spec_for()
    bad = Msg(b"{oops", 7, key_=b"k", timestamp_=(0, -1), headers_=[("h", b"v"), ("n", None)])
    out, rows = decode(spec, [bad])
    assert rows == []
    assert out.batch is None
    (dead,) = out.dead_letters
    assert (dead.topic, dead.partition, dead.offset) == (TOPIC, PARTITION, 7)
    assert dead.timestamp_ms is None  # TIMESTAMP_NOT_AVAILABLE
    assert (dead.key, dead.value) == (b"k", b"{oops")
    assert dead.headers == [("h", b"v"), ("n", None)]
    assert dead.reason == "invalid_json"


# -- mapping and coercions --------------------------------------------------------------

ALL_SOURCES = [
    {"name": "id", "type": "string", "nullable": False},
    {"name": "deep", "type": "int32"},
    {"name": "k", "type": "string"},
    {"name": "kb", "type": "binary"},
    {"name": "t", "type": "string"},
    {"name": "p", "type": "int32"},
    {"name": "o", "type": "int64"},
    {"name": "ts", "type": "timestamp"},
    {"name": "ts_ms", "type": "int64"},
    {"name": "trace", "type": "string"},
    {"name": "raw", "type": "binary"},
]
ALL_MAPPING = {
    "id": "$.doc.id",
    "deep": "$.a.b.c",
    "k": "@key",
    "kb": "@key",
    "t": "@topic",
    "p": "@partition",
    "o": "@offset",
    "ts": "@timestamp",
    "ts_ms": "@timestamp",
    "trace": "@headers.trace",
    "raw": "@value",
}


def test_nested_paths_and_every_metadata_source() -> None:
    spec = spec_for(columns=ALL_SOURCES, dim=None)
    values = [
        orjson.dumps({"doc": {"id": "a"}, "a": {"b": {"c": 7}}}),
        orjson.dumps({"doc": {"id": "b"}, "a": {"b": None}}),
        orjson.dumps({"doc": {"id": "c"}, "a": None, "x": [1]}),
    ]
    messages = [
        Msg(values[0], 10, b"key-a", (1, 1_000), [("trace", b"t1"), ("trace", b"t2")]),
        Msg(values[1], 11, None, (0, -1), None),
        Msg(values[2], 12, b"\xffbin", (2, 2_000), [("other", b"x")]),
    ]
    out, rows = decode(spec, messages, columns=ALL_MAPPING)
    # A key that is not UTF-8 cannot fill the string column `k`.
    assert [(d.offset, d.reason) for d in out.dead_letters] == [(12, "invalid_utf8")]
    assert "'k'" in out.dead_letters[0].detail
    assert rows == [
        {
            "id": "a",
            "deep": 7,
            "k": "key-a",
            "kb": b"key-a",
            "t": TOPIC,
            "p": PARTITION,
            "o": 10,
            "ts": EPOCH + timedelta(milliseconds=1_000),
            "ts_ms": 1_000,
            "trace": "t2",  # the last header of that name
            "raw": values[0],
            "_topic": TOPIC,
            "_partition": PARTITION,
            "_offset": 10,
        },
        {
            "id": "b",
            "deep": None,
            "k": None,
            "kb": None,
            "t": TOPIC,
            "p": PARTITION,
            "o": 11,
            "ts": None,
            "ts_ms": None,
            "trace": None,
            "raw": values[1],
            "_topic": TOPIC,
            "_partition": PARTITION,
            "_offset": 11,
        },
    ]


def test_key_and_header_into_integer_columns() -> None:
    spec = spec_for(
        columns=[
            {"name": "id", "type": "int64", "nullable": False},
            {"name": "h", "type": "int32"},
        ],
        dim=None,
    )
    messages = [
        Msg(b"{}", 0, b"42", headers_=[("h", b"-7")]),
        Msg(b"{}", 1, b"0x10"),
        Msg(b"{}", 2, b"3", headers_=[("h", b"99999999999")]),
        Msg(b"{}", 3, b"12", headers_=[("h", b"1.5")]),
        Msg(b"{}", 4, b"-5"),
    ]
    out, rows = decode(spec, messages, columns={"id": "@key", "h": "@headers.h"})
    assert [(d.offset, d.reason, d.detail) for d in out.dead_letters] == [
        (1, "wrong_type", "'id' (@key) is '0x10', not a decimal integer"),
        (2, "wrong_type", "'h' (@headers.h) is 99999999999, outside the int32 range"),
        (3, "wrong_type", "'h' (@headers.h) is '1.5', not a decimal integer"),
    ]
    assert [(r["id"], r["h"]) for r in rows] == [(42, -7), (-5, None)]


TS = [
    (1_700_000_000_123, 1_700_000_000_123),
    (0, 0),
    (-86_400_000, -86_400_000),
    ("2024-01-02T03:04:05Z", 1_704_164_645_000),
    ("2024-01-02T03:04:05.123Z", 1_704_164_645_123),
    ("2024-01-02T03:04:05.123999Z", 1_704_164_645_123),
    ("2024-01-02T05:04:05.5+02:00", 1_704_164_645_500),
    ("2024-01-02T03:04:05", 1_704_164_645_000),
    ("2024-01-02", 1_704_153_600_000),
    ("1969-12-31T23:59:59.9985Z", -2),
]


@pytest.mark.parametrize("mixed", [False, True])
def test_timestamp_epoch_ms_and_iso(mixed: bool) -> None:
    spec = spec_for(
        columns=[{"name": "id", "type": "string"}, {"name": "at", "type": "timestamp"}], dim=None
    )
    cases = TS if mixed else [c for c in TS if isinstance(c[0], str)]
    values: list[Any] = [{"id": str(i), "at": v} for i, (v, _) in enumerate(cases)]
    values += [{"id": "bad", "at": "yesterday"}, {"id": "float", "at": 1.5}, {"id": "n"}]
    out, rows = decode(spec, msgs(*values))
    assert [d.reason for d in out.dead_letters] == ["wrong_type", "wrong_type"]
    got = [r["at"] for r in rows]
    want = [EPOCH + timedelta(milliseconds=ms) for _, ms in cases] + [None]
    assert got == want


def test_float_bool_and_binary_coercions() -> None:
    spec = spec_for(
        columns=[
            {"name": "id", "type": "string"},
            {"name": "f32", "type": "float32"},
            {"name": "f64", "type": "float64"},
            {"name": "ok", "type": "bool"},
            {"name": "blob", "type": "binary"},
        ],
        dim=None,
    )
    blob = base64.b64encode(b"\x00\x01binary\xff").decode()
    values = [
        b'{"id": "a", "f32": 1, "f64": 2, "ok": true, "blob": "' + blob.encode() + b'"}',
        b'{"id": "b", "f32": 1.5, "f64": -2.25e10, "ok": false}',
        b'{"id": "c", "f64": NaN}',
        b'{"id": "d", "ok": 1}',
        b'{"id": "e", "f64": "1.0"}',
        b'{"id": "f", "blob": "not base64!"}',
        b'{"id": "g", "blob": 12}',
        b'{"id": "h", "f64": 1e999}',
    ]
    out, rows = decode(spec, msgs(*values))
    assert [(d.offset, d.reason) for d in out.dead_letters] == [
        (103, "wrong_type"),
        (104, "wrong_type"),
        (105, "wrong_type"),
        (106, "wrong_type"),
    ]
    assert rows[0] | {"_offset": 0} == {
        "id": "a",
        "f32": 1.0,
        "f64": 2.0,
        "ok": True,
        "blob": b"\x00\x01binary\xff",
        "_topic": TOPIC,
        "_partition": PARTITION,
        "_offset": 0,
    }
    assert (rows[1]["f32"], rows[1]["f64"], rows[1]["ok"]) == (1.5, -2.25e10, False)
    assert math.isnan(rows[2]["f64"])
    assert rows[3]["f64"] == math.inf


def test_unmapped_column_reads_same_named_field_and_ignores_others() -> None:
    spec = spec_for()
    value = orjson.dumps({**good(1), "extra": {"deep": [1, {"x": None}]}, "n2": "s"})
    _, rows = decode(spec, msgs(value))
    expect_good(rows, [1])


def test_pretty_printed_json_with_raw_newlines() -> None:
    spec = spec_for()
    values = [orjson.dumps(good(i), option=orjson.OPT_INDENT_2) for i in range(5)]
    assert all(b"\n" in v for v in values)
    _, rows = decode(spec, msgs(*values))
    expect_good(rows, list(range(5)))


def test_pretty_printed_json_across_the_readers_blocks() -> None:
    """Raw newlines are looked for only when a parse fails or the last batch held some: a
    batch of pretty-printed values spanning several of Arrow's reader blocks (each cut at a
    newline, some inside values) decodes as the same values compact; so does the compact
    batch after it, and a pretty batch with one bad value dead-letters only that one."""
    spec = spec_for(dim=None)
    decoder = Decoder(spec, SourceSettings())
    n = 3000

    def values(pretty: bool) -> list[bytes]:
        option = orjson.OPT_INDENT_2 if pretty else 0
        return [orjson.dumps(good(i, text=f"text {i}"), option=option) for i in range(n)]

    def rows_of(out: Decoded) -> list[dict[str, Any]]:
        assert out.batch is not None
        return [{k: r[k] for k in ("id", "n", "text")} for r in out.batch.to_pylist()]

    pretty = values(pretty=True)
    assert sum(map(len, pretty)) > 4 * (64 << 10)  # four blocks of at least 64 KiB
    expected = [{"id": f"id-{i}", "n": i, "text": f"text {i}"} for i in range(n)]
    for batch in (pretty, values(pretty=False), pretty):
        out = decoder.decode(msgs(*batch, first=0))
        assert out.dead_letters == []
        assert rows_of(out) == expected
    bad = [*pretty[:1000], b'{"id": "x",\n "n": "not a number"}', *pretty[1001:]]
    for fresh in (False, True):  # after a pretty batch, and as a decoder's first batch
        out = (Decoder(spec, SourceSettings()) if fresh else decoder).decode(msgs(*bad, first=0))
        assert [(d.offset, d.reason) for d in out.dead_letters] == [(1000, "wrong_type")]
        assert rows_of(out) == expected[:1000] + expected[1001:]


def test_duplicate_keys_last_one_wins() -> None:
    spec = spec_for()
    dup = b'{"id": "id-1", "n": 0, "n": 1, "text": "text 1", "vec": [1, 0.5, -1, 2]}'
    out, rows = decode(spec, msgs(good(0), dup))
    assert out.dead_letters == []
    expect_good(rows, [0, 1])


def test_allow_nan_accepts_non_finite_components() -> None:
    spec = spec_for(allow_nan=True)
    out, rows = decode(
        spec, msgs(b'{"id": "a", "vec": [NaN, 1, 2, 3]}', b'{"id": "b", "vec": [1e999, 1, 2, 3]}')
    )
    assert out.dead_letters == []
    assert math.isnan(rows[0]["vec"][0])
    assert rows[1]["vec"][0] == math.inf


def test_raw_format_string_and_binary() -> None:
    spec = spec_for(
        columns=[
            {"name": "body", "type": "string", "nullable": False},
            {"name": "blob", "type": "binary"},
            {"name": "k", "type": "string"},
        ],
        dim=None,
    )
    messages = [
        Msg(b"plain text \n with newline", 0, b"k0"),
        Msg(b"\xff\xfe", 1),
        Msg(b"{not json}", 2),
        Msg(None, 3),
    ]
    out, rows = decode(
        spec, messages, format="raw", columns={"body": "@value", "blob": "@value", "k": "@key"}
    )
    assert [(d.offset, d.reason) for d in out.dead_letters] == [(1, "invalid_utf8")]
    assert out.skipped_offsets == [3]
    assert [(r["body"], r["blob"], r["k"]) for r in rows] == [
        ("plain text \n with newline", b"plain text \n with newline", "k0"),
        ("{not json}", b"{not json}", None),
    ]


# -- tombstones -----------------------------------------------------------------------


def test_upsert_tombstone_is_a_delete_row_in_offset_order() -> None:
    spec = spec_for(mode="upsert")
    messages = [
        Msg(orjson.dumps(good(0)), 0, b"id-0"),
        Msg(None, 1, b"id-0"),
        Msg(orjson.dumps(good(2)), 2),
        Msg(None, 3, b"id-7"),
        Msg(None, 4, b"\xff"),  # not UTF-8: no usable string key
    ]
    out, rows = decode(spec, messages)
    assert [(d.offset, d.reason) for d in out.dead_letters] == [(4, "missing_primary_key")]
    assert [(r["_offset"], r["id"], r["_op"]) for r in rows] == [
        (0, "id-0", OP_UPSERT),
        (1, "id-0", OP_DELETE),
        (2, "id-2", OP_UPSERT),
        (3, "id-7", OP_DELETE),
    ]
    assert rows[1]["vec"] is None
    assert rows[1]["n"] is None
    assert rows[0]["vec"] == [0.0, 0.5, -1.0, 2.0]


NO_DELETE = "tombstone cannot delete"


def test_upsert_tombstone_with_integer_key() -> None:
    spec = spec_for(
        columns=[
            {"name": "id", "type": "int64", "nullable": False},
            {"name": "n", "type": "int64"},
        ],
        mode="upsert",
        dim=None,
    )
    messages = [
        Msg(None, 0, b"42"),
        Msg(b'{"id": 5, "n": 1}', 1),
        Msg(None, 2, b"forty-two"),
        Msg(None, 3, b"99999999999999999999"),
    ]
    out, rows = decode(spec, messages)
    assert [(d.offset, d.reason, d.detail) for d in out.dead_letters] == [
        # The key is the source, not the column's JSON path $.id.
        (
            2,
            "missing_primary_key",
            f"{NO_DELETE}: 'id' (@key) is 'forty-two', not a decimal integer",
        ),
        (
            3,
            "missing_primary_key",
            f"{NO_DELETE}: 'id' (@key) is {'9' * 20}, outside the int64 range",
        ),
    ]
    assert [(r["id"], r["n"], r["_op"]) for r in rows] == [(42, None, OP_DELETE), (5, 1, OP_UPSERT)]


def test_tombstone_details_say_why_nothing_is_deleted() -> None:
    spec = spec_for(mode="upsert")
    out, _ = decode(spec, [Msg(None, 0), Msg(None, 1, b"\xffid")])
    assert [d.detail for d in out.dead_letters] == [
        f"{NO_DELETE}: it has no Kafka key",
        f"{NO_DELETE}: 'id' (@key) is not UTF-8 (byte 0xff at offset 0)",
    ]
    composite = spec_for(
        columns=[
            {"name": "id", "type": "string", "nullable": False},
            {"name": "region", "type": "string", "nullable": False},
        ],
        mode="upsert",
        dim=None,
        primary_key=["id", "region"],
    )
    out, _ = decode(composite, [Msg(None, 0, b"a")])
    assert [d.detail for d in out.dead_letters] == [
        f"{NO_DELETE}: the primary key (id, region) has several columns and a Kafka key gives one"
    ]


def test_upsert_batch_of_only_tombstones() -> None:
    spec = spec_for(mode="upsert")
    out, rows = decode(spec, [Msg(None, 5, b"a"), Msg(None, 6, b"b")])
    assert out.dead_letters == []
    assert [(r["id"], r["_op"]) for r in rows] == [("a", OP_DELETE), ("b", OP_DELETE)]


@pytest.mark.parametrize("policy", ["skip", "dlq"])
def test_append_tombstones_skip_or_dlq(policy: str) -> None:
    spec = spec_for()
    messages = [*msgs(good(0), None, good(2), None, first=0)]
    out, rows = decode(spec, messages, tombstones=policy)
    expect_good(rows, [0, 2])
    if policy == "skip":
        assert out.skipped_offsets == [1, 3]
        assert out.dead_letters == []
    else:
        assert out.skipped_offsets == []
        assert [(d.offset, d.reason, d.value) for d in out.dead_letters] == [
            (1, "tombstone", None),
            (3, "tombstone", None),
        ]


def test_nothing_but_dead_letters_gives_no_batch() -> None:
    out, rows = decode(spec_for(), msgs(b"x", None))
    assert out.batch is None
    assert rows == []
    assert out.skipped_offsets == [101]


# -- construction and contract ----------------------------------------------------------


@pytest.mark.parametrize(
    ("columns", "fmt", "message"),
    [
        ({"n": "@key"}, "json", "cannot"),  # int64 from bytes is fine ...
        ({"text": "@partition"}, "json", "feeds"),
        ({"n": "@topic"}, "json", "feeds"),
        ({"id": "$.a", "text": "$.a.b"}, "json", "runs through a scalar"),
        ({"id": "$.a.b", "text": "$.a"}, "json", "also read"),
        ({"id": "$.a", "n": "$.a"}, "json", "two types"),
        ({"id": "@value"}, "raw", "'vec' is required but has no source"),
        ({"nope": "$.x"}, "json", "unknown"),
    ],
)
def test_impossible_mappings_are_refused(columns: dict[str, str], fmt: str, message: str) -> None:
    spec = spec_for()
    if message == "cannot":
        Decoder(spec, SourceSettings(columns=columns))
        return
    with pytest.raises(ValueError, match=message):
        Decoder(spec, SourceSettings(format=fmt, columns=columns))  # type: ignore[arg-type]


def test_bytes_cannot_feed_float_columns() -> None:
    spec = spec_for(columns=[{"name": "f", "type": "float64"}], dim=None)
    with pytest.raises(ValueError, match="bytes"):
        Decoder(spec, SourceSettings(columns={"f": "@key"}))


def test_empty_input_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Decoder(spec_for(), SourceSettings()).decode([])


def test_table_without_source_columns() -> None:
    spec = spec_for(source_columns=False, primary_key=["id"])
    out, rows = decode(spec, msgs(good(0), b"[]"))
    assert [d.reason for d in out.dead_letters] == ["not_an_object"]
    assert "_offset" not in rows[0]
    expect_good(rows, [0])


# -- property: bulk decoding agrees with a plain per-row reference ----------------------

PROP_COLUMNS = [
    {"name": "id", "type": "string", "nullable": False},
    {"name": "i32", "type": "int32"},
    {"name": "i64", "type": "int64"},
    {"name": "f32", "type": "float32"},
    {"name": "f64", "type": "float64"},
    {"name": "flag", "type": "bool"},
    {"name": "at", "type": "timestamp"},
    {"name": "blob", "type": "binary"},
    {"name": "tag", "type": "string"},
]
PROP_MAPPING = {"tag": "$.meta.tag", "f32": "$.meta.nums.f"}
PROP_DIM = 3

_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
_f64 = st.floats(allow_nan=False, allow_infinity=False)
_ms = st.integers(min_value=-(10**12), max_value=10**13)
_iso = st.datetimes(
    min_value=datetime(1900, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)
).map(lambda d: d.isoformat())


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


@st.composite
def _objects(draw: st.DrawFn, timestamps: st.SearchStrategy[Any]) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": draw(_text), "vec": draw(st.lists(_f32, min_size=3, max_size=3))}
    optional: dict[str, st.SearchStrategy[Any]] = {
        "i32": st.integers(-(2**31), 2**31 - 1),
        "i64": st.integers(-(2**63), 2**63 - 1),
        "f64": st.one_of(_f64, st.integers(-(2**53), 2**53)),
        "flag": st.booleans(),
        "at": timestamps,
        "blob": st.binary(max_size=8).map(lambda b: base64.b64encode(b).decode()),
        "noise": st.recursive(
            st.none() | st.integers(-(2**63), 2**64 - 1) | _text,
            lambda s: st.lists(s, max_size=2),
            max_leaves=3,
        ),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            obj[name] = draw(_maybe(strategy))
    if draw(st.booleans()):
        meta: dict[str, Any] = {"tag": draw(_maybe(_text))}
        if draw(st.booleans()):
            meta["nums"] = draw(_maybe(st.fixed_dictionaries({"f": _maybe(_f32)})))
        obj["meta"] = meta
    return obj


def _reference_row(obj: dict[str, Any], offset: int) -> dict[str, Any]:
    """The straightforward per-row decoding of one valid object."""

    def at(path: str) -> Any:
        item: Any = obj
        for name in path.split("."):
            item = item.get(name) if isinstance(item, dict) else None
        return item

    def timestamp(value: Any) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, int):
            return EPOCH + timedelta(milliseconds=value)
        parsed = datetime.fromisoformat(value)
        return parsed.replace(microsecond=parsed.microsecond // 1000 * 1000)

    f32 = at("meta.nums.f")
    f64 = obj.get("f64")
    blob = obj.get("blob")
    return {
        "id": obj["id"],
        "i32": obj.get("i32"),
        "i64": obj.get("i64"),
        "f32": None if f32 is None else float(f32),
        "f64": None if f64 is None else float(f64),
        "flag": obj.get("flag"),
        "at": timestamp(obj.get("at")),
        "blob": None if blob is None else base64.b64decode(blob),
        "tag": at("meta.tag"),
        "vec": [float(x) for x in obj["vec"]],
        "_topic": TOPIC,
        "_partition": PARTITION,
        "_offset": offset,
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.lists(_objects(_ms), min_size=1, max_size=40),
        st.lists(_objects(_iso), min_size=1, max_size=40),
        st.lists(_objects(st.one_of(_ms, _iso)), min_size=1, max_size=40),
    ),
    st.booleans(),
)
def test_bulk_decoding_matches_per_row_reference(
    objects: list[dict[str, Any]], indent: bool
) -> None:
    spec = spec_for(columns=PROP_COLUMNS, dim=PROP_DIM)
    option = orjson.OPT_INDENT_2 if indent else 0
    messages = [Msg(orjson.dumps(o, option=option), 1000 + i) for i, o in enumerate(objects)]
    out, rows = decode(spec, messages, columns=PROP_MAPPING)
    assert out.dead_letters == []
    assert rows == [_reference_row(o, 1000 + i) for i, o in enumerate(objects)]


BAD_MENU = [(value, reason) for reason, value in BAD_JSON]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.integers(0, 10**6).map(lambda i: ("good", i)),
            st.sampled_from(BAD_MENU).map(lambda bad: ("bad", bad)),
        ),
        min_size=1,
        max_size=60,
    ),
    st.sampled_from([150, 1_000, 1 << 22]),
)
def test_good_messages_survive_any_mix_of_bad_ones(
    plan: list[tuple[str, Any]], chunk_bytes: int
) -> None:
    spec = spec_for()
    values = [orjson.dumps(good(x)) if kind == "good" else x[0] for kind, x in plan]
    with tiny_chunks(chunk_bytes, block_bytes=128):
        out, rows = decode(spec, msgs(*values, first=0))
    assert [(d.offset, d.reason) for d in out.dead_letters] == [
        (i, x[1]) for i, (kind, x) in enumerate(plan) if kind == "bad"
    ]
    expect_good(rows, [x for kind, x in plan if kind == "good"])
    assert [r["_offset"] for r in rows] == [i for i, (kind, _) in enumerate(plan) if kind == "good"]


def test_deep_json_decodes_the_same_alone_and_beside_a_bad_message() -> None:
    """A valid message nesting an unused field 5,000 deep: Arrow's reader takes it, Python's
    parsers do not (recursion). It was a row in a clean batch and an `invalid_json` dead
    letter in a batch that also held a wrong-typed message (the per-message path)."""
    spec = spec_for(dim=None)
    deep = b'{"id": "deep", "n": 1, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    clean, rows = decode(spec, msgs(deep, good(2)))
    assert not clean.dead_letters
    mixed, rows_mixed = decode(spec, msgs(deep, good(2), {"id": "bad", "n": "x"}))
    assert [(d.offset, d.reason) for d in mixed.dead_letters] == [(102, "wrong_type")]
    assert [r["id"] for r in rows_mixed] == [r["id"] for r in rows] == ["deep", "id-2"]
    # Broken as well as deep: a dead letter either way.
    broken = deep[:-1]
    for batch in (msgs(broken), msgs(broken, {"id": "bad", "n": "x"})):
        out, _ = decode(spec, batch)
        assert [d.reason for d in out.dead_letters][:1] == ["invalid_json"]


def test_a_float32_column_refuses_finite_numbers_beyond_its_range() -> None:
    """1e300 or 4e38 in a float32 column was stored as infinity, silently (an int32
    overflow is a dead letter). Infinite in the JSON (Infinity, 1e999) stays infinity, as in
    float64; float64 columns keep every double."""
    spec = spec_for(
        columns=[
            {"name": "id", "type": "string"},
            {"name": "f32", "type": "float32"},
            {"name": "f64", "type": "float64"},
        ],
        dim=None,
    )
    values = [
        b'{"id": "a", "f32": 1e300, "f64": 1e300}',
        b'{"id": "b", "f32": -4e38}',
        b'{"id": "c", "f32": 3.4e38, "f64": 1e308}',
        b'{"id": "d", "f32": Infinity}',
        b'{"id": "e", "f32": 1e999}',
        b'{"id": "f", "f32": 1.5}',
        b'{"id": "g", "f32": -3.4028235e38}',
        b'{"id": "h", "f32": 3.4028235e38, "id": "h"}',
    ]
    for batch in (values, [*values, b'{"id": "z", "f32": "x"}']):  # bulk, then per message
        out, rows = decode(spec, msgs(*batch))
        faults = [(d.offset, d.reason, d.detail) for d in out.dead_letters][:2]
        beyond = "beyond the float32 range (largest 3.402823e+38)"
        assert faults == [
            (100, "wrong_type", f"'f32' ($.f32) is 1e+300, {beyond}"),
            (101, "wrong_type", f"'f32' ($.f32) is -4e+38, {beyond}"),
        ]
        assert [r["id"] for r in rows] == ["c", "d", "e", "f", "g", "h"]
        assert rows[0]["f32"] == pytest.approx(3.4e38, rel=1e-6)
        assert rows[0]["f64"] == 1e308
        assert rows[1]["f32"] == rows[2]["f32"] == math.inf
        assert rows[4]["f32"] == -rows[5]["f32"] == -3.4028234663852886e38  # the largest float32


def test_an_integer_beyond_64_bits_is_named_as_sent() -> None:
    """orjson reads 2**70 as a float: the detail said 1.18e+21, "expected an integer"."""
    spec = spec_for(dim=None)
    big = b'{"id": "a", "n": 1180591620717411303424}'
    for batch in (msgs(big), msgs(big, {"id": "b", "n": "x"})):
        out, _ = decode(spec, batch)
        assert out.dead_letters[0].detail == (
            "'n' ($.n) is 1180591620717411303424, outside the int64 range"
        )


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_rows_taken_by_runs_equal_arrows_take(data: st.DataObject) -> None:
    """`_take` joins runs of a list array's rows instead of Arrow's row-by-row take: the
    same array for any rows (ascending with gaps, a permutation, none, repeats)."""
    n = data.draw(st.integers(1, 40))
    lengths = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    values = [None if k == 0 and i % 3 == 0 else list(range(k)) for i, k in enumerate(lengths)]
    arr = pa.array(values, pa.list_(pa.float32())).slice(data.draw(st.integers(0, 1)))
    rows = np.array(
        data.draw(st.lists(st.integers(0, len(arr) - 1), max_size=2 * n)) if len(arr) else [],
        np.int64,
    )
    if data.draw(st.booleans()):
        rows = np.unique(rows)
    got = decode_plan.take(arr, rows)
    assert got.equals(arr.take(pa.array(rows, pa.int64())))
