"""The vector fast path of the JSON format: simdjson straight into one float32 matrix.

`sink.decode.Decoder` hands `VectorJson.parse` the JSON values of a batch when its table
has a vector column (base64 vectors: only small batches, see `sink.decode`). Each value is
parsed with simdjson (pysimdjson's DOM), the vector's numbers are copied by simdjson into a
buffer of doubles (``Array.as_buffer``: no Python float per component), the buffers of the
whole batch are joined once and cast to float32 in one numpy call, and the scalar leaves
are read as Python values and built into Arrow arrays one column at a time. Arrow's JSON
reader converts numbers one by one and was the sink's bottleneck on vectors
(bench/results/decode.txt); on small messages without vectors it is faster than this path,
so the decoder uses this path only for vector tables.

The contract is identity with Arrow's path: every value this path accepts gives the very
leaves Arrow's reader gives (bit-exact float32 included), and every value it is not sure
of is handed back to the Arrow path (``rest``), which then names the fault or decodes it
exactly as before. A value is handed back when:

- simdjson refuses it (invalid JSON or UTF-8, NaN/Infinity literals, numbers beyond the
  double range, integers beyond 64 bits, lone surrogate escapes), it starts with a byte
  order mark (simdjson skips one, Arrow refuses it), or it is not an object;
- an object on a mapped path has a duplicate key (simdjson reads the first, the Arrow
  path the last), or a mapped path runs through something that is not an object;
- a leaf has a JSON kind its column does not take (null aside), an integer is out of its
  column's range, or a timestamp string does not parse;
- the vector is not an array of exactly ``dim`` numbers (null, missing, another length,
  nested arrays, non-numbers);
- a float32 value (vector component or float32 column) would round differently: Arrow
  parses the decimal text straight to float32; this path parses to the nearest double
  and casts. The two agree unless the double lies exactly halfway between two float32
  values (the only case where rounding twice can differ from rounding once), so such
  values go back;
- a component or float value reads as +0.0 and the text has ``-0``: simdjson reads the
  integer ``-0`` as 0, Arrow as -0.0.

Identity with the Arrow path is proven by a property test over generated messages
(tests/unit/test_decode_vector_json.py), edge cases included.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import simdjson

__all__ = ["VectorJson", "float32_ties"]

_Path = tuple[str, ...]

_BOM: Final = b"\xef\xbb\xbf"
#: Vectors cast to float32 at a time: their doubles (~0.8 MiB at dim 384) stay in cache
#: for the checks, and the joined buffer is reused from the heap.
_FLUSH_ROWS: Final = 256
#: The integer -0 (simdjson reads it as 0); also matches harmless texts such as ``1e-0``,
#: which only sends a value back to the Arrow path.
_NEG_ZERO: Final = re.compile(rb"-0(?![.0-9eE])")
#: Errors pysimdjson raises for a document it refuses or an element of another type.
_SIMDJSON_ERRORS: Final = (ValueError, RuntimeError, TypeError, KeyError, IndexError)

#: Python types each leaf kind takes from simdjson (None, i.e. null or missing, always).
_FITS: Final[dict[str, tuple[type, ...]]] = {
    "string": (str,),
    "binary": (str,),
    "base64_f32": (str,),
    "int32": (int,),
    "int64": (int,),
    "timestamp": (int, str),
    "float32": (int, float),
    "float64": (int, float),
    "bool": (bool,),
}
_INT_RANGES: Final = {
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "timestamp": (-(2**63), 2**63 - 1),
}
_TS_TYPE: Final = pa.timestamp("ms", tz="UTC")
_TS_PARSE_TYPE: Final = pa.timestamp("us", tz="UTC")
#: Doubles below this magnitude are in float32's subnormal range (or zero).
_TINY_BITS: Final = np.uint64((1023 - 126) << 52)
_EXP_MASK: Final = np.uint64(0x7FF0000000000000)
#: Of a double in float32's normal range: the 29 mantissa bits float32 drops, and their
#: value when the double lies exactly halfway between two float32 values.
_LOW_MASK: Final = np.uint64((1 << 29) - 1)
_HALF: Final = np.uint64(1 << 28)


def float32_ties(values: np.ndarray) -> np.ndarray:
    """Which float64 `values` lie exactly halfway between two adjacent float32 values.

    Casting such a double to float32 (ties to even) may differ from rounding the decimal
    text it came from straight to float32; any other double casts to the same float32 as
    the text, since every halfway point is itself a double.
    """
    bits = values.view(np.uint64)
    ties = (bits & _LOW_MASK) == _HALF
    tiny = (bits & _EXP_MASK) < _TINY_BITS
    if tiny.any():
        # float32 subnormals are multiples of 2**-149: halfway points are odd multiples
        # of 2**-150 (scaling by a power of two is exact).
        scaled = np.abs(values[tiny]) * 2.0**150
        ties[tiny] = (scaled % 2.0) == 1.0
    return np.asarray(ties, bool)


@dataclass(frozen=True, slots=True)
class _Leaf:
    path: _Path
    kind: str  # a column type name, or "base64_f32" for a base64 vector


class VectorJson:
    """Parse JSON values of a vector table with simdjson; see the module docstring.

    Stateless apart from its simdjson parsers: one per thread (a parser is reused for each
    value and refuses a new value while proxies of the last one live, so a parser shared
    by the sink's decode workers sent one worker's values to the Arrow path), so `parse`
    may run on several threads at once.

    Args:
        leaves: every mapped JSON path with its kind (a column type name; ``vector`` for
            the vector as a JSON array, ``base64_f32`` for it as a base64 string).
        dim: the vector's dimension.
    """

    def __init__(self, leaves: Sequence[tuple[_Path, str]], dim: int) -> None:
        self._local = threading.local()
        self._dim = dim
        vectors = [p for p, kind in leaves if kind == "vector"]
        self._vector: _Path | None = vectors[0] if vectors else None
        self._scalars = [_Leaf(p, kind) for p, kind in leaves if kind != "vector"]
        self._fits = [_FITS[leaf.kind] for leaf in self._scalars]
        # Objects on the way to a leaf (the root included), parents before children.
        prefixes = {p[:i] for p, _ in leaves for i in range(len(p))}
        self._prefixes = sorted(prefixes, key=len)
        self._flat = self._prefixes == [()]

    def parse(
        self, payloads: Sequence[bytes]
    ) -> tuple[np.ndarray, dict[_Path, pa.Array], list[int]]:
        """Parse `payloads`.

        Returns:
            The positions (ascending) of the payloads parsed here, their leaves in the
            decoder's canonical types (vectors as ``list<float32>``, base64 vectors and
            binary columns as their text), and the positions of those left for Arrow.
        """
        dim = self._dim
        nbytes = dim * 8
        vector = self._vector
        scalars = self._scalars
        fits = self._fits
        parser = getattr(self._local, "parser", None)
        if parser is None:
            parser = self._local.parser = simdjson.Parser()
        parse = parser.parse
        array_type = simdjson.Array
        object_type = simdjson.Object
        good: list[int] = []
        rest: list[int] = []
        buffers: list[Any] = []
        columns: list[list[Any]] = [[] for _ in scalars]
        matrix = np.empty((len(payloads), dim if vector is not None else 0), np.float32)
        handback: list[int] = []  # indices into `good` of rows to hand back to Arrow
        for pos, payload in enumerate(payloads):
            doc: Any = None
            vec: Any = None
            parent: Any = None
            value: Any = None
            objects: dict[_Path, Any] | None = None
            try:
                doc = parse(payload)
                if type(doc) is not object_type or payload.startswith(_BOM):
                    rest.append(pos)
                    continue
                objects = self._objects(doc)
                if objects is None:
                    rest.append(pos)
                    continue
                row = []
                for leaf, types in zip(scalars, fits, strict=True):
                    parent = objects.get(leaf.path[:-1])
                    value = None if parent is None else parent.get(leaf.path[-1])
                    if value is not None and type(value) not in types:
                        break
                    row.append(value)
                else:
                    if vector is not None:
                        parent = objects.get(vector[:-1])
                        vec = None if parent is None else parent.get(vector[-1])
                        if type(vec) is not array_type or len(vec) != dim:
                            rest.append(pos)
                            continue
                        # (pysimdjson's stubs say bytes; the buffer object has `size`, and
                        # `mini` is bytes, not str.)
                        buf: Any = vec.as_buffer(of_type="d")
                        if buf.size != nbytes or (
                            # A second '[' may be a nested array that simdjson flattened.
                            payload.find(b"[", payload.find(b"[") + 1) >= 0
                            and b"[" in cast("bytes", vec.mini)[1:]
                        ):
                            rest.append(pos)
                            continue
                        buffers.append(buf)
                    for column, value in zip(columns, row, strict=True):
                        column.append(value)
                    good.append(pos)
                    if len(buffers) == _FLUSH_ROWS:
                        self._flush(buffers, matrix, len(good), payloads, good, handback)
                    continue
                rest.append(pos)
            except _SIMDJSON_ERRORS:
                rest.append(pos)
            finally:
                # No proxy may outlive its document: the parser is reused for the next.
                doc = vec = parent = value = objects = None
        if buffers:
            self._flush(buffers, matrix, len(good), payloads, good, handback)
        return self._finish(payloads, good, rest, matrix[: len(good)], handback, columns)

    def _flush(
        self,
        buffers: list[Any],
        matrix: np.ndarray,
        end: int,
        payloads: Sequence[bytes],
        good: list[int],
        handback: list[int],
    ) -> None:
        """Cast the vectors of the last `len(buffers)` rows (ending before row `end`) into
        `matrix`, and note the rows whose float32 values may differ from Arrow's parse."""
        start = end - len(buffers)
        doubles = np.frombuffer(b"".join(buffers), np.float64).reshape(len(buffers), self._dim)
        buffers.clear()
        with np.errstate(over="ignore"):  # beyond float32: infinity, as in Arrow's parse
            matrix[start:end] = doubles
        for i in np.flatnonzero(_suspect_rows(doubles)).tolist():
            row = doubles[i]
            index = start + i
            if float32_ties(row).any() or (
                (row.view(np.uint64) == 0).any() and _NEG_ZERO.search(payloads[good[index]])
            ):
                handback.append(index)

    def _objects(self, doc: Any) -> dict[_Path, Any] | None:
        """The objects on mapped paths, by path (missing or null parents left out), or
        None when one has a duplicate key or a parent is not an object."""
        if self._flat:
            if len(doc) != len(set(doc.keys())):
                return None
            return {(): doc}
        objects: dict[_Path, Any] = {(): doc}
        for prefix in self._prefixes:
            if prefix:
                parent = objects.get(prefix[:-1])
                if parent is None:
                    continue
                child = parent.get(prefix[-1])
                if child is None:
                    continue
                if type(child) is not simdjson.Object:
                    return None
                objects[prefix] = child
            obj = objects[prefix]
            if len(obj) != len(set(obj.keys())):
                return None
        return objects

    def _finish(
        self,
        payloads: Sequence[bytes],
        good: list[int],
        rest: list[int],
        matrix: np.ndarray,
        handback: list[int],
        columns: list[list[Any]],
    ) -> tuple[np.ndarray, dict[_Path, pa.Array], list[int]]:
        """Check the scalar leaves (ranges, -0, float32 rounding, timestamps), hand back
        the rows that fail a check, and build the leaves of the others."""
        keep = np.ones(len(good), bool)
        keep[handback] = False
        arrays: list[pa.Array] = []
        for leaf, values in zip(self._scalars, columns, strict=True):
            arr, bad = _scalar_leaf(leaf.kind, values, payloads, good)
            keep[bad] = False
            arrays.append(arr)
        positions = np.asarray(good, np.int64)
        if not keep.all():
            rest = sorted([*rest, *positions[~keep].tolist()])
            positions = positions[keep]
            take = pa.array(np.flatnonzero(keep))
            arrays = [arr.take(take) for arr in arrays]
            matrix = matrix[keep]
        leaves = {leaf.path: arr for leaf, arr in zip(self._scalars, arrays, strict=True)}
        if self._vector is not None:
            offsets = np.arange(0, (len(positions) + 1) * self._dim, self._dim, dtype=np.int32)
            leaves[self._vector] = pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(matrix.ravel())
            )
        return positions, leaves, rest


def _suspect_rows(matrix: np.ndarray) -> np.ndarray:
    """Rows with a component that may be a float32 tie or a zero (checked exactly later):
    a normal-range tie pattern, or a magnitude in float32's subnormal range (zero too)."""
    bits = matrix.view(np.uint64)
    low = bits & _LOW_MASK
    flagged = low == _HALF
    np.bitwise_and(bits, _EXP_MASK, out=low)
    flagged |= low < _TINY_BITS
    return np.asarray(flagged.any(axis=1))


def _scalar_leaf(
    kind: str, values: list[Any], payloads: Sequence[bytes], good: list[int]
) -> tuple[pa.Array, list[int]]:
    """One scalar leaf as Arrow's reader makes it, and the rows (indices into `values`)
    to hand back to the Arrow path."""
    bad: list[int] = []
    if kind in {"string", "binary", "base64_f32"}:
        return pa.array(values, pa.string()), bad
    if kind == "bool":
        return pa.array(values, pa.bool_()), bad
    if kind in {"int32", "int64"}:
        low, high = _INT_RANGES[kind]
        bad = [i for i, v in enumerate(values) if v is not None and not low <= v <= high]
        if bad:
            dropped = set(bad)
            values = [None if i in dropped else v for i, v in enumerate(values)]
        return pa.array(values, pa.int32() if kind == "int32" else pa.int64()), bad
    if kind in {"float32", "float64"}:
        floats = [None if v is None else float(v) for v in values]
        arr = pa.array(floats, pa.float64())
        dense = pc.fill_null(arr, 1.0).to_numpy()
        zeros = (dense.view(np.uint64) == 0) & np.array([type(v) is int for v in values], bool)
        bad = [i for i in np.flatnonzero(zeros).tolist() if _NEG_ZERO.search(payloads[good[i]])]
        if kind == "float32":
            bad = sorted({*bad, *np.flatnonzero(float32_ties(dense)).tolist()})
            return arr.cast(pa.float32()), bad
        return arr, bad
    # timestamp: epoch-ms integers, or ISO-8601 strings as Arrow's reader parses them.
    low, high = _INT_RANGES[kind]
    out: list[Any] = [None] * len(values)
    texts: list[int] = []
    for i, v in enumerate(values):
        if type(v) is str:
            texts.append(i)
        elif v is not None:
            if low <= v <= high:
                out[i] = v
            else:
                bad.append(i)
    arr = pa.array(out, pa.int64()).cast(_TS_TYPE)
    if texts:
        try:
            parsed = pa.array([values[i] for i in texts]).cast(_TS_PARSE_TYPE)
        except (pa.ArrowInvalid, UnicodeEncodeError):
            return arr, sorted([*bad, *texts])
        ms = pc.floor_temporal(parsed, unit="millisecond").cast(_TS_TYPE)
        mask = np.zeros(len(values), bool)
        mask[texts] = True
        filled = np.zeros(len(values), np.int64)
        filled[texts] = ms.cast(pa.int64()).to_numpy()
        arr = pc.if_else(pa.array(mask), pa.array(filled).cast(_TS_TYPE), arr)
    return arr, bad
