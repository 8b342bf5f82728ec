"""A message's fate is its own, and no message makes decoding raise.

For generated messages of every format, and mutations of them (byte flips, insertions,
cuts, numbers swapped for huge, tiny and non-standard ones, deep nesting, duplicate keys,
invalid UTF-8 and surrogates, broken wire-format framing), each message decoded alone,
all of them in one batch, and all of them in batches of random composition mixed with
known-bad messages get the same fate: the same row, bit for bit, or the same dead letter
(reason and detail). The batches run on two threads sharing one decoder (as the sink's
decode workers do), with the vector scan's SSSE3 and its portable reader, and in decode
processes (the registry formats' against a registry over HTTP: the workers cannot see the
in-process one). Every message is accounted for exactly once, and
none is a ``decode_error`` dead letter: that would mean some path raised (the decoder
turns what raises into one, `sink.decode_total.total`; here it is a bug found).

Bounded in ``make test``; ``make fuzz`` runs it long (``LANCE_SINK_FUZZ_EXAMPLES``).
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import itertools
import json
import os
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from config.loader import load_settings
from config.settings import SchemaRegistrySettings, SourceSettings, TableSettings
from engine.schema import TableSpec
from sink.cdc import LOGICAL, logical_converter, logical_value
from sink.decode import Decoded, Decoder
from sink.decode_process import ProcessDecoder
from sink.demo import Embedder, review
from sink.formats.records import convert
from sink.formats.registry import build_client
from tests.support import debezium as dbz
from tests.support.registry import FakeRegistry
from tests.unit.test_decode import Msg
from tests.unit.test_decode_cdc import _no_nulls, _proto_decimal, _proto_envelope
from tests.unit.test_decode_vector_json import (
    COLUMNS,
    DIM,
    MAPPED,
    base64_message,
    json_message,
)
from tests.unit.test_formats_protobuf_json import SPEC_COLUMNS, make_order, order_class

#: ``make fuzz`` sets this: examples per test (0: each test's bounded default).
FUZZ_EXAMPLES = int(os.environ.get("LANCE_SINK_FUZZ_EXAMPLES", "0"))
TOPIC = "orders"


def fuzz_settings(bounded: int) -> Callable[[Any], Any]:
    return settings(
        max_examples=FUZZ_EXAMPLES or bounded,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- the tables ---------------------------------------------------------------------


def table(kind: str) -> TableSpec:
    """The tables of the tests: "plain" (no vector), "vector", "base64_f32", "upsert"
    (a vector table keyed by ``id``), "protobuf" (the columns of the Protobuf tests)."""
    columns = SPEC_COLUMNS if kind == "protobuf" else COLUMNS
    raw: dict[str, Any] = {"uri": "/tmp/unused", "columns": columns}
    if kind in {"vector", "base64_f32", "upsert", "protobuf"}:
        raw["vector"] = {"column": "vec", "dim": DIM}
        if kind == "base64_f32":
            raw["vector"]["encoding"] = "base64_f32"
    if kind == "upsert":
        raw["mode"] = "upsert"
        raw["primary_key"] = ["id"]
    return TableSpec.from_settings(TableSettings.model_validate(raw))


def json_source(**extra: Any) -> SourceSettings:
    return SourceSettings(columns=MAPPED, **extra)


# -- fates --------------------------------------------------------------------------


def _bits(arr: pa.Array) -> list[Any]:
    """A column's values with every float as its bit pattern (-0.0 and NaN count)."""
    if pa.types.is_fixed_size_list(arr.type):
        # Its values hold a slot per component of every row, null rows included.
        size = arr.type.list_size
        flat = arr.values.fill_null(0).to_numpy().astype(np.float32, copy=False)
        bits = flat.view(np.uint32).tolist()
        start = arr.offset * size
        return [
            None if null else tuple(bits[start + i * size : start + (i + 1) * size])
            for i, null in enumerate(arr.is_null().to_pylist())
        ]
    if pa.types.is_floating(arr.type):
        nulls = arr.is_null().to_pylist()
        data = arr.fill_null(0).to_numpy()
        view = data.view(np.uint32 if data.dtype == np.float32 else np.uint64)
        return [None if z else int(b) for z, b in zip(nulls, view, strict=True)]
    return arr.to_pylist()


def fates(out: Decoded, messages: Sequence[Msg]) -> dict[int, tuple[Any, ...]]:
    """Each message's fate by offset: ("row", values), ("dead", reason, detail) or
    ("skipped",); asserts that every message is accounted for exactly once."""
    dead = {d.offset: ("dead", d.reason, d.detail) for d in out.dead_letters}
    assert len(dead) == len(out.dead_letters), "a message dead-lettered twice"
    skipped = set(out.skipped_offsets)
    rows: list[tuple[Any, ...]] = []
    if out.batch is not None:
        columns = [_bits(c) for c in out.batch.columns]
        rows = list(zip(*columns, strict=True))
    offsets = [m.offset() for m in messages]
    assert set(dead) | skipped <= set(offsets)
    assert not set(dead) & skipped
    written = [o for o in offsets if o not in dead and o not in skipped]
    assert len(rows) == len(written), "rows and messages do not add up"
    assert (out.first_offset, out.last_offset) == (offsets[0], offsets[-1])
    result: dict[int, tuple[Any, ...]] = {o: dead[o] for o in dead}
    result.update(dict.fromkeys(skipped, ("skipped",)))
    result.update({o: ("row", row) for o, row in zip(written, rows, strict=True)})
    raised = [f for f in result.values() if f[0] == "dead" and f[1] == "decode_error"]
    assert not raised, f"a decode path raised: {raised[0][2]}"
    return result


Decode = Callable[[Sequence[Msg]], Decoded]
#: The decode threads (as the sink's `source.decode_workers` pool): the same two threads
#: throughout, so a `ProcessDecoder`'s threads keep their worker processes.
_POOL = ThreadPoolExecutor(2, thread_name_prefix="decode")


def check_fates(
    decoders: Sequence[Decode],
    values: list[bytes | None],
    bad: list[bytes | None],
    cuts: list[int],
    bad_at: list[int],
    keys: list[bytes | None] | None = None,
    headers: list[list[tuple[str, bytes | None]] | None] | None = None,
) -> None:
    """The metamorphic relation: alone = one batch = random batches with bad neighbours,
    for every decoder given (all must agree with the first one's lone decodes)."""
    keys = keys or [f"k{i}".encode() for i in range(len(values))]
    headers = headers or [None] * len(values)
    messages = [
        Msg(v, 10 * i, key_=k, headers_=h)
        for i, (v, k, h) in enumerate(zip(values, keys, headers, strict=True))
    ]
    reference = decoders[0]
    alone: dict[int, tuple[Any, ...]] = {}
    for m in messages:
        alone.update(fates(reference([m]), [m]))
    # Mixed: known-bad messages at offsets between the generated ones.
    mixed = list(messages)
    for n, at in enumerate(bad_at[:9]):
        before = at % (len(messages) + 1) - 1  # the generated message it follows (-1: none)
        mixed.append(Msg(bad[n % len(bad)], 10 * before + 1 + n, key_=b"bad"))
    mixed.sort(key=lambda m: m.offset())
    bounds = sorted({0, len(mixed), *(c % (len(mixed) + 1) for c in cuts)})
    batches = [mixed[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    wanted = {m.offset() for m in messages}
    for decode in decoders:
        assert fates(decode(messages), messages) == alone
        outs = list(_POOL.map(decode, batches))
        got: dict[int, tuple[Any, ...]] = {}
        for out, part in zip(outs, batches, strict=True):
            got.update(fates(out, part))
        assert {o: f for o, f in got.items() if o in wanted} == alone


# -- mutations ----------------------------------------------------------------------

_BIG = b"1" + b"0" * 400
_NUMBER = re.compile(rb"-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
#: What a mutation may write in place of a number, or insert.
TOKENS = [
    b"-NaN", b"NaN", b"Inf", b"-Inf", b"Infinity", b"-Infinity", b"nan", b"+1", b"01",
    b"1e400", b"-1e400", b"1e-400", _BIG, b"-" + _BIG, b"9" * 5000, b"-0", b"-0.0", b"0e0",
    b"1E+2", b"18446744073709551616", b"-9223372036854775809", b"1.", b".5", b"1e",
    b"[" * 1200 + b"]" * 1200, b"[" * 40 + b"]" * 40, b'{"a":' * 30 + b"1" + b"}" * 30,
    b'"\\ud800"', b'"\\udc00\\ud800"', b'"\xed\xa0\x80"', b"\xff", b"\xc3", b'"\x00"',
    b'"\\u0000"', b'"x\\"', b"null", b"true", b"{}", b"[]", b'"id": "dup", ', b"\xef\xbb\xbf",
    b"\n", b"\r", b"\t", b" ",
]  # fmt: skip


@st.composite
def mutated(draw: st.DrawFn, value: bytes) -> bytes:
    """`value` with up to three mutations."""
    data = bytearray(value)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["number", "number", "insert", "flip", "cut", "delete"]))
        at = draw(st.integers(0, max(len(data), 1)))
        if kind == "number" and (numbers := list(_NUMBER.finditer(bytes(data)))):
            match = numbers[draw(st.integers(0, len(numbers) - 1))]
            data[match.start() : match.end()] = draw(st.sampled_from(TOKENS))
        elif kind == "insert":
            token = draw(st.one_of(st.sampled_from(TOKENS), st.binary(min_size=1, max_size=4)))
            data[at:at] = token
        elif kind == "flip" and data:
            pos = min(at, len(data) - 1)
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del data[at:]
        elif kind == "delete" and data:
            del data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


def mutations_of(values: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return values.flatmap(lambda v: st.one_of(st.just(v), mutated(v)))


def batches_of(values: st.SearchStrategy[bytes | None]) -> st.SearchStrategy[Any]:
    return st.tuples(
        st.lists(values, min_size=1, max_size=14),
        st.lists(st.integers(0, 200), max_size=4),  # cuts between batches
        st.lists(st.integers(0, 200), max_size=4),  # where known-bad messages go
    )


#: Known-bad neighbours: each makes a bulk parse of its batch fail (the last one only
#: after the vector scan, in the stripped texts' parse).
JSON_BAD: list[bytes | None] = [
    b"{not json", b"null", b"\xff\xfe", b"[1, 2]", b"", b'{"id": 5}',
    b'{"id": 5, "vec": [1, 2, 3, 4]}',
]  # fmt: skip


# -- JSON ---------------------------------------------------------------------------

#: The explicit examples: each was a message whose fate depended on its neighbours.
NEG_NAN = b'{"id": "x", "f": -NaN, "vec": [1, 2, 3, 4]}'
EXAMPLES: list[bytes] = [
    NEG_NAN,
    b'{"id": "x", "g": -NaN, "vec": [1, 2, 3, 4]}',
    b'{"id": "x", "g": Inf, "f": -Inf, "vec": [1, 2, 3, 4]}',
    b'{"id": "x", "vec": [1, -NaN, 3, 4]}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "other": -NaN}',
    b'{"id": "x", "vec": [%s, 2, 3, 4]}' % _BIG,
    # nested 990 deep and not JSON: Python's parser read it or ran out of stack depending
    # on the caller's stack (a test's thread or a decode thread)
    b'{"id": "x", "vec": [1, %s%s], "a\\u-0": 1}' % (b"[" * 990, b"]" * 990),
    # a raw newline inside a string (not JSON): the bulk path made it a space, and so a
    # value, when another raw newline had it look for them; the other paths refuse it
    b'{"id": "a\nb", "vec": [1, 2, 3, 4], "text": "\n"}',
    # longer than Python reads integers (4,300 digits): Arrow's reader reads infinity
    b'{"id": "x", "vec": [%s, 2, 3, 4]}' % (b"9" * 5000),
    b'{"id": "x", "n": -%s, "f": %s, "vec": [1, 2, 3, 4]}' % (b"9" * 5000, b"9" * 5000),
]


#: The upsert table's columns: the JSON ones, and a header for its binary column.
UPSERT_SOURCE = SourceSettings(columns={**MAPPED, "b": "@headers.blob"})


@pytest.fixture(scope="module")
def processes() -> Iterator[dict[str, ProcessDecoder]]:
    made = {
        kind: ProcessDecoder(table(kind), json_source(), schema_check="off", workers=2)
        for kind in ("vector", "plain", "base64_f32")
    }
    made["upsert"] = ProcessDecoder(table("upsert"), UPSERT_SOURCE, schema_check="off", workers=2)
    yield made
    for decoder in made.values():
        decoder.close()


def json_decoders(kind: str, processes: dict[str, ProcessDecoder] | None) -> list[Decode]:
    spec = table(kind)
    decoders: list[Decode] = [
        Decoder(spec, json_source()).decode,
        Decoder(spec, json_source(), scan_simd=False).decode,
    ]
    if processes is not None and kind in processes:
        decoders.append(processes[kind].decode)
    return decoders


@pytest.mark.parametrize("kind", ["vector", "plain"])
@pytest.mark.parametrize("value", EXAMPLES)
def test_the_messages_whose_fate_depended_on_their_neighbours(kind: str, value: bytes) -> None:
    """Each between neighbours whose bulk parse fails (a wrong type after the vector scan,
    and text that is not JSON), so its batch is screened message by message."""
    bad: list[bytes | None] = [b'{"id": 5, "vec": [1, 2, 3, 4]}', b"{not json"]
    check_fates(json_decoders(kind, None), [value, value], bad, [], [0, 1, 2])


@fuzz_settings(20)
@example((EXAMPLES, [2], [0, 3]))
@given(batches_of(mutations_of(json_message())))
def test_json_vector_messages(
    processes: dict[str, ProcessDecoder], case: tuple[list[bytes], list[int], list[int]]
) -> None:
    values, cuts, bad_at = case
    check_fates(json_decoders("vector", processes), list(values), JSON_BAD, cuts, bad_at)


@fuzz_settings(15)
@example((EXAMPLES, [2], [0, 3]))
@given(batches_of(mutations_of(json_message())))
def test_json_messages_without_a_vector(
    processes: dict[str, ProcessDecoder], case: tuple[list[bytes], list[int], list[int]]
) -> None:
    values, cuts, bad_at = case
    check_fates(json_decoders("plain", processes), list(values), JSON_BAD, cuts, bad_at)


#: A base64 text with a raw newline inside (not JSON), beside a value that is not JSON.
NEWLINE_BASE64 = [
    b'{"id": "x", "vec": "AAAAAAAAAAAAAAAAAAAAAA=="}',
    b'{"id": "x", "vec": "AAAAAAAAAAAAAAAAAAD\nQQ=="}',
    b'{"id": "x", "vec": "AAAAAAAAAAAAAAAAI{"a":1}AqWg=="}',
]


@fuzz_settings(15)
@example((NEWLINE_BASE64, [], []), 0)
@example((NEWLINE_BASE64[:2], [], [0]), 0)
@given(batches_of(mutations_of(base64_message())), st.integers(0, 3))
def test_json_base64_vector_messages(
    processes: dict[str, ProcessDecoder],
    case: tuple[list[bytes], list[int], list[int]],
    scale: int,
) -> None:
    """Batches of more than 64 base64 values take the scan, smaller ones simdjson in
    Python: `scale` repeats the values so both are reached."""
    values, cuts, bad_at = case
    values = values * (1 + 20 * scale)
    spec = table("base64_f32")
    decoders: list[Decode] = [Decoder(spec, json_source()).decode, processes["base64_f32"].decode]
    check_fates(decoders, values, JSON_BAD, cuts, bad_at)


#: The quickstart's (and the demo's) table: product reviews with a 384-dim embedding.
QUICKSTART = load_settings(Path(__file__).resolve().parents[2] / "config/examples/quickstart.toml")
_EMBED = Embedder()


@st.composite
def review_message(draw: st.DrawFn) -> bytes:
    """A review as `lance-sink demo` produces it."""
    return json.dumps(review(draw(st.integers(0, 10**6)), _EMBED)).encode()


#: The message of the crash loop: a review whose first component is a 400-digit integer.
_REVIEW = json.dumps(review(1, _EMBED)).encode()
POISON_REVIEW = re.sub(rb'"embedding": \[[^,]+', b'"embedding": [' + _BIG, _REVIEW)


@fuzz_settings(20)
@example(([_REVIEW, POISON_REVIEW, _REVIEW], [1], [2]))
@given(batches_of(mutations_of(review_message())))
def test_demo_review_messages(case: tuple[list[bytes], list[int], list[int]]) -> None:
    """The quickstart's table and the demo's messages (a 384-dim vector), as a new user
    runs them: the decoder with the default settings, SSSE3 and portable scans."""
    values, cuts, bad_at = case
    spec = TableSpec.from_settings(QUICKSTART.table)
    decoders: list[Decode] = [
        Decoder(spec, QUICKSTART.source).decode,
        Decoder(spec, QUICKSTART.source, scan_simd=False).decode,
    ]
    check_fates(decoders, list(values), JSON_BAD, cuts, bad_at)


@st.composite
def keyed(draw: st.DrawFn) -> tuple[bytes | None, bytes | None, Any]:
    """A value (or a tombstone), a key (maybe not UTF-8, maybe missing) and headers (the
    last ``blob`` header is the binary column's: none, null, twice)."""
    value = draw(st.one_of(mutations_of(json_message()), st.none()))
    key = draw(
        st.one_of(
            st.text(max_size=6).map(str.encode), st.binary(max_size=4), st.none(),
            st.sampled_from([b"\xed\xa0\x80", b"\xff", b""]),
        )
    )  # fmt: skip
    blob = st.one_of(st.binary(max_size=5), st.none())
    headers = draw(
        st.one_of(
            st.none(),
            st.lists(st.tuples(st.sampled_from(["blob", "other"]), blob), max_size=3),
        )
    )
    return value, key, headers


@fuzz_settings(15)
@given(
    st.lists(keyed(), min_size=1, max_size=14),
    st.lists(st.integers(0, 200), max_size=4),
    st.lists(st.integers(0, 200), max_size=4),
)
def test_upsert_messages_with_keys_headers_and_tombstones(
    processes: dict[str, ProcessDecoder],
    pairs: list[tuple[bytes | None, bytes | None, Any]],
    cuts: list[int],
    bad_at: list[int],
) -> None:
    spec = table("upsert")
    decoders: list[Decode] = [Decoder(spec, UPSERT_SOURCE).decode, processes["upsert"].decode]
    values = [v for v, _, _ in pairs]
    keys = [k for _, k, _ in pairs]
    headers = [h for _, _, h in pairs]
    check_fates(decoders, values, [*JSON_BAD, None], cuts, bad_at, keys, headers)


# -- registry formats -----------------------------------------------------------------

REGISTRY = {"url": f"mock://{uuid.uuid4().hex}"}
CONTEXT = SerializationContext(TOPIC, MessageField.VALUE)
RECORD_SCHEMA = json.dumps(
    {
        "type": "record",
        "name": "Order",
        "fields": [
            {"name": "id", "type": "string"},
            {"name": "n", "type": ["null", "int"], "default": None},
            {"name": "f", "type": ["null", "float"], "default": None},
            {"name": "g", "type": ["null", "double"], "default": None},
            {"name": "ok", "type": ["null", "boolean"], "default": None},
            {"name": "at", "type": ["null", {"type": "long", "logicalType": "timestamp-millis"}],
             "default": None},
            {"name": "b", "type": ["null", "bytes"], "default": None},
            {"name": "vec", "type": {"type": "array", "items": "float"}},
            {"name": "meta", "type": ["null", {"type": "record", "name": "Meta", "fields": [
                {"name": "score", "type": ["null", "double"], "default": None}]}],
             "default": None},
        ],
    }
)  # fmt: skip
JSON_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "n": {"type": "integer"},
            "f": {"type": "number"},
            "g": {"type": "number"},
            "ok": {"type": "boolean"},
            "vec": {"type": "array", "items": {"type": "number"}},
            "meta": {"type": "object", "properties": {"score": {"type": "number"}}},
        },
        "required": ["id"],
    }
)


def serializers(url: str) -> dict[str, Callable[[Any], bytes]]:
    """confluent-kafka's serializers of each registry format, into the registry at `url`."""
    client = build_client(SchemaRegistrySettings(url=url))
    avro = AvroSerializer(client, RECORD_SCHEMA)
    json_schema = JSONSerializer(JSON_SCHEMA, client)
    protobuf = ProtobufSerializer(order_class(), client, {"use.deprecated.format": False})
    return {
        "avro": lambda value: avro(value, CONTEXT),
        "json_schema": lambda value: json_schema(value, CONTEXT),
        "protobuf": lambda value: protobuf(value, CONTEXT),
    }


#: Into the in-process registry (`REGISTRY`), and into the HTTP one of `http_registry`
#: (filled by that fixture; decode processes cannot see an in-process registry).
MOCK_SERIALIZERS = serializers(REGISTRY["url"])
HTTP_SERIALIZERS: dict[str, Callable[[Any], bytes]] = {}

_floats = st.one_of(
    st.floats(width=32), st.sampled_from([0.0, -0.0, 3.4e38, -3.4e38, 1e-45, float("nan")])
)
_doubles = st.one_of(st.floats(), st.sampled_from([1e308, -0.0, 1e39, 5e-324]))


@st.composite
def record(draw: st.DrawFn) -> dict[str, Any]:
    size = draw(st.sampled_from([DIM] * 6 + [0, DIM + 1]))
    return {
        "id": draw(st.text(max_size=6)),
        "n": draw(st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1))),
        "f": draw(st.one_of(st.none(), _floats)),
        "g": draw(st.one_of(st.none(), _doubles)),
        "ok": draw(st.one_of(st.none(), st.booleans())),
        "at": draw(st.one_of(st.none(), st.integers(-(2**40), 2**42))),
        "b": draw(st.one_of(st.none(), st.binary(max_size=5))),
        "vec": draw(st.lists(_floats, min_size=size, max_size=size)),
        "meta": draw(st.one_of(st.none(), st.fixed_dictionaries({"score": _doubles}))),
    }


@st.composite
def avro_value(draw: st.DrawFn, serialize: dict[str, Callable[[Any], bytes]]) -> bytes:
    rec = draw(record())
    if rec["at"] is not None:
        rec["at"] = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(milliseconds=rec["at"])
    return serialize["avro"](rec)


@st.composite
def json_schema_value(draw: st.DrawFn, serialize: dict[str, Callable[[Any], bytes]]) -> bytes:
    rec = draw(record())
    doc = {k: v for k, v in rec.items() if k not in {"at", "b"} and v is not None}
    finite = all(np.isfinite(x) for x in [*doc["vec"], doc.get("f", 0.0), doc.get("g", 0.0)]) and (
        doc.get("meta") is None or np.isfinite(doc["meta"]["score"])
    )
    if not finite:
        doc.pop("f", None)
        doc.pop("g", None)
        doc.pop("meta", None)
        doc["vec"] = [0.5] * len(doc["vec"])
    return serialize["json_schema"](doc)


@st.composite
def protobuf_value(draw: st.DrawFn, serialize: dict[str, Callable[[Any], bytes]]) -> bytes:
    return serialize["protobuf"](make_order(order_class(), draw(st.integers(0, 2**27))))


REGISTRY_VALUES = {"avro": avro_value, "json_schema": json_schema_value, "protobuf": protobuf_value}


REGISTRY_BAD: list[bytes | None] = [b"not framed", b"\x00", b"\x00\x00\x00\x00\x01\x02", b""]
_PROTOBUF_COLUMNS = {"meta_n": "$.meta.n"}


def registry_case(fmt: str, url: str) -> tuple[TableSpec, SourceSettings]:
    columns = _PROTOBUF_COLUMNS if fmt == "protobuf" else MAPPED
    source = SourceSettings(format=fmt, schema_registry={"url": url}, columns=columns)
    return table("protobuf" if fmt == "protobuf" else "vector"), source


@pytest.mark.parametrize("fmt", sorted(REGISTRY_VALUES))
@fuzz_settings(12)
@given(data=st.data())
def test_registry_format_messages(fmt: str, data: st.DataObject) -> None:
    values = REGISTRY_VALUES[fmt](MOCK_SERIALIZERS)
    values_, cuts, bad_at = data.draw(batches_of(mutations_of(values)))
    spec, source = registry_case(fmt, REGISTRY["url"])
    check_fates([Decoder(spec, source).decode], list(values_), REGISTRY_BAD, cuts, bad_at)


@pytest.fixture(scope="module")
def http_registry() -> Iterator[tuple[str, dict[str, ProcessDecoder]]]:
    """A registry over HTTP on 127.0.0.1 (`tests.support.registry`), the serializers into
    it, and a `ProcessDecoder` of each registry format reading from it."""
    registry = FakeRegistry().start()
    HTTP_SERIALIZERS.update(serializers(registry.url))
    made = {
        fmt: ProcessDecoder(*registry_case(fmt, registry.url), schema_check="off", workers=2)
        for fmt in REGISTRY_VALUES
    }
    yield registry.url, made
    for decoder in made.values():
        decoder.close()
    HTTP_SERIALIZERS.clear()
    registry.stop()


@pytest.mark.parametrize("fmt", sorted(REGISTRY_VALUES))
@fuzz_settings(8)
@given(data=st.data())
def test_registry_format_messages_in_decode_processes(
    http_registry: tuple[str, dict[str, ProcessDecoder]], fmt: str, data: st.DataObject
) -> None:
    url, processes = http_registry
    values = REGISTRY_VALUES[fmt](HTTP_SERIALIZERS)
    values_, cuts, bad_at = data.draw(batches_of(mutations_of(values)))
    spec, source = registry_case(fmt, url)
    decoders = [Decoder(spec, source).decode, processes[fmt].decode]
    check_fates(decoders, list(values_), REGISTRY_BAD, cuts, bad_at)


def protobuf_examples(serialize: dict[str, Callable[[Any], bytes]]) -> list[bytes]:
    """Protobuf messages whose fate a decode path or a neighbour decided (each was found by
    the long fuzz run): a Timestamp beyond the years 1-9999 (its conversion raised out of
    the decoder), and an unknown schema id with good and with bad message indexes (read
    before the schema, the bad ones were `not_matching_schema` alone and
    `unknown_schema_id` after a message naming the same id)."""
    cls = order_class()
    late = make_order(cls, 3)
    late.at.seconds = 7_941_538_679_338_565_632
    good = serialize["protobuf"](make_order(cls, 1))
    unknown = b"\x00" + (99_999).to_bytes(4, "big")
    return [
        serialize["protobuf"](late),
        unknown + good[5:],
        unknown + b"\xff" * 9 + b"\x01" + good[6:],
        good,
    ]


@pytest.mark.parametrize("where", ["threads", "processes"])
def test_protobuf_messages_whose_fate_depended_on_a_path_or_a_neighbour(
    http_registry: tuple[str, dict[str, ProcessDecoder]], where: str
) -> None:
    url, processes = http_registry
    values: list[bytes | None] = list(protobuf_examples(HTTP_SERIALIZERS))
    spec, source = registry_case("protobuf", url)
    decoders: list[Decode] = [Decoder(spec, source).decode]
    if where == "processes":
        decoders.append(processes["protobuf"].decode)
    out = Decoder(spec, source).decode([Msg(v, i) for i, v in enumerate(values)])
    assert [(d.offset, d.reason) for d in out.dead_letters] == [
        (0, "not_matching_schema"),
        (1, "unknown_schema_id"),
        (2, "unknown_schema_id"),
    ]
    assert "Timestamp is not valid" in out.dead_letters[0].detail
    check_fates(decoders, values + values, REGISTRY_BAD, [3], [0, 2])


@pytest.mark.parametrize("fmt", sorted(REGISTRY_VALUES))
def test_unknown_schema_guids_are_each_their_own(fmt: str) -> None:
    """Two values naming unknown schemas by GUIDs that share their first bytes (found by
    the long fuzz run: keyed by those, the second got the first's dead letter, its detail
    naming the first GUID)."""
    good = MOCK_SERIALIZERS[fmt](
        make_order(order_class(), 1)
        if fmt == "protobuf"
        else {"id": "a", "vec": [0.5] * DIM}
        | ({} if fmt == "json_schema" else dict.fromkeys(("n", "f", "g", "ok", "at", "b", "meta")))
    )
    values: list[bytes | None] = [
        b"\x01" + b"\x00\x00\x00\x03" + guid + good[5:] for guid in (b"\x02" * 12, b"\x07" * 12)
    ]
    spec, source = registry_case(fmt, REGISTRY["url"])
    decoder = Decoder(spec, source)
    out = decoder.decode([Msg(v, i) for i, v in enumerate(values)])
    assert [d.reason for d in out.dead_letters] == ["unknown_schema_id"] * 2
    assert ("02" * 12) in out.dead_letters[0].detail
    assert ("07" * 12) in out.dead_letters[1].detail
    check_fates([decoder.decode], values, REGISTRY_BAD, [], [0])


# -- Debezium change events (source.envelope = "debezium") ---------------------------

CDC_COLUMNS = [
    {"name": "id", "type": "int64", "nullable": False},
    {"name": "name", "type": "string"},
    {"name": "price", "type": "float64"},
    {"name": "price_text", "type": "string"},
    {"name": "added", "type": "timestamp"},
    {"name": "lsn", "type": "int64"},
    {"name": "op", "type": "string"},
]
CDC_SOURCE = SourceSettings(
    envelope="debezium",
    columns={"price_text": "$.after.label", "lsn": "$.source.lsn", "op": "$.op"},
)
CDC_FIELDS = [
    ("id", "int32", None, None),
    ("name", "string", None, None),
    ("price", "bytes", "org.apache.kafka.connect.data.Decimal", {"scale": "3"}),
    ("label", "bytes", "org.apache.kafka.connect.data.Decimal", {"scale": "0"}),
    ("added", "int32", "io.debezium.time.Date", None),
    ("vec", "array", "io.debezium.data.FloatVector", None),
]
CDC_SCHEMA = dbz.envelope_schema(CDC_FIELDS)


def cdc_table() -> TableSpec:
    raw: dict[str, Any] = {
        "uri": "/tmp/unused",
        "columns": CDC_COLUMNS,
        "mode": "upsert",
        "primary_key": ["id"],
        "vector": {"column": "vec", "dim": DIM},
    }
    return TableSpec.from_settings(TableSettings.model_validate(raw))


_NUMBERS = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from([0, -0.0, 1e39, 2**63, -(2**63) - 1]),
)
#: Vector components where the vector scan and orjson's double might part: any double,
#: doubles halfway between two float32 values (1 + 2^-24, 2^24 + 1, 2^-150: the scan
#: leaves them to orjson), and `_RAW_MARK`, which `cdc_message` swaps for one of `_RAW`.
_COMPONENTS = st.one_of(
    _NUMBERS,
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1 + 2**-24, -(1 + 3 * 2**-24), 2**24 + 1, 2**-150, 3 * 2**-150]),
)
_RAW_MARK = 1.2345678912345678e-123
_RAW_MARK_TEXT = repr(_RAW_MARK).encode()  # (as orjson writes it)
#: Number texts that no double writes: next to a float32 halfway point (the double is the
#: halfway point, the decimal is not), negative zeros, beyond the double range.
_RAW = [
    b"1.00000005960464477539062500001",
    b"1.0000000596046447753906249999",
    b"16777217.000000000000001",
    (
        b"7.006492321624085354618647916449580656401309709382578858785341419448955413429303"
        b"007433190941810607910156250001e-46"
    ),
    b"-0",
    b"-0.0",
    b"-0e0",
    b"-1e-400",
    b"1e-400",
    b"123456789012345678901234567890",
]


@st.composite
def cdc_image(draw: st.DrawFn) -> dict[str, Any]:
    """A row image in Debezium's representation, sometimes with fields of the wrong kind."""
    decimal_text = st.decimals(allow_nan=False, allow_infinity=False, places=3).map(str)
    image: dict[str, Any] = {
        "id": draw(
            st.one_of(
                st.integers(-5, 5), st.integers(0, 3), st.sampled_from([None, "7", 2**64, 1.5])
            )
        ),
        "name": draw(st.one_of(st.text(max_size=5), st.none(), st.integers(0, 3))),
        "price": draw(
            st.one_of(
                decimal_text.map(lambda d: dbz.decimal_b64(d, 3)),
                _NUMBERS,
                st.sampled_from(["not base64", None, "AA=="]),
            )
        ),
        "label": draw(
            st.one_of(
                st.integers(-(2**70), 2**70).map(lambda n: dbz.decimal_b64(str(n), 0)), st.none()
            )
        ),
        "added": draw(
            st.one_of(st.integers(-(10**6), 10**6), st.integers(-(2**31), 2**31 - 1), st.just("x"))
        ),
        "vec": draw(
            st.one_of(
                st.lists(_NUMBERS, min_size=DIM, max_size=DIM),
                st.lists(_COMPONENTS | st.just(_RAW_MARK), min_size=DIM, max_size=DIM),
                st.lists(st.floats(-10, 10, width=32), min_size=DIM, max_size=DIM),
                st.lists(st.floats(width=32), min_size=DIM - 1, max_size=DIM + 1),
                st.none(),
            )
        ),
    }
    drop = draw(st.lists(st.sampled_from(sorted(image)), max_size=1))
    return {k: v for k, v in image.items() if k not in drop}


@st.composite
def cdc_message(draw: st.DrawFn) -> tuple[bytes | None, bytes | None]:
    """A change event (any op, either converter shape, PostgreSQL or MySQL, maybe broken)
    or Debezium's tombstone, with a Kafka key of Debezium's shapes or none or garbage."""
    op = draw(st.sampled_from(["c", "r", "u", "u", "d", "d", "t", None, "x", 1]))
    after = draw(st.one_of(cdc_image(), cdc_image(), st.none())) if op != "d" else None
    before = draw(
        st.one_of(st.none(), cdc_image(), st.builds(lambda i: {"id": i}, st.integers(-5, 5)))
    )
    source = draw(
        st.sampled_from([dbz.pg_source(123456, 1_700_000_000_000), dbz.mysql_source(154, 1)])
    )
    # A schema block with the wrapper's separator inside (the cut must skip it).
    tricky = {**CDC_SCHEMA, "doc": ',"payload":{"op":"c"}}'}
    schema = draw(st.sampled_from([CDC_SCHEMA, CDC_SCHEMA, tricky, None]))
    key_id = draw(st.one_of(st.integers(-5, 5), st.just("k")))
    key = draw(
        st.sampled_from(
            [dbz.key(key_id), dbz.key(key_id, schemas=False), None, b"\xff", b"[1]", b"{}"]
        )
    )
    if draw(st.integers(0, 9)) == 0:
        return None, key
    value = dbz.value(dbz.envelope(op, before, after, source), schema)  # type: ignore[arg-type]
    value = value.replace(_RAW_MARK_TEXT, draw(st.sampled_from(_RAW)))
    return draw(st.one_of(st.just(value), mutated(value))), key


CDC_BAD: list[bytes | None] = [
    b"{not json",
    b"null",
    b'{"op": "c", "after": {"id": "x"}}',
    b'{"op": "c", "after": {"id": 1, "price": "zz", "vec": [1, 2, 3, 4]}}',
    b'{"op": "d", "before": null}',
    b'{"op": "q"}',
    None,
]


@pytest.fixture(scope="module")
def cdc_process() -> Iterator[ProcessDecoder]:
    decoder = ProcessDecoder(cdc_table(), CDC_SOURCE, schema_check="off", workers=2)
    yield decoder
    decoder.close()


@fuzz_settings(20)
@given(
    st.lists(cdc_message(), min_size=1, max_size=14),
    st.lists(st.integers(0, 200), max_size=4),
    st.lists(st.integers(0, 200), max_size=4),
)
def test_debezium_change_events(
    cdc_process: ProcessDecoder,
    pairs: list[tuple[bytes | None, bytes | None]],
    cuts: list[int],
    bad_at: list[int],
) -> None:
    # The first decoder parses every event whole (no vector scan): its lone decodes are
    # the fates the scanning decoders must give, alone and in any batch.
    decoders: list[Decode] = [
        Decoder(cdc_table(), CDC_SOURCE, vector_fast_path=False).decode,
        Decoder(cdc_table(), CDC_SOURCE).decode,
        Decoder(cdc_table(), CDC_SOURCE, scan_simd=False).decode,
        cdc_process.decode,
    ]
    values = [v for v, _ in pairs]
    keys = [k for _, k in pairs]
    check_fates(decoders, values, CDC_BAD, cuts, bad_at, keys)


#: The framing of the same change events in JSON Schema through the registry (Confluent's
#: converter: not validated, decimals as base64 text under "number", `sink.cdc`); the
#: document after it is written as `dbz.value` writes it (integers beyond 64 bits too).
CDC_JSON_SCHEMA = JSONSerializer(
    json.dumps(dbz.json_schema_of(CDC_SCHEMA)),
    build_client(SchemaRegistrySettings(**REGISTRY)),
    conf={"validate": False},
)({}, CONTEXT)[:5]


@st.composite
def cdc_json_schema_message(draw: st.DrawFn) -> tuple[bytes | None, bytes | None]:
    """`cdc_message`'s events and keys, the values framed in JSON Schema (maybe broken)."""
    op = draw(st.sampled_from(["c", "r", "u", "u", "d", "d", "t", None, "x", 1]))
    after = draw(st.one_of(cdc_image(), cdc_image(), st.none())) if op != "d" else None
    before = draw(
        st.one_of(st.none(), cdc_image(), st.builds(lambda i: {"id": i}, st.integers(-5, 5)))
    )
    key = draw(st.sampled_from([dbz.key(draw(st.integers(-5, 5)), schemas=False), None, b"{}"]))
    if draw(st.integers(0, 9)) == 0:
        return None, key
    event = dbz.envelope(op, before, after, dbz.pg_source(123456, 1_700_000_000_000))
    value = CDC_JSON_SCHEMA + dbz.value(event)
    return draw(st.one_of(st.just(value), mutated(value))), key


@fuzz_settings(20)
@given(
    st.lists(cdc_json_schema_message(), min_size=1, max_size=14),
    st.lists(st.integers(0, 200), max_size=4),
    st.lists(st.integers(0, 200), max_size=4),
)
def test_debezium_change_events_in_json_schema(
    pairs: list[tuple[bytes | None, bytes | None]], cuts: list[int], bad_at: list[int]
) -> None:
    source = CDC_SOURCE.model_copy(
        update={"format": "json_schema", "schema_registry": SchemaRegistrySettings(**REGISTRY)}
    )
    decoder = Decoder(cdc_table(), source)
    values = [v for v, _ in pairs]
    keys = [k for _, k in pairs]
    check_fates([decoder.decode], values, [*REGISTRY_BAD, *CDC_BAD], cuts, bad_at, keys)


#: The same change events in Protobuf through the registry (Confluent's ProtobufConverter:
#: confluent.type.Decimal, google.type.Date, ...; `tests.unit.test_decode_cdc`).
CDC_PROTO_ENVELOPE, _ = _proto_envelope()
CDC_PROTO = ProtobufSerializer(
    CDC_PROTO_ENVELOPE,
    build_client(SchemaRegistrySettings(**REGISTRY)),
    {"use.deprecated.format": False},
)
CDC_PROTO_SOURCE = SourceSettings(
    format="protobuf",
    envelope="debezium",
    schema_registry=SchemaRegistrySettings(**REGISTRY),
    columns={"vec": "$.after.embedding", "lsn": "$.source.lsn", "op": "$.op"},
)


#: Floats as Protobuf's JSON form takes them (NaN and the infinities quoted).
_proto_floats = st.floats(width=32).map(
    lambda f: (
        f if np.isfinite(f) else {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}[str(f)]
    )
)


@st.composite
def cdc_proto_image(draw: st.DrawFn) -> dict[str, Any]:
    """A row image as Protobuf's JSON form writes it (fields left out: unset)."""
    size = draw(st.sampled_from([DIM, DIM, DIM, DIM - 1, DIM + 1]))
    image: dict[str, Any] = {
        "id": draw(st.integers(-5, 5)),
        "name": draw(st.text(max_size=5)),
        "price": draw(
            st.decimals(
                allow_nan=False, allow_infinity=False, places=2, min_value=-1e6, max_value=1e6
            ).map(lambda d: _proto_decimal(str(d)))
        ),
        "added": draw(
            st.sampled_from(
                [
                    {"year": 1969, "month": 12, "day": 31},
                    {"year": 2024, "month": 2, "day": 29},
                    {"year": 0, "month": 1, "day": 1},
                ]
            )
        ),
        "updated": draw(st.sampled_from(["1969-12-31T23:59:59.999Z", "2024-03-01T12:00:00Z"])),
        "embedding": draw(st.lists(_proto_floats, min_size=size, max_size=size)),
    }
    drop = draw(st.lists(st.sampled_from(sorted(image)), max_size=2))
    return {k: v for k, v in image.items() if k not in drop}


@st.composite
def cdc_proto_message(draw: st.DrawFn) -> tuple[bytes | None, bytes | None]:
    """A change event in Protobuf (any op, maybe broken) or a tombstone, keyed as JSON."""
    from google.protobuf import json_format  # noqa: PLC0415

    op = draw(st.sampled_from(["c", "r", "u", "d", "d", "t", "", "x"]))
    event: dict[str, Any] = {"source": {"ts_ms": 1, "table": "t", "lsn": 7}, "op": op}
    if op != "d" and draw(st.booleans()):
        event["after"] = draw(cdc_proto_image())
    if draw(st.booleans()):
        event["before"] = {"id": draw(st.integers(-5, 5))}
    key = draw(st.sampled_from([dbz.key(draw(st.integers(-5, 5)), schemas=False), None, b"{}"]))
    if draw(st.integers(0, 9)) == 0:
        return None, key
    message = json_format.ParseDict(
        _no_nulls(event), CDC_PROTO_ENVELOPE(), ignore_unknown_fields=False
    )
    value = CDC_PROTO(message, CONTEXT)
    return draw(st.one_of(st.just(value), mutated(value))), key


@fuzz_settings(20)
@given(
    st.lists(cdc_proto_message(), min_size=1, max_size=14),
    st.lists(st.integers(0, 200), max_size=4),
    st.lists(st.integers(0, 200), max_size=4),
)
def test_debezium_change_events_in_protobuf(
    pairs: list[tuple[bytes | None, bytes | None]], cuts: list[int], bad_at: list[int]
) -> None:
    decoder = Decoder(cdc_table(), CDC_PROTO_SOURCE)
    values = [v for v, _ in pairs]
    keys = [k for _, k in pairs]
    check_fates([decoder.decode], values, [*REGISTRY_BAD, *CDC_BAD], cuts, bad_at, keys)


# -- the logical converters' shortcuts (sink.cdc.logical_converter) ----------------

_LOGICAL_RAW = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.binary(max_size=12).map(lambda b: base64.b64encode(b).decode()),
    st.text(max_size=8),
    st.dictionaries(st.sampled_from(["scale", "value"]), st.integers(-3, 30), max_size=2),
)


@fuzz_settings(300)
@given(
    schema_name=st.sampled_from(sorted(LOGICAL)),
    scale=st.one_of(st.integers(-3, 30).map(str), st.integers(-3, 30), st.just("x")),
    type_name=st.sampled_from(["timestamp", "float64", "float32", "string", "int64"]),
    raw=_LOGICAL_RAW,
)
def test_a_logical_converter_gives_what_the_general_path_gives(
    schema_name: str, scale: Any, type_name: str, raw: Any
) -> None:
    """`logical_converter`'s shortcuts (dates and times into timestamps, short Decimals
    into float64) end in the column's value or fault the general `logical_value` ends in."""
    params = {"scale": scale}
    fast = logical_converter(schema_name, params, type_name)(raw)
    slow = logical_value(schema_name, params, raw, type_name)
    assert convert(fast, type_name) == convert(slow, type_name)


@pytest.mark.parametrize("scale", [0, 2, 10, 22])
@fuzz_settings(100)
@given(unscaled=st.integers(-(2**53) + 1, 2**53 - 1))
def test_a_short_decimal_is_the_double_nearest_it(scale: int, unscaled: int) -> None:
    raw = base64.b64encode(
        unscaled.to_bytes(
            max(1, (unscaled + (unscaled < 0)).bit_length() // 8 + 1), "big", signed=True
        )
    ).decode()
    got = logical_converter(
        "org.apache.kafka.connect.data.Decimal", {"scale": str(scale)}, "float64"
    )(raw)
    assert type(got) is float
    assert got == float(decimal.Decimal(f"{unscaled}e{-scale}"))
