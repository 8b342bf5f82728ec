"""What a JSON value may hold, defined once for every decode path (docs/formats.md "What
a JSON value may hold"), and how a value at fault is named in a dead letter.

`loads` is the per-message paths' parser: Python's json taking exactly the non-standard
literals and long integers Arrow's reader (the bulk path) takes, so a message reads the
same whichever path its batch sends it down. `kind_problem` says what is wrong with a
parsed value for a column type; `show` and `described` quote values in details.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any, Final

import numpy as np
import pyarrow as pa

__all__ = [
    "EXPECTED",
    "INT_RANGES",
    "MAX_DEPTH",
    "RANGE_NAMES",
    "article",
    "described",
    "is_utf8",
    "is_utf8_buffer",
    "json_kind",
    "kind_problem",
    "loads",
    "quick_fits",
    "show",
    "utf8_error",
]

INT_RANGES: Final = {
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "timestamp": (-(2**63), 2**63 - 1),
}


def is_utf8_buffer(data: bytes) -> bool:
    """Whether `data` is UTF-8, checked by Arrow in place (SIMD, no copy)."""
    offsets = pa.py_buffer(np.array([0, len(data)], np.int64))
    arr = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), 1, [None, offsets, pa.py_buffer(data)]
    )
    try:
        arr.cast(pa.large_string())
    except pa.ArrowInvalid:
        return False
    return True


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def json_kind(item: Any) -> str:
    if item is None:
        return "null"
    if isinstance(item, bool):
        return "boolean"
    if isinstance(item, int | float):
        return "number"
    if isinstance(item, str):
        return "string"
    return "array" if isinstance(item, list) else "object"


EXPECTED: Final = {
    "string": "a string",
    "binary": "a base64 string",
    "int32": "an integer",
    "int64": "an integer",
    "float32": "a number",
    "float64": "a number",
    "bool": "true or false",
    "timestamp": "epoch milliseconds or an ISO-8601 string",
    "vector": "an array of numbers",
    "base64_f32": "a base64 string of little-endian float32",
}

_NUMBER_TYPES: Final = frozenset({int, float, type(None)})

#: The Python types (as JSON decoders make them) each column type accepts before conversion;
#: timestamps are range-checked as int64 like int64 columns.
_KIND_FITS: Final[dict[str, frozenset[type]]] = {
    "string": frozenset({str}),
    "binary": frozenset({str}),
    "int32": frozenset({int}),
    "int64": frozenset({int}),
    "float32": frozenset({int, float}),
    "float64": frozenset({int, float}),
    "bool": frozenset({bool}),
    "timestamp": frozenset({int, str}),
    "vector": frozenset({list}),
    "base64_f32": frozenset({str}),
}


def quick_fits(type_name: str) -> frozenset[type]:
    """The value types `kind_problem` passes for `type_name` without looking at the value
    (it range-checks ints of int and timestamp columns, and the components of vectors)."""
    fits = set(_KIND_FITS[type_name]) | {type(None)}
    if type_name in INT_RANGES:
        fits.discard(int)
    if type_name == "vector":
        fits.discard(list)
    return frozenset(fits)


def kind_problem(item: Any, type_name: str) -> str | None:
    """What is wrong with a JSON value for a column type, judged by its JSON kind alone.

    None when the kind fits (the value may still fail to convert, e.g. an ISO string).
    JSON decoders give exact built-in types, so the common case is one `type` test.
    """
    if item is None:
        return None
    kind = type(item)
    if kind in _KIND_FITS[type_name]:
        if kind is int and type_name in INT_RANGES:
            low, high = INT_RANGES[type_name]
            if not low <= item <= high:
                return f"is {show(item)}, outside the {RANGE_NAMES[type_name]} range"
        elif type_name == "vector" and not set(map(type, item)) <= _NUMBER_TYPES:
            first = next(i for i, x in enumerate(item) if type(x) not in _NUMBER_TYPES)
            return f"component {first} is {described(item[first])}, expected a number"
        return None
    return f"is {described(item)}, expected {EXPECTED[type_name]}"


#: How a dead-letter detail names an integer column's range.
RANGE_NAMES: Final = {"int32": "int32", "int64": "int64", "timestamp": "int64 milliseconds"}

#: Longest text of a value quoted in a dead-letter detail.
_SHOW_CHARS: Final = 40


def article(kind: str) -> str:
    """A JSON kind with its article: 'an object', 'an array', 'a string', 'null'."""
    if kind == "null":
        return kind
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def show(item: Any) -> str:
    """A JSON or key value as quoted in a dead-letter detail (long ones cut)."""
    if isinstance(item, float):
        text = "NaN" if math.isnan(item) else repr(item).replace("inf", "Infinity")
    elif isinstance(item, int):
        text = (
            str(item)
            if abs(item) < 10**_SHOW_CHARS
            else f"{str(item)[:12]}... ({len(str(abs(item)))} digits)"
        )
    else:
        text = repr(item)
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 3] + "..."


def described(item: Any) -> str:
    """A JSON value that does not fit, for a dead-letter detail: a number or string as itself
    ("1.5", "NaN", "a string ('7')"), anything else by its kind ("an object")."""
    if isinstance(item, float):
        return show(item)
    if isinstance(item, str):
        return f"a string ({show(item)})"
    return article(json_kind(item))


def utf8_error(data: bytes) -> str:
    """Where `data` stops being UTF-8, as a suffix for a dead-letter detail."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f" (byte 0x{data[exc.start]:02x} at offset {exc.start})"
    return ""


#: The non-standard number literals Arrow's reader (rapidjson's) takes where a number may
#: stand, each with what it reads as: Python's json takes only NaN, Infinity and -Infinity.
_LITERALS: Final = {
    b"NaN": b"NaN",
    b"-NaN": b"NaN",  # no sign: Arrow's reader reads it as the NaN it reads for NaN
    b"Inf": b"Infinity",
    b"-Inf": b"-Infinity",
    b"Infinity": b"Infinity",
    b"-Infinity": b"-Infinity",
}

#: A JSON string (left as it is) or one of `_LITERALS` outside strings.
_LITERAL_RE: Final = re.compile(rb'"(?:[^"\\]|\\.)*"|-?(?:NaN|Inf(?:inity)?)')


def loads(payload: bytes) -> Any:
    """A JSON value parsed by Python's json, taking the same non-standard number literals
    as Arrow's reader (`_LITERALS`), so that a value reads the same on the bulk path and
    on the per-message paths whatever its neighbours (docs/formats.md).

    Raises:
        ValueError: not JSON (json's own error, for the value as sent).
        RecursionError: nested deeper than `MAX_DEPTH`.
    """
    if payload.count(b"[") + payload.count(b"{") > MAX_DEPTH and _depth(payload) > MAX_DEPTH:
        raise RecursionError(f"nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(payload)
    except ValueError:
        rewritten = payload
        if b"NaN" in payload or b"Inf" in payload:
            rewritten = _LITERAL_RE.sub(lambda m: _LITERALS.get(m.group(), m.group()), payload)
        try:
            return json.loads(rewritten, parse_int=_parse_int)
        except ValueError:
            pass
        raise


#: Deepest nesting `loads` reads. Python's parser is recursive, so how deep it can go
#: depends on how deep the caller's stack already is (a decode thread's, a test's): a
#: fixed limit well inside the interpreter's (1,000 frames) makes the outcome the
#: message's own. Deeper values are decided by Arrow's reader alone (`sink.decode`).
MAX_DEPTH: Final = 512
#: A JSON string, escapes included (its brackets are not nesting).
_STRING_RE: Final = re.compile(rb'"(?:[^"\\]|\\.)*"')


_OPENS: Final = np.frombuffer(b"[{", np.uint8)
_CLOSES: Final = np.frombuffer(b"]}", np.uint8)


def _depth(payload: bytes) -> int:
    """How deep arrays and objects nest in `payload` (outside its strings)."""
    data = np.frombuffer(_STRING_RE.sub(b'""', payload), np.uint8)
    steps = np.isin(data, _OPENS).astype(np.int32) - np.isin(data, _CLOSES)
    return int(np.cumsum(steps).max(initial=0))


def _parse_int(text: str) -> int | float:
    """A JSON integer; one longer than Python reads (``sys.get_int_max_str_digits``, a
    guard against quadratic conversions) as the signed infinity, as Arrow's reader reads it
    where a number may be a float (an integer column refuses it either way)."""
    limit = sys.get_int_max_str_digits()
    if limit and len(text) - text.startswith("-") > limit:
        return -math.inf if text.startswith("-") else math.inf
    return int(text)
