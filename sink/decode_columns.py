"""The decoder's column checks: the rows of one batch under decoding (`Rows`: each row's
message index, its columns, and the first fault of each message), the batch's Kafka
metadata and byte sources as full-length arrays (`Metadata`), and the coercions and checks
that bring one column into its canonical type (`sink.decode_plan.CANONICAL`), faulting the
rows that cannot hold their value: bytes into binary, string or integer columns, base64
text, float32 overflow, vectors (length, nulls, NaN and infinities, base64 float32).

The functions hold no state: `sink.decode.Decoder` calls them per column of each batch,
from its decode threads, with what its table settles (the vector's dimension, whether NaN
is allowed, the vector encoding). A detail names the column and its source as the user
wrote it (`sink.decode_plan.ColumnPlan.where`).
"""

from __future__ import annotations

import binascii
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pybase64

from sink.decode_plan import ColumnPlan, Fault, Path
from sink.decoded import TIMESTAMP_NOT_AVAILABLE, MessageLike
from sink.formats.keys import KeyDecoder
from sink.formats.records import FLOAT32_MAX, float32_beyond, to_float
from sink.json_values import INT_RANGES, RANGE_NAMES, is_utf8, loads, show, utf8_error

__all__ = [
    "Metadata",
    "Rows",
    "bytes_to",
    "check_float32",
    "check_vectors",
    "from_base64",
    "from_base64_f32",
]

_DECIMAL_RE: Final = r"^-?[0-9]+$"


@dataclass(slots=True)
class Rows:
    """Rows under decoding: message index per row, columns, and faults by message index."""

    index: np.ndarray
    columns: dict[str, pa.Array] = field(default_factory=dict)
    faults: dict[int, Fault] = field(default_factory=dict)

    def fault(self, positions: Iterable[int] | np.ndarray, fault: Fault) -> None:
        """Record `fault` for rows at `positions` that have none yet (first fault wins)."""
        for pos in positions:
            self.faults.setdefault(int(self.index[int(pos)]), fault)


class Metadata:
    """Kafka metadata of a whole batch as full-length Arrow arrays, built on first use."""

    def __init__(
        self,
        messages: Sequence[MessageLike],
        offsets: np.ndarray,
        values: list[bytes | None],
        topic: str,
        partition: int,
    ) -> None:
        self._messages = messages
        self.offsets = offsets
        self._values = values
        self._topic = topic
        self._partition = partition
        self._cache: dict[tuple[str, ...], pa.Array] = {}
        self._keys: tuple[list[Any], dict[int, tuple[str, str]]] | None = None

    def value(self, i: int) -> bytes | None:
        """The payload of message `i`."""
        return self._values[i]

    def decoded_keys(self, keys: KeyDecoder) -> tuple[list[Any], dict[int, tuple[str, str]]]:
        """The keys of all messages decoded once (source.key_format), and their faults by
        message index (a copy: callers add to it)."""
        if self._keys is None:
            self._keys = keys.decode([m.key() for m in self._messages])
        records, faults = self._keys
        return records, dict(faults)

    def bytes_source(self, path: Path) -> pa.Array:
        """@key, @value or @headers.NAME as a binary array over all messages."""
        if path not in self._cache:
            if path == ("@key",):
                data: list[bytes | None] = [m.key() for m in self._messages]
            elif path == ("@value",):
                data = self._values
            else:
                data = [_last_header(m.headers(), path[1]) for m in self._messages]
            self._cache[path] = pa.array(data, pa.binary())
        return self._cache[path]

    def metadata(self, kind: str, arrow_type: pa.DataType) -> pa.Array:
        """@topic, @partition, @offset or @timestamp as an array over all messages."""
        key = (kind, str(arrow_type))
        if key not in self._cache:
            n = len(self._messages)
            arr: pa.Array
            if kind == "topic":
                arr = _constant_string(self._topic, n)
            elif kind == "partition":
                arr = pa.array(np.full(n, self._partition, np.int64)).cast(arrow_type)
            elif kind == "offset":
                arr = pa.array(self.offsets)
            else:
                stamps = [m.timestamp() for m in self._messages]
                arr = pa.array(
                    [ms if kind_ != TIMESTAMP_NOT_AVAILABLE else None for kind_, ms in stamps],
                    pa.int64(),
                ).cast(arrow_type)
            self._cache[key] = arr
        return self._cache[key]


def bytes_to(arr: pa.Array, col: ColumnPlan, rows: Rows) -> pa.Array:
    """Bytes (key, header, payload) into a binary, string or integer column."""
    if col.type_name == "binary":
        return arr
    try:
        text = arr.cast(pa.string())
    except pa.ArrowInvalid:
        values = arr.to_pylist()
        ok = [v is None or is_utf8(v) for v in values]
        for pos in (i for i, good in enumerate(ok) if not good):
            what = f"{col.name!r} ({col.where}) is not UTF-8{utf8_error(values[pos])}"
            rows.fault((pos,), ("invalid_utf8", what))
        text = pc.if_else(pa.array(ok), arr, pa.scalar(None, pa.binary())).cast(pa.string())
    if col.type_name == "string":
        return text
    decimal = pc.fill_null(pc.match_substring_regex(text, _DECIMAL_RE), True)
    if decimal.false_count:
        for pos in np.flatnonzero(~decimal.to_numpy(zero_copy_only=False)).tolist():
            shown = show(text[pos].as_py())
            what = f"{col.name!r} ({col.where}) is {shown}, not a decimal integer"
            rows.fault((pos,), ("wrong_type", what))
        text = pc.if_else(decimal, text, pa.scalar(None, pa.string()))
    try:
        return text.cast(col.arrow_type)
    except pa.ArrowInvalid:
        low, high = INT_RANGES[col.type_name]
        ints: list[int | None] = []
        for pos, item in enumerate(text.to_pylist()):
            number = None if item is None else int(item)
            if number is not None and not low <= number <= high:
                range_name = RANGE_NAMES[col.type_name]
                what = (
                    f"{col.name!r} ({col.where}) is {show(number)}, outside the {range_name} range"
                )
                rows.fault((pos,), ("wrong_type", what))
                number = None
            ints.append(number)
        return pa.array(ints, col.arrow_type)


def from_base64(arr: pa.Array, col: ColumnPlan, rows: Rows) -> pa.Array:
    """Decode a column of base64 text (per value: Arrow has no base64 kernel)."""
    out: list[bytes | None] = []
    for pos, text in enumerate(arr.to_pylist()):
        if text is None:
            out.append(None)
            continue
        try:
            out.append(binascii.a2b_base64(text, strict_mode=True))
        except (binascii.Error, ValueError):
            rows.fault((pos,), ("wrong_type", f"{col.name!r} ({col.where}) is not base64"))
            out.append(None)
    return pa.array(out, pa.binary())


def check_float32(arr: pa.Array, col: ColumnPlan, rows: Rows, meta: Metadata) -> None:
    """Fault the rows of a float32 JSON column whose number overflowed to infinity: their
    payloads are read again to tell an overflow from an infinity in the JSON (only rows
    holding an infinity pay for it)."""
    infinite = np.isinf(arr.to_numpy(zero_copy_only=False))
    for pos in np.flatnonzero(infinite).tolist():
        try:
            item: Any = loads(meta.value(int(rows.index[pos])) or b"")
            for name in col.path:
                item = item[name]
        except (ValueError, KeyError, TypeError, RecursionError):
            continue  # not reached: the payload parsed before
        beyond = float32_beyond(item, show)
        if beyond is not None:
            rows.fault((pos,), ("wrong_type", f"{col.name!r} ({col.where}) {beyond}"))


def check_vectors(
    arr: pa.Array,
    col: ColumnPlan,
    rows: Rows,
    meta: Metadata,
    *,
    dim: int,
    allow_nan: bool,
    base64: bool,
) -> None:
    """Fault rows whose vector has the wrong length, a null, or (unless allowed) NaN/inf.

    A component is non-finite in the float32 column when the JSON has NaN or an infinity
    or a number beyond the float32 range; the faulted rows' payloads are read again to
    say which component and which of these (only bad rows pay for it)."""
    lengths = pc.fill_null(pc.list_value_length(arr), dim).to_numpy()
    for pos in np.flatnonzero(lengths != dim).tolist():
        got = int(lengths[pos])
        what = f"vector {col.name!r} ({col.where}) has {got} components, expected {dim}"
        rows.fault((pos,), ("wrong_vector_dimension", what))
    flat = pc.list_flatten(arr)
    if not len(flat):
        return
    if flat.null_count:
        nulls = flat.is_null().to_numpy(zero_copy_only=False)
        for pos, first in _first_in_row(nulls, arr):
            what = f"vector {col.name!r} ({col.where}) component {first} is null"
            rows.fault((pos,), ("wrong_type", what))
        flat = pc.fill_null(flat, 0.0)
    if allow_nan:
        return
    finite = np.isfinite(flat.to_numpy())
    if not finite.all():
        values = flat.to_numpy()
        starts = pc.list_parent_indices(arr).to_numpy()
        for pos, first in _first_in_row(~finite, arr):
            if base64:
                number = float(values[int(np.searchsorted(starts, pos)) + first])
                what = f"vector {col.name!r} ({col.where}) component {first} is {show(number)}"
            else:
                what = _non_finite(col, first, meta.value(int(rows.index[pos])))
            rows.fault((pos,), ("nan_in_vector", what))


def from_base64_f32(arr: pa.Array, col: ColumnPlan, rows: Rows, dim: int) -> pa.Array:
    """Base64 text of little-endian float32 as ``list<float32>`` (null where the text is
    null or faulted: not base64, or not 4 * dim bytes)."""
    expected = 4 * dim
    head = f"vector {col.name!r} ({col.where})"
    whole = _base64_in_one(arr, expected)
    # The column views the decoded bytes (little-endian float32 is the native layout
    # here): a copy into fresh pages held the batch twice (sink peak RSS 826 against
    # 749 MiB, bench/results/e2e.txt).
    if whole is not None:
        values = pa.array(np.frombuffer(whole, "<f4").astype(np.float32, copy=False))
        offsets = np.arange(0, (len(arr) + 1) * dim, dim, dtype=np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), values)
    chunks: list[bytes] = []
    valid = np.zeros(len(arr), bool)
    for pos, text in enumerate(arr.to_pylist()):
        if text is None:
            continue
        try:
            data = binascii.a2b_base64(text, strict_mode=True)
        except (binascii.Error, ValueError):
            rows.fault((pos,), ("wrong_type", f"{head} is not base64"))
            continue
        if len(data) != expected:
            what = f"{head} has {len(data)} bytes, expected {expected} ({dim} float32)"
            rows.fault((pos,), ("wrong_vector_dimension", what))
            continue
        chunks.append(data)
        valid[pos] = True
    values = pa.array(np.frombuffer(b"".join(chunks), "<f4").astype(np.float32, copy=False))
    offsets = np.zeros(len(arr) + 1, np.int32)
    offsets[1:] = np.cumsum(valid * dim)
    mask = None if valid.all() else pa.array(~valid)
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=mask)


def _last_header(headers: Sequence[tuple[str, bytes | None]] | None, name: str) -> bytes | None:
    found = None
    for key, value in headers or ():
        if key == name:
            found = value
    return found


def _constant_string(value: str, n: int) -> pa.Array:
    """A string array of `n` times `value`, built from buffers (no per-row Python)."""
    data = value.encode()
    offsets = np.arange(0, (n + 1) * len(data), len(data) or 1, dtype=np.int64)[: n + 1]
    if not data:
        offsets = np.zeros(n + 1, np.int64)
    return pa.LargeStringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data * n)).cast(
        pa.string()
    )


def _base64_in_one(arr: pa.Array, expected: int) -> bytes | None:
    """All of `arr`'s base64 texts decoded with one call, when none is null, each is as
    long as `expected` bytes encode to and none needs padding (so their concatenation is
    base64 exactly when each is); None when that does not hold or some text is bad."""
    if arr.null_count or not len(arr) or expected % 3:
        return None
    offsets = np.frombuffer(arr.buffers()[1], np.int32)[arr.offset : arr.offset + len(arr) + 1]
    if not (np.diff(offsets) == expected // 3 * 4).all():
        return None
    text = memoryview(arr.buffers()[2])[int(offsets[0]) : int(offsets[-1])]
    try:
        # SIMD base64 (~7x binascii's speed); for text of whole 4-character groups it
        # accepts exactly what binascii's strict mode accepts, and a padded last value
        # (which strict mode takes on its own) shows in the length.
        data = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return data if len(data) == expected * len(arr) else None


def _first_in_row(bad: np.ndarray, lists: pa.Array) -> list[tuple[int, int]]:
    """For each list of `lists` that has a `bad` element (`bad`: one flag per element of
    the flattened lists): its position and the index of its first bad element in it."""
    parents = pc.list_parent_indices(lists).to_numpy()  # ascending
    where = np.flatnonzero(bad)
    rows, first = np.unique(parents[where], return_index=True)
    components = where[first] - np.searchsorted(parents, rows, side="left")
    return list(zip(rows.tolist(), components.tolist(), strict=True))


def _non_finite(col: ColumnPlan, component: int, payload: bytes | None) -> str:
    """Why component `component` of the vector in `payload` is not a finite float32."""
    head = f"vector {col.name!r} ({col.where}) component {component}"
    try:
        item: Any = loads(payload or b"")
        for name in col.path:
            item = item[name]
        number = item[component]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
        return f"{head} is NaN or infinite"  # not reached: the payload parsed before
    value = to_float(number)
    if math.isnan(value):
        return f"{head} is NaN"
    if math.isinf(value) and isinstance(number, float):
        return f"{head} is {show(number)} (infinite in the JSON or beyond the double range)"
    return (
        f"{head} is {show(number)}, beyond the float32 range (largest "
        f"{FLOAT32_MAX:.7g}); it would be stored as infinity"
    )
