"""The vector fast paths (`sink.vector_scan`, then `sink.vector_json` for what the scan
leaves out) give the same rows (bit-exact) and dead letters as Arrow's reader alone
(`Decoder(vector_fast_path=False)`), on hand-picked edge cases and on generated messages;
and they do take the clean messages (else the comparison would prove nothing; the scan's
side: tests/unit/test_vector_scan.py). Base64 vectors (simdjson in small batches,
the scan in large ones): also rows and dead letters as Python's base64 and numpy make them.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config.settings import SourceSettings, TableSettings
from engine.schema import TableSpec
from sink import json_parse
from sink.decode import Decoded, Decoder
from sink.vector_json import VectorJson, float32_ties
from tests.unit.test_decode import Msg

DIM = 4
COLUMNS = [
    {"name": "id", "type": "string", "nullable": False},
    {"name": "n", "type": "int32"},
    {"name": "f", "type": "float32"},
    {"name": "g", "type": "float64"},
    {"name": "ok", "type": "bool"},
    {"name": "at", "type": "timestamp"},
    {"name": "b", "type": "binary"},
    {"name": "deep", "type": "float32"},
]
MAPPED = {"deep": "$.meta.score"}


def spec(encoding: str = "json", allow_nan: bool = False) -> TableSpec:
    raw: dict[str, Any] = {
        "uri": "/tmp/unused",
        "columns": COLUMNS,
        "vector": {"column": "vec", "dim": DIM, "allow_nan": allow_nan},
    }
    if encoding != "json":
        raw["vector"]["encoding"] = encoding
    return TableSpec.from_settings(TableSettings.model_validate(raw))


def source() -> SourceSettings:
    return SourceSettings(columns=MAPPED)


def _comparable(out: Decoded) -> tuple[dict[str, Any], list[tuple[int, str, str]]]:
    """Rows with every float as its bit pattern (so -0.0, NaN and rounding count), and the
    dead letters as (offset, reason, detail)."""
    columns: dict[str, Any] = {}
    if out.batch is not None:
        for name, arr in zip(out.batch.schema.names, out.batch.columns, strict=True):
            if pa.types.is_fixed_size_list(arr.type):
                columns[name] = arr.flatten().to_numpy().view(np.uint32).tolist()
            elif pa.types.is_floating(arr.type):
                nulls = arr.is_null().to_pylist()
                data = arr.fill_null(0).to_numpy()
                bits = data.view(np.uint32 if data.dtype == np.float32 else np.uint64)
                columns[name] = [None if z else int(b) for z, b in zip(nulls, bits, strict=True)]
            else:
                columns[name] = arr.to_pylist()
    dead = [(d.offset, d.reason, d.detail) for d in out.dead_letters]
    return columns, dead


def assert_same(values: list[bytes], encoding: str = "json", allow_nan: bool = False) -> Decoded:
    """Decode `values` both ways and check they agree exactly; returns the fast result."""
    messages = [Msg(v, 10 + i) for i, v in enumerate(values)]
    table = spec(encoding, allow_nan)
    fast = Decoder(table, source()).decode(messages)
    arrow = Decoder(table, source(), vector_fast_path=False).decode(messages)
    assert _comparable(fast) == _comparable(arrow)
    if fast.batch is not None:
        table.validate(fast.batch)
    return fast


def handed_back(values: list[bytes]) -> list[int]:
    """Positions the fast path leaves to Arrow."""
    leaves = [(("id",), "string"), (("vec",), "vector"), (("meta", "score"), "float32")]
    return VectorJson(leaves, DIM).parse(values)[2]


CLEAN = b'{"id": "a", "n": 3, "f": 1.5, "vec": [0.25, -1, 2e3, 3.5E-2], "meta": {"score": 2}}'

#: JSON values whose vector or float text is a hard case, each decoded both ways.
EDGE_VALUES = [
    # exponents, integers in float arrays, -0.0 and -0
    b'{"id": "x", "vec": [1e-3, 2.5E+2, -3e0, 1E10]}',
    b'{"id": "x", "vec": [-0.0, -0, 0, -0e0]}',
    b'{"id": "x", "vec": [-0, 1, 2, 3], "f": -0, "g": -0}',
    b'{"id": "x", "vec": [0, 1, 2, 3], "f": 0, "g": 0, "text": "-0"}',
    # a value Arrow's bulk read refuses (a nested array of mixed types) is screened, and
    # the screening reads the integer -0 as +0 where the bulk read gives -0.0
    b'{"id": "", "vec": [0.0, 0.0, 0.0, -0], "tags": [[1], "["], "id": ""}',
    b'{"id": "", "vec": [0.0, -0e0, 0.0, -0.0], "tags": [[1], "["]}',
    b'{"id": "x", "vec": [1, 16777217, 9007199254740993, 18446744073709551615]}',
    b'{"id": "x", "vec": [123456789012345678901234567890, 1, 2, 3]}',
    # denormals and the float32 subnormal boundary
    b'{"id": "x", "vec": [1e-45, 1.4e-45, 7e-46, 1e-40]}',
    b'{"id": "x", "vec": [7.006492321624085e-46, 1.1754942807573643e-38, -1e-39, 5e-324]}',
    # exactly halfway between float32 values, and either side of it
    b'{"id": "x", "vec": [1.000000059604644775390625, 1.0000000596046447753906251, 0, 0]}',
    b'{"id": "x", "vec": [1.0000000596046447753906249, 0, 0, 0], "f": 1.0000000596046447753906251}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "deep": 0, "meta": {"score": 1.000000059604644775390625}}',
    # float32 overflow, double overflow, NaN and infinities
    b'{"id": "x", "vec": [3.4028235677973366e38, 3.40282357e38, 1, 2]}',
    b'{"id": "x", "vec": [1e39, 1, 2, 3]}',
    b'{"id": "x", "vec": [1e400, 1, 2, 3]}',
    b'{"id": "x", "vec": [NaN, 1, 2, 3]}',
    b'{"id": "x", "vec": [1, Infinity, -Infinity, 3]}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "f": 1e39, "g": 1e308}',
    # integers beyond the double range (a second conversion in an error handler crashed)
    b'{"id": "x", "vec": [1%s, 1, 2, 3]}' % (b"0" * 400),
    b'{"id": "x", "vec": [1, -1%s, 2, 3]}' % (b"0" * 400),
    b'{"id": "x", "vec": [1, 2, 3, 4], "f": 1%s, "g": -1%s}' % (b"0" * 400, b"0" * 400),
    # whitespace, escaped keys, unicode
    b' {\n\t"id" : "x" ,\r\n "vec" : [ 1 , 2 ,\n3 , 4 ] } \n',
    b'{"\\u0069d": "x", "v\\u0065c": [1, 2, 3, 4]}',
    '{"id": "h\\u00e9llo \u2603 \U0001f600 \\ud83d\\ude00", "vec": [1, 2, 3, 4]}'.encode(),
    b'{"id": "a\\u0000b\\"\\\\\\/", "vec": [1, 2, 3, 4]}',
    b'{"id": "\\ud800", "vec": [1, 2, 3, 4]}',
    # nulls and missing fields
    b'{"id": null, "vec": [1, 2, 3, 4]}',
    b'{"vec": [1, 2, 3, 4]}',
    b'{"id": "x", "vec": null}',
    b'{"id": "x"}',
    b'{"id": "x", "vec": [1, null, 3, 4]}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "n": null, "f": null, "meta": null}',
    # wrong dimensions, nested and non-numbers
    b'{"id": "x", "vec": [1, 2, 3]}',
    b'{"id": "x", "vec": []}',
    b'{"id": "x", "vec": [[1], [2], [3], [4]]}',
    b'{"id": "x", "vec": [[1, 2], [3, 4]]}',
    b'{"id": "x", "vec": ["1", 2, 3, 4]}',
    b'{"id": "x", "vec": [true, 2, 3, 4]}',
    b'{"id": "x", "vec": [{}, 2, 3, 4]}',
    b'{"id": "x", "vec": "AAAA"}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "tags": [[1], ["[", "]"]]}',
    # wrong types of scalar columns, ranges
    b'{"id": 5, "vec": [1, 2, 3, 4]}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "n": 2147483648}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "n": 1.0}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "n": true}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "ok": 1}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "f": true}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "f": "1"}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "at": 1700000000000}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "at": "2024-02-29T12:34:56.789123+02:00"}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "at": "1969-12-31T23:59:59.9995"}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "at": "yesterday"}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "at": 9223372036854775808}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "b": "aGVsbG8="}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "b": "not base64!"}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "meta": 3}',
    b'{"id": "x", "vec": [1, 2, 3, 4], "meta": {"score": "high"}}',
    # duplicate keys (the last wins), byte order mark, not objects, not JSON
    b'{"id": "a", "id": "b", "vec": [1, 2, 3, 4]}',
    b'{"id": "a", "vec": [9, 9, 9, 9], "vec": [1, 2, 3, 4]}',
    b'{"id": "a", "vec": [1, 2, 3, 4], "meta": {"score": 1, "score": 2}}',
    b'\xef\xbb\xbf{"id": "x", "vec": [1, 2, 3, 4]}',
    b"[1, 2, 3, 4]",
    b"null",
    b"",
    b'{"id": "x", "vec": [1, 2, 3, 4]} {"id": "y"}',
    b'{"id": "x", "vec": [1, 2, 3, 4]',
    b'{"id": "\xff", "vec": [1, 2, 3, 4]}',
    b'{"id": "x\x01", "vec": [1, 2, 3, 4]}',
]


@pytest.mark.parametrize("value", EDGE_VALUES)
def test_edge_case_decodes_as_arrow_alone_does(value: bytes) -> None:
    """Each hard case, between two clean messages, gives the same rows and dead letters."""
    assert_same([CLEAN, value, CLEAN])


def test_all_edge_cases_in_one_batch() -> None:
    out = assert_same([CLEAN, *EDGE_VALUES, CLEAN])
    assert out.batch is not None
    assert len(out.batch) + len(out.dead_letters) == len(EDGE_VALUES) + 2


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("sign", ["", "-"])
def test_a_vector_component_beyond_the_double_range_is_a_nan_in_vector_dead_letter(
    fast: bool, sign: str
) -> None:
    """A 400-digit integer component used to raise OverflowError out of `decode` (the
    sink exited and crash-looped on the message): it is a `nan_in_vector` dead letter,
    alone and between good messages."""
    poison = b'{"id": "p", "vec": [0.5, %s1%s, 2, 3]}' % (sign.encode(), b"0" * 400)
    decoder = Decoder(spec(), source(), vector_fast_path=fast)
    for values in ([poison], [CLEAN, poison, CLEAN]):
        out = decoder.decode([Msg(v, 10 + i) for i, v in enumerate(values)])
        assert [(d.offset, d.reason) for d in out.dead_letters] == [
            (10 + values.index(poison), "nan_in_vector")
        ]
        shown = f"component 1 is {(sign + '1' + '0' * 11)[:12]}... (401 digits), beyond"
        assert shown in out.dead_letters[0].detail
        assert (out.batch.num_rows if out.batch is not None else 0) == len(values) - 1


def test_fast_path_takes_clean_messages_and_hands_back_the_doubtful() -> None:
    """Clean values stay on the fast path; each doubtful kind is handed back."""
    doubtful = [
        b'{"id": "x", "vec": [-0, 1, 2, 3]}',  # simdjson reads -0 as +0
        b'{"id": "x", "vec": [1.0000000596046447753906251, 0, 0, 0]}',  # a float32 tie
        b'{"id": "x", "vec": [[1], [2], [3], [4]]}',  # flattened by simdjson
        b'{"id": "a", "id": "b", "vec": [1, 2, 3, 4]}',  # simdjson reads the first
        b'\xef\xbb\xbf{"id": "x", "vec": [1, 2, 3, 4]}',  # simdjson skips the BOM
        b'{"id": "x", "vec": [NaN, 1, 2, 3]}',
    ]
    clean = [
        CLEAN,
        b'{"id": "x", "vec": [0, 1, 2, 3], "text": "-0.5"}',  # +0: checked, not -0
        b'{"id": "x", "vec": [1, 2, 3, 4], "tags": [1, [2]]}',  # nested, but not the vector
        b'{"id": "x", "vec": [1e39, 1, 2, 3]}',  # infinity in float32: a fault Arrow's way
    ]
    values = [*clean, *doubtful]
    assert handed_back(values) == list(range(len(clean), len(values)))


def test_fast_path_runs_on_several_threads_at_once() -> None:
    """The sink's decode workers share one decoder: each thread parses with its own simdjson
    parser, so none of them is pushed onto the Arrow path by the other's live document."""
    leaves = [(("id",), "string"), (("vec",), "vector"), (("meta", "score"), "float32")]
    fast = VectorJson(leaves, DIM)
    values = [CLEAN] * 20_000
    rest: dict[int, int] = {}
    start = threading.Barrier(2)

    def parse(k: int) -> None:
        start.wait()
        rest[k] = len(fast.parse(values)[2])

    threads = [threading.Thread(target=parse, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rest == {0: 0, 1: 0}


def test_float32_ties_finds_exact_halfway_doubles_only() -> None:
    one = np.float64(1.0)
    half_ulp = 2.0**-24
    tiny = 2.0**-150  # halfway between 0 and the smallest float32 subnormal
    values = np.array(
        [one + half_ulp, one + half_ulp / 2, one, 3 * tiny, 2 * tiny, 2.0**-126 - tiny, 0.0]
    )
    assert float32_ties(values).tolist() == [True, False, False, True, False, True, False]


# -- generated messages -------------------------------------------------------------


def number_text() -> st.SearchStrategy[str]:
    digits = st.text("0123456789", min_size=1, max_size=30)
    decimal = st.builds(
        lambda sign, whole, frac, exp: f"{sign}{whole.lstrip('0') or '0'}{frac}{exp}",
        st.sampled_from(["", "-"]),
        digits,
        st.one_of(st.just(""), digits.map(lambda d: "." + d)),
        st.one_of(
            st.just(""),
            st.builds(
                lambda e, s, n: f"{e}{s}{n}",
                st.sampled_from("eE"),
                st.sampled_from(["", "+", "-"]),
                st.integers(0, 400),
            ),
        ),
    )
    return st.one_of(
        st.floats(width=32, allow_nan=False, allow_infinity=False).map(
            lambda x: repr(float(np.float32(x)))
        ),
        st.floats(allow_nan=False, allow_infinity=False).map(repr),
        st.integers(-(2**70), 2**70).map(str),
        decimal,
        st.sampled_from(
            [
                "-0",
                "-0.0",
                "0",
                "1e-45",
                "7e-46",
                "1.4e-45",
                "3.4028235677973366e38",
                "3.4028236e38",
                "1e39",
                "1e400",
                "NaN",
                "Infinity",
                "-Infinity",
                "1.000000059604644775390625",
                "1.0000000596046447753906251",
                "16777217",
                "18446744073709551616",
            ]
        ),
    )


def _ws() -> st.SearchStrategy[str]:
    return st.sampled_from(["", "", " ", "\n", "\t ", "\r\n  "])


def _key(name: str) -> st.SearchStrategy[str]:
    escaped = "".join(f"\\u{ord(c):04x}" for c in name)
    return st.sampled_from([name, name, escaped, name[:-1] + f"\\u{ord(name[-1]):04x}"])


def _string_text() -> st.SearchStrategy[str]:
    return (
        st.text(max_size=8)
        .map(lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"')
        .filter(
            lambda s: (
                all(ord(c) >= 0x20 for c in s) and not any(0xD800 <= ord(c) < 0xE000 for c in s)
            )
        )
    )


@st.composite
def _vector_text(draw: st.DrawFn) -> str:
    size = draw(st.sampled_from([DIM] * 12 + [0, DIM - 1, DIM + 1]))
    items = [draw(number_text()) for _ in range(size)]
    if items and draw(st.integers(0, 19)) == 0:
        items[draw(st.integers(0, size - 1))] = draw(
            st.sampled_from(["null", '"1"', "[1]", "true"])
        )
    ws = draw(_ws())
    return "[" + ws + ("," + ws).join(items) + ws + "]"


def _scalar_text(kind: str) -> st.SearchStrategy[str]:
    wrong = st.sampled_from(["null", "true", '"7"', "1.5", "{}", "[]", "2147483648"])
    good: dict[str, st.SearchStrategy[str]] = {
        "string": _string_text(),
        "int32": st.integers(-(2**31), 2**31 - 1).map(str),
        "float": number_text(),
        "bool": st.sampled_from(["true", "false"]),
        "timestamp": st.one_of(
            st.integers(0, 2**45).map(str),
            st.sampled_from(['"2024-02-29T12:34:56.789123Z"', '"2024-01-01"', '"nope"']),
        ),
        "binary": st.binary(max_size=6).map(lambda b: '"' + base64.b64encode(b).decode() + '"'),
    }
    # Mostly good: a message with one fault goes to Arrow whole, so most of them must be
    # clean for the fast path's values to be compared.
    return st.integers(0, 14).flatmap(lambda k: wrong if k == 0 else good[kind])


FIELDS = {
    "id": "string", "n": "int32", "f": "float", "g": "float", "ok": "bool", "at": "timestamp",
    "b": "binary",
}  # fmt: skip


@st.composite
def json_message(draw: st.DrawFn) -> bytes:
    """A JSON object text of the table's fields (some missing, some wrong, some twice)."""
    parts: list[tuple[str, str]] = []
    for name, kind in FIELDS.items():
        if draw(st.integers(0, 9)) > 0:
            parts.append((draw(_key(name)), draw(_scalar_text(kind))))
    if draw(st.integers(0, 9)) > 0:
        parts.append((draw(_key("vec")), draw(_vector_text())))
    if draw(st.booleans()):
        score = draw(st.one_of(number_text(), st.just('"x"')))
        parts.append(("meta", draw(st.sampled_from(["{", "{ "])) + f'"score":{score}}}'))
    if draw(st.integers(0, 4)) == 0:
        parts.append(("tags", '[[1], "["]'))
    if parts and draw(st.integers(0, 14)) == 0:
        parts.append(draw(st.sampled_from(parts)))  # a duplicate key
    parts = draw(st.permutations(parts))
    ws = draw(_ws())
    body = ("," + ws).join(f'"{k}"{ws}:{ws}{v}' for k, v in parts)
    return (ws + "{" + ws + body + ws + "}" + ws).encode()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(json_message(), min_size=1, max_size=12))
def test_generated_messages_decode_as_arrow_alone_does(values: list[bytes]) -> None:
    assert_same(values)


@pytest.mark.slow
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(json_message(), min_size=1, max_size=12))
def test_many_generated_messages_decode_as_arrow_alone_does(values: list[bytes]) -> None:
    assert_same(values)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(json_message(), min_size=1, max_size=12))
def test_generated_messages_with_nan_allowed_decode_as_arrow_alone_does(
    values: list[bytes],
) -> None:
    assert_same(values, allow_nan=True)


# -- vector.encoding = "base64_f32" -------------------------------------------------


def b64(*floats: float, dtype: str = "<f4") -> str:
    return base64.b64encode(np.array(floats, dtype).tobytes()).decode()


@contextlib.contextmanager
def base64_route(scanned: bool) -> Iterator[None]:
    """Base64 vectors of every batch through the scan (`scanned`) or none."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(json_parse, "_SIMDJSON_BASE64_MAX", -1 if scanned else 1 << 30)
        yield


@pytest.mark.parametrize("scanned", [True, False], ids=["scan", "simdjson"])
def test_base64_f32_vectors_decode_bit_exact_with_specific_dead_letters(scanned: bool) -> None:
    vectors = np.array([[1.5, -0.0, 1e-45, 3.4028235e38], [0.1, 2, 3, 4]], np.float32)
    values = [
        f'{{"id": "a", "vec": "{base64.b64encode(vectors[0].tobytes()).decode()}"}}'.encode(),
        f'{{"id": "b", "vec": "{base64.b64encode(vectors[1].tobytes()).decode()}"}}'.encode(),
        f'{{"id": "c", "vec": "{b64(1, 2, 3)}"}}'.encode(),  # 12 bytes
        b'{"id": "d", "vec": "not base64!"}',
        f'{{"id": "e", "vec": "{b64(1, 2, float("nan"), 4)}"}}'.encode(),
        f'{{"id": "f", "vec": "{b64(1, float("-inf"), 3, 4)}"}}'.encode(),
        b'{"id": "g", "vec": [1, 2, 3, 4]}',
        b'{"id": "h", "vec": null}',
    ]
    with base64_route(scanned):
        out = assert_same(values, encoding="base64_f32")
    assert out.batch is not None
    got = out.batch.column("vec").flatten().to_numpy().view(np.uint32)
    assert got.tolist() == vectors.ravel().view(np.uint32).tolist()
    where = "vector 'vec' ($.vec)"
    assert [(d.offset, d.reason, d.detail) for d in out.dead_letters] == [
        (12, "wrong_vector_dimension", f"{where} has 12 bytes, expected 16 (4 float32)"),
        (13, "wrong_type", f"{where} is not base64"),
        (14, "nan_in_vector", f"{where} component 2 is NaN"),
        (15, "nan_in_vector", f"{where} component 1 is -Infinity"),
        (
            16,
            "wrong_type",
            "'vec' ($.vec) is an array, expected a base64 string of little-endian float32",
        ),
        (17, "missing_required", "'vec' ($.vec) is null or missing"),
    ]


def test_base64_f32_nan_allowed_keeps_the_row() -> None:
    value = f'{{"id": "a", "vec": "{b64(1, float("nan"), 3, 4)}"}}'.encode()
    out = assert_same([value], encoding="base64_f32", allow_nan=True)
    assert out.batch is not None
    assert not out.dead_letters
    assert np.isnan(out.batch.column("vec").flatten().to_numpy()[1])


def test_base64_f32_is_refused_outside_the_json_format() -> None:
    with pytest.raises(ValueError, match="json format only"):
        Decoder(spec("base64_f32"), SourceSettings(format="raw"))


@st.composite
def base64_message(draw: st.DrawFn) -> bytes:
    size = draw(st.sampled_from([DIM] * 8 + [0, DIM - 1, DIM + 1]))
    floats = draw(st.lists(st.floats(width=32), min_size=size, max_size=size))
    text = base64.b64encode(np.array(floats, "<f4").tobytes()).decode()
    odd = [
        '"@@"',
        "null",
        "[1, 2, 3, 4]",
        '"' + text[:-1] + '"',
        '"' + text.replace("/", "\\/") + '"',  # an escaped slash: the same text
        '"' + text.replace("+", "-") + '"',  # the URL-safe alphabet
        '"' + text[:4] + "\\n" + text[4:] + '"',  # a newline inside
        '"' + text[:4] + "\\u0041" + text[5:] + '"',  # an escaped letter
    ]
    vec = draw(st.sampled_from([f'"{text}"'] * 8 + odd))
    return f'{{"id": "x", "vec": {vec}}}'.encode()


def _base64_expected(value: bytes, allow_nan: bool) -> tuple[str, np.ndarray | None]:
    """What a generated base64 message decodes to, from Python's own base64 and numpy:
    ("row", its float32 vector) or (the dead letter's reason, None)."""
    vec = json.loads(value)["vec"]
    if vec is None:
        return "missing_required", None
    if not isinstance(vec, str):
        return "wrong_type", None
    try:
        data = binascii.a2b_base64(vec, strict_mode=True)
    except binascii.Error:
        return "wrong_type", None
    if len(data) != 4 * DIM:
        return "wrong_vector_dimension", None
    floats = np.frombuffer(data, "<f4")
    if not allow_nan and not np.isfinite(floats).all():
        return "nan_in_vector", None
    return "row", floats


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(base64_message(), min_size=1, max_size=12), st.booleans(), st.booleans())
def test_generated_base64_messages_decode_as_python_base64_does(
    values: list[bytes], allow_nan: bool, scanned: bool
) -> None:
    """Every generated message is a row holding the very float32 bits it carried, or a
    dead letter with the reason Python's base64 and numpy give; the scan or the simdjson
    path and Arrow's reader alone agree on them."""
    with base64_route(scanned):
        out = assert_same(values, encoding="base64_f32", allow_nan=allow_nan)
    expected = [_base64_expected(v, allow_nan) for v in values]
    rows = [vec.view(np.uint32).tolist() for kind, vec in expected if vec is not None]
    got = [] if out.batch is None else out.batch.column("vec").to_pylist()
    assert [np.array(v, np.float32).view(np.uint32).tolist() for v in got] == rows
    assert [(d.offset, d.reason) for d in out.dead_letters] == [
        (10 + i, kind) for i, (kind, _) in enumerate(expected) if kind != "row"
    ]


def test_base64_f32_decoded_in_one_call_and_per_value_agree() -> None:
    """dim 3 (12 bytes, no padding): a clean batch decodes in one call; one bad text among
    texts of the same length falls back to per value and faults only its row."""
    raw = {"uri": "/tmp/unused", "columns": [{"name": "id", "type": "string"}],
           "vector": {"column": "vec", "dim": 3, "encoding": "base64_f32"}}  # fmt: skip
    table = TableSpec.from_settings(TableSettings.model_validate(raw))
    vectors = np.array([[1.5, -0.0, 1e-45], [0.1, 2, 3], [4, 5, 6]], np.float32)
    texts = [base64.b64encode(v.tobytes()).decode() for v in vectors]
    clean = [Msg(f'{{"id": "{i}", "vec": "{t}"}}'.encode(), i) for i, t in enumerate(texts)]
    out = Decoder(table, SourceSettings()).decode(clean)
    assert out.batch is not None
    got = out.batch.column("vec").flatten().to_numpy().view(np.uint32)
    assert got.tolist() == vectors.ravel().view(np.uint32).tolist()
    bad = [*clean[:2], Msg(b'{"id": "2", "vec": "AAAA=AAAAAAAAAAA"}', 2)]
    out = Decoder(table, SourceSettings()).decode(bad)
    assert out.batch is not None
    assert out.batch.column("vec").flatten().to_numpy().view(np.uint32).tolist() == (
        vectors[:2].ravel().view(np.uint32).tolist()
    )
    assert [(d.offset, d.reason) for d in out.dead_letters] == [(2, "wrong_type")]
    # A padded last text of the same length (11 bytes) is a short vector, not a crash.
    short = base64.b64encode(b"\0" * 11).decode()
    assert len(short) == len(texts[0])
    padded = [*clean[:2], Msg(f'{{"id": "2", "vec": "{short}"}}'.encode(), 2)]
    for fast in (True, False):
        out = Decoder(table, SourceSettings(), vector_fast_path=fast).decode(padded)
        assert out.batch is not None
        assert len(out.batch) == 2
        assert [(d.offset, d.reason) for d in out.dead_letters] == [(2, "wrong_vector_dimension")]
