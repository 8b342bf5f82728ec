"""The JSON format's parse paths: one bulk parse with Arrow's reader, the vector fast
paths before it, and message-by-message screening and bisection when a bulk parse fails.

`JsonParser.parse` turns a batch's JSON values into the leaves of the paths the table's
columns read (`sink.decode.Decoder` checks and assembles them into rows), plus the
faults of the values that do not parse. Every path gives a value the outcome one reader
would (rows bit-exact, the same faults), whatever the batch around it
(tests/unit/test_decode_metamorphic.py; what a value may hold: `sink.json_values`).

Thread safety: one parser serves every decode thread of its table. It holds two hints,
each a guess about the next batch that a wrong guess costs only a second parse (which
timestamp representation the last batch's values used; whether a value held a raw
newline): they are plain attributes read and written without a lock, so threads may
overwrite each other's guess, never a result.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, cast

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.json as pj

from sink.decode_plan import (
    CANONICAL,
    TS_PARSE_TYPE,
    ColumnPlan,
    Fault,
    Path,
    concat,
    take,
    to_ms_timestamp,
)
from sink.decoded import value_sizes
from sink.formats.records import float32_beyond, to_float
from sink.json_values import (
    EXPECTED,
    article,
    is_utf8,
    is_utf8_buffer,
    json_kind,
    kind_problem,
    loads,
    quick_fits,
    show,
    utf8_error,
)
from sink.vector_json import VectorJson
from sink.vector_scan import scan, scan_base64

__all__ = ["JsonParser", "ParseResult"]

#: Bytes of JSON parsed per Arrow call. A batch is parsed in chunks of about this size:
#: well below glibc's 32 MiB mmap threshold, so each chunk's buffer reuses heap pages
#: instead of faulting in fresh ones (one 44 MB buffer per batch parsed 30% slower), and it
#: bounds the extra memory of a parse. 4-8 MiB measured best for 200-byte and vector rows.
_PARSE_CHUNK_BYTES: Final = 4 << 20

#: Blocks per chunk: Arrow parses blocks in parallel; four ~1 MiB blocks keep two cores
#: busy when blocks parse at uneven speed (two left a core idle, eight added overhead).
_BLOCKS_PER_CHUNK: Final = 4

#: Smallest block: below this a block's fixed cost outweighs a second core.
_MIN_BLOCK_BYTES: Final = 64 << 10

#: Batches of base64 vector values up to this many take `sink.vector_json` (simdjson in
#: Python, no fixed cost), larger ones `sink.vector_scan` (outside the interpreter lock,
#: but its Arrow call on the stripped texts costs a fixed ~0.1-0.5 ms). Measured on
#: threads, 2.3 KB values, when the large batches went to Arrow's reader whole: the sink
#: caught up 1.1-1.5x faster than on simdjson in Python, but its freshness at 1k msg/s
#: (batches of a few values) went from p50 47 to 55-69 ms with every batch on Arrow.
_SIMDJSON_BASE64_MAX: Final = 64

_CORES: Final = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)

_WRAP_HEAD: Final = b'{"v":'

_WRAP_JOIN: Final = b'}\n{"v":'

_WRAP_TAIL: Final = b"}"

_ROOT: Final = "v"


@dataclass(slots=True)
class Parsed:
    """JSON leaves of a run of messages, in canonical types, aligned with `positions`.

    Leaves stay lists of arrays (one per Arrow block) until all runs are joined, so the
    values are copied into contiguous arrays once.
    """

    positions: np.ndarray  # positions in the list of values that was parsed
    leaves: dict[Path, list[pa.Array]]
    is_object: list[pa.Array]  # False where the JSON value was `null`


#: What parsing a list of JSON values gives: the positions of those that parsed, their
#: leaves and object mask, and the faults of those that did not, by position.
ParseResult: TypeAlias = tuple[np.ndarray, dict[Path, pa.Array], pa.Array, dict[int, Fault]]


def shifted(parsed: ParseResult, where: np.ndarray) -> ParseResult:
    """A parse result of ``values[where]`` with its positions mapped back into `values`."""
    positions, leaves, is_object, faults = parsed
    return where[positions], leaves, is_object, {int(where[p]): f for p, f in faults.items()}


def _collect(
    arr: pa.StructArray, prefix: Path, node: dict[str, Any], out: dict[Path, list[pa.Array]]
) -> None:
    """Append each leaf of `node` under `arr` to `out`, with parents' nulls merged in."""
    for (name, sub), child in zip(node.items(), arr.flatten(), strict=True):
        if isinstance(sub, dict):
            _collect(child, (*prefix, name), sub, out)
        else:
            out[(*prefix, name)].append(child)


def _chunks(sizes: np.ndarray, target: int) -> list[tuple[int, int]]:
    """Split positions 0..len(sizes) into runs of about `target` bytes (at least one each)."""
    n = len(sizes)
    if n == 0:
        return []
    ends = np.cumsum(sizes + len(_WRAP_JOIN))
    if int(ends[-1]) <= target:
        return [(0, n)]
    cuts = np.searchsorted(ends, np.arange(target, int(ends[-1]), target), side="right")
    bounds = sorted({0, n, *(int(c) for c in cuts if 0 < c < n)})
    return list(itertools.pairwise(bounds))


def _read_options(buf_bytes: int, longest_payload: int) -> pj.ReadOptions:
    """Arrow reader options for one wrapped chunk: ~`_BLOCKS_PER_CHUNK` parallel blocks."""
    longest_row = longest_payload + len(_WRAP_JOIN) + len(_WRAP_TAIL) + 1
    block = max(buf_bytes // _BLOCKS_PER_CHUNK + 1, _MIN_BLOCK_BYTES, longest_row)
    # Threads cost ~0.5 ms per call; worth it only when there are blocks to share out.
    return pj.ReadOptions(use_threads=_CORES > 1 and buf_bytes > block, block_size=block)


def _wrap(payloads: list[bytes], newlines: bool) -> tuple[bytes, bool]:
    """The payloads as one newline-delimited buffer of ``{"v":<payload>}`` rows, and
    whether a payload held a raw newline (only looked for when `newlines`).

    Wrapping makes every payload one row or a parse error: an empty payload, two documents
    in one payload or a non-object can never shift the rows after it. A raw newline in a
    value is JSON whitespace between tokens, or (invalid) a control character inside a
    string; Arrow's reader cuts its blocks at newlines, so one inside a value either falls
    inside a block (parsed as what it is) or splits the value between two blocks, and then
    the parse fails: a block then starts with the rest of a value, unbalanced, and can
    never read as whole rows. So newlines are looked for (a scan of the whole buffer, ~1 us
    per 2 KB value) only after a batch held some, or when a parse failed; found, they are
    made tabs: whitespace where the newline was whitespace, and a control character Arrow's
    reader refuses where it stood inside a string, as every other path refuses the newline
    itself (a space there made an invalid value valid, its string altered).
    """

    def joined(parts: list[bytes]) -> bytes:
        # Head and tail go onto the end payloads so the batch is copied once, by join.
        parts = parts.copy()
        parts[0] = _WRAP_HEAD + parts[0]
        parts[-1] += _WRAP_TAIL
        return _WRAP_JOIN.join(parts)

    buf = joined(payloads)
    if not newlines or buf.count(b"\n") == len(payloads) - 1:
        return buf, False
    return joined([p.replace(b"\n", b"\t") for p in payloads]), True


def _coerce_one(item: Any, type_name: str) -> pa.Array | str:
    """One JSON value that passed `kind_problem` as a length-1 canonical array.

    Returns:
        The array, or what is wrong with the value when it does not convert.
    """
    target = CANONICAL[type_name]
    if item is None:
        return pa.nulls(1, target)
    try:
        if type_name in {"float32", "float64"}:
            if type_name == "float32" and (beyond := float32_beyond(item, show)) is not None:
                return beyond
            return pa.array([to_float(item)], pa.float64()).cast(target)
        if type_name == "timestamp":
            if isinstance(item, str):
                return to_ms_timestamp(pa.array([item]).cast(TS_PARSE_TYPE))
            return pa.array([item], pa.int64()).cast(target)
        if type_name == "base64_f32":
            return pa.array([item], pa.string())
        if type_name == "vector":
            floats = [None if x is None else to_float(x) for x in item]
            return pa.array([pa.array(floats, pa.float64()).cast(pa.float32())], target)
        return pa.array([item], target)
    except (pa.ArrowInvalid, UnicodeEncodeError) as exc:
        if type_name == "timestamp" and isinstance(item, str):
            return f"is {show(item)}, not an ISO-8601 date or date-time"
        return f"is {show(item)}, which does not convert to {EXPECTED[type_name]} ({exc})"


class JsonParser:
    """The parse paths of one table's JSON values (see the module docstring).

    Args:
        columns: the table's columns read from JSON paths, in table order (primary key
            first).
        base64: the vector is a base64 text (``vector.encoding = "base64_f32"``).
        vector_dim: the vector's dimension, to parse with the vector fast paths: simdjson
            first (`sink.vector_json`), Arrow's reader for what it hands back (small
            messages without vectors parse faster in Arrow alone), and the vector read by
            `sink.vector_scan` outside the interpreter lock with the rest of each value
            read by Arrow's reader (base64 vectors only in batches above
            `_SIMDJSON_BASE64_MAX` values: catching up; smaller ones, a live stream where
            latency counts, take simdjson alone). None keeps every value on Arrow's reader.
        scan_simd: let the scan use its SSSE3 reader where the CPU has one.

    Raises:
        ValueError: two columns' paths overlap (one runs through the other, or reads it
            as another type).
    """

    def __init__(
        self,
        columns: list[ColumnPlan],
        *,
        base64: bool,
        vector_dim: int | None,
        scan_simd: bool,
    ) -> None:
        self._json_columns = columns
        self._base64 = base64
        self._scan_simd = scan_simd
        self._json_paths = list(dict.fromkeys(c.path for c in columns))
        self._path_types = {c.path: self.leaf_type(c) for c in columns}
        self._fast: VectorJson | None = None
        self._scan: tuple[Path, int] | None = None
        if vector_dim is not None:
            self._fast = VectorJson(list(self._path_types.items()), vector_dim)
            vector = next(
                p for p, kind in self._path_types.items() if kind in {"vector", "base64_f32"}
            )
            self._scan = vector, vector_dim
        path_columns = {c.path: c for c in reversed(columns)}
        # What `_fill_one` checks per path: the column, its type, and the value types that
        # fit without a closer look (None, and every kind but ranged ints and vectors).
        self._screen_plan = [
            (p, path_columns[p], self._path_types[p], quick_fits(self._path_types[p]))
            for p in self._json_paths
        ]
        self._tree = self._json_tree()
        self._has_timestamps = any(c.type_name == "timestamp" for c in columns)
        self._iso_timestamps = False  # which representation the last batch's timestamps used
        # Whether the last batch held a value with a raw newline: then the next batch is
        # checked for them before its first parse (see `_wrap`).
        self._newlines = False
        self._read_schemas = {iso: self._read_schema(iso) for iso in (False, True)}

    def _json_tree(self) -> dict[str, Any]:
        """The nested fields the JSON paths read: {name: subtree dict | type name}."""
        tree: dict[str, Any] = {}
        for col in self._json_columns:
            node = tree
            *parents, leaf = col.path
            for name in parents:
                child = node.setdefault(name, {})
                if not isinstance(child, dict):
                    raise ValueError(f"JSON path of {col.name!r} runs through a scalar column")  # noqa: TRY004 - a configuration value, not a type
                node = child
            current = node.get(leaf)
            if current is not None and current != self.leaf_type(col):
                what = "an object" if isinstance(current, dict) else "two types"
                raise ValueError(f"JSON path of {col.name!r} is also read as {what}")
            node[leaf] = self.leaf_type(col)
        return tree

    def leaf_type(self, col: ColumnPlan) -> str:
        """How a JSON column is read: its type name, or ``base64_f32`` for a base64 vector."""
        return "base64_f32" if col.type_name == "vector" and self._base64 else col.type_name

    def _read_schema(self, iso_timestamps: bool) -> pa.Schema:
        """The explicit schema for Arrow's JSON reader (timestamps as int or ISO text)."""

        def read_type(type_name: str) -> pa.DataType:
            if type_name == "timestamp":
                return TS_PARSE_TYPE if iso_timestamps else pa.int64()
            return CANONICAL[type_name]

        def struct(node: dict[str, Any]) -> pa.DataType:
            return pa.struct(
                [
                    (name, struct(sub) if isinstance(sub, dict) else read_type(sub))
                    for name, sub in node.items()
                ]
            )

        return pa.schema([(_ROOT, struct(self._tree))])

    def parse(
        self, payloads: list[bytes], sizes: np.ndarray
    ) -> tuple[np.ndarray, dict[Path, pa.Array], pa.Array, dict[int, Fault]]:
        """Parse JSON payloads: the vector fast path first (if on), Arrow for the rest.

        Returns:
            As `_parse_arrow`.
        """
        if self._fast is None:
            return self._parse_arrow(payloads, sizes)
        small = self._base64 and len(payloads) <= _SIMDJSON_BASE64_MAX
        if self._scan is not None and payloads and not small:
            return self._parse_scanned(payloads, sizes, *self._scan)
        return self._parse_simdjson(payloads, sizes)

    def _parse_scanned(
        self, payloads: list[bytes], sizes: np.ndarray, path: Path, dim: int
    ) -> ParseResult:
        """Parse vector JSON: the vectors by `sink.vector_scan`, the rest of each value by
        Arrow's reader from its stripped text; the values either leaves out (see
        `sink.vector_scan`) by `_parse_simdjson`, whole.

        Returns:
            As `_parse_arrow`.
        """
        vectors: pa.Array
        if self._base64:  # the base64 texts, decoded with those of the other paths
            positions, vectors, stripped = scan_base64(payloads, path, dim)
        else:
            positions, matrix, stripped = scan(payloads, path, dim, simd=self._scan_simd)
            offsets = np.arange(0, (len(positions) + 1) * dim, dim, dtype=np.int32)
            vectors = pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(matrix.ravel()), type=CANONICAL["vector"]
            )
        pieces: list[ParseResult] = []
        if len(positions):
            # A stripped text Arrow refuses is parsed again whole below (its fault then
            # names the value the producer sent).
            parsed, leaves, is_object, _ = self._parse_arrow(stripped, value_sizes(stripped))
            if len(parsed) < len(positions):
                vectors = take(vectors, np.asarray(parsed))
                positions = positions[parsed]
            leaves[path] = vectors
            pieces.append((positions, leaves, is_object, {}))
        if len(positions) < len(payloads):
            left = np.ones(len(payloads), bool)
            left[positions] = False
            where = np.flatnonzero(left)
            pieces.append(
                shifted(self._parse_simdjson([payloads[p] for p in where], sizes[where]), where)
            )
        return self._merge(pieces)

    def _parse_simdjson(self, payloads: list[bytes], sizes: np.ndarray) -> ParseResult:
        """Parse JSON payloads of a vector table: `sink.vector_json` first, Arrow for the
        rest.

        Returns:
            As `_parse_arrow`.
        """
        assert self._fast is not None
        fast, leaves, rest = self._fast.parse(payloads)
        ones = pa.array(np.ones(len(fast), bool))
        pieces: list[ParseResult] = [(fast, leaves, ones, {})]
        if rest:
            where = np.asarray(rest, np.int64)
            pieces.append(
                shifted(self._parse_arrow([payloads[p] for p in rest], sizes[where]), where)
            )
        return self._merge(pieces)

    def _merge(self, pieces: list[ParseResult]) -> ParseResult:
        """Parse results of disjoint positions as one, in position order."""
        faults = {pos: fault for piece in pieces for pos, fault in piece[3].items()}
        nonempty = [p for p in pieces if len(p[0])]
        if len(nonempty) <= 1:
            positions, leaves, is_object, _ = nonempty[0] if nonempty else pieces[0]
            return positions, leaves, is_object, faults
        pieces = nonempty
        positions = np.concatenate([p[0] for p in pieces])
        merged = {path: pa.concat_arrays([p[1][path] for p in pieces]) for path in self._json_paths}
        is_object = pa.concat_arrays([p[2] for p in pieces])
        if (np.diff(positions) > 0).all():
            return positions, merged, is_object, faults
        order = np.argsort(positions, kind="stable")
        merged = {path: take(arr, order) for path, arr in merged.items()}
        return positions[order], merged, is_object.take(pa.array(order)), faults

    def _parse_arrow(
        self, payloads: list[bytes], sizes: np.ndarray
    ) -> tuple[np.ndarray, dict[Path, pa.Array], pa.Array, dict[int, Fault]]:
        """Parse JSON payloads chunk by chunk with Arrow's reader.

        Returns:
            The positions (in `payloads`) of those that parsed, their leaves and object
            mask, and the faults of those that did not parse, by position.
        """
        pieces: list[Parsed] = []
        faults: dict[int, Fault] = {}
        for lo, hi in _chunks(sizes, _PARSE_CHUNK_BYTES):
            run = payloads if (lo, hi) == (0, len(payloads)) else payloads[lo:hi]
            keep = np.arange(lo, hi)
            # The wrapping is ASCII: the buffer is UTF-8 exactly when every payload is.
            buf: bytes | None
            buf, self._newlines = _wrap(run, self._newlines)
            if not is_utf8_buffer(buf):
                good = [pos for pos, p in enumerate(run) if is_utf8(p)]
                for pos in sorted(set(range(len(run))) - set(good)):
                    faults[lo + pos] = (
                        "invalid_utf8",
                        f"value is not UTF-8{utf8_error(run[pos])}",
                    )
                keep = keep[np.asarray(good, np.int64)]
                run = [run[pos] for pos in good]
                buf = None
            run_pieces, run_faults = self._parse_run(run, buf)
            for piece in run_pieces:
                piece.positions = keep[piece.positions]
                pieces.append(piece)
            faults.update((int(keep[pos]), fault) for pos, fault in run_faults.items())
        if not pieces:
            empty = {p: pa.array([], CANONICAL[self._path_types[p]]) for p in self._json_paths}
            return np.empty(0, np.int64), empty, pa.array([], pa.bool_()), faults
        return (
            np.concatenate([p.positions for p in pieces]),
            {p: concat([a for piece in pieces for a in piece.leaves[p]]) for p in self._json_paths},
            concat([a for piece in pieces for a in piece.is_object]),
            faults,
        )

    def _parse_run(
        self, payloads: list[bytes], buf: bytes | None
    ) -> tuple[list[Parsed], dict[int, Fault]]:
        """Parse one chunk of payloads; positions and faults are relative to `payloads`.

        One bulk parse normally. When it fails, every payload of the chunk is screened in
        Python (cost linear in the chunk, whatever the number of bad messages), the screened
        ones are parsed in bulk again, and only if Arrow still refuses some (it is stricter
        than the rules on duplicate keys and numbers beyond the double range) is the rest
        bisected down to single messages.
        """
        if not payloads:
            return [], {}
        parsed = self._bulk(payloads, buf)
        if parsed is None and buf is not None and not self._newlines:
            # Unchecked for raw newlines (see `_wrap`): if there are some, parse again
            # with them made spaces before looking for bad values.
            buf, self._newlines = _wrap(payloads, True)
            if self._newlines:
                parsed = self._bulk(payloads, buf)
        if parsed is not None:
            return [parsed], {}
        faults: dict[int, Fault] = {}
        passed: list[int] = []
        for pos, payload in enumerate(payloads):
            fault = self._decode_one(payload, build=False)
            if fault is None:
                passed.append(pos)
            else:
                faults[pos] = cast("Fault", fault)
        pieces: list[Parsed] = []
        bisect_faults: dict[int, Fault] = {}
        screened = [payloads[pos] for pos in passed]
        unchanged = len(passed) == len(payloads)  # then the bulk parse just failed on them
        self._bisect(screened, 0, len(screened), pieces, bisect_faults, known_bad=unchanged)
        mapping = np.asarray(passed, np.int64)
        for piece in pieces:
            piece.positions = mapping[piece.positions]
        faults.update((int(mapping[pos]), fault) for pos, fault in bisect_faults.items())
        return pieces, faults

    def _bisect(
        self,
        payloads: list[bytes],
        lo: int,
        hi: int,
        pieces: list[Parsed],
        faults: dict[int, Fault],
        known_bad: bool = False,
    ) -> None:
        """Parse payloads[lo:hi] in one go, or bisect until the failures are single messages."""
        if lo >= hi:
            return
        parsed = None if known_bad else self._bulk(payloads[lo:hi])
        if parsed is None and hi - lo == 1:
            one = self._decode_one(payloads[lo], build=True)
            if not isinstance(one, Parsed):
                faults[lo] = cast("Fault", one)
                return
            parsed = one
        if parsed is not None:
            parsed.positions += lo
            pieces.append(parsed)
            return
        mid = (lo + hi) // 2
        self._bisect(payloads, lo, mid, pieces, faults)
        self._bisect(payloads, mid, hi, pieces, faults)

    def _bulk(self, payloads: list[bytes], buf: bytes | None = None) -> Parsed | None:
        """Parse all `payloads` (`buf`: them wrapped, if at hand) with one Arrow call.

        Timestamps are read as the representation the last parse used first, then as the
        other one.

        Returns:
            Their leaves, or None if any of them does not parse.
        """
        if buf is None:
            buf, _ = _wrap(payloads, True)
        read_options = _read_options(len(buf), max(map(len, payloads)))
        first = self._iso_timestamps
        for iso in (first, not first) if self._has_timestamps else (first,):
            parse_options = pj.ParseOptions(
                explicit_schema=self._read_schemas[iso], unexpected_field_behavior="ignore"
            )
            try:
                table = pj.read_json(
                    pa.BufferReader(buf), read_options=read_options, parse_options=parse_options
                )
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                continue
            if table.num_rows != len(payloads):  # impossible with wrapped values; be safe
                return None
            self._iso_timestamps = iso
            return self._leaves(table.column(_ROOT).chunks, len(payloads))
        return None

    def _leaves(self, chunks: list[pa.StructArray], n: int) -> Parsed:
        """The leaf arrays of parsed root structs (parent nulls merged), canonical types."""
        per_path: dict[Path, list[pa.Array]] = {p: [] for p in self._json_paths}
        for chunk in chunks:
            _collect(chunk, (), self._tree, per_path)
        for path, arrays in per_path.items():
            if self._path_types[path] == "timestamp":
                per_path[path] = [to_ms_timestamp(arr) for arr in arrays]
        is_object = [chunk.is_valid() for chunk in chunks]
        return Parsed(np.arange(n, dtype=np.int64), per_path, is_object)

    def _decode_one(self, payload: bytes, build: bool) -> Parsed | Fault | None:
        """The per-message path: name the fault of one payload, or decode it.

        With `build` false this only screens (orjson and kind checks, no Arrow calls) and
        returns None for a payload that passes; with `build` true it returns the payload's
        leaves, converted exactly as the bulk path converts them.
        """
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            try:
                # NaN, Infinity and numbers beyond the double range: Python's json takes them.
                obj = loads(payload)
            except ValueError as exc:
                return ("invalid_json", f"value is not JSON: {exc}")
            except RecursionError:
                # Nested deeper than Python's parsers go (orjson: 1024 levels): Arrow's
                # reader, which reads it in a clean batch, decides, so a message's fate
                # does not depend on its neighbours.
                alone = self._bulk([payload])
                if alone is None:
                    return ("invalid_json", "value is not JSON, or nests too deeply to read")
                return alone if build else None
        if not isinstance(obj, dict):
            return ("not_an_object", f"value is a JSON {json_kind(obj)}, not an object")
        return self._fill_one(payload, obj, build, exact=False)

    def _fill_one(
        self, payload: bytes, obj: dict[str, Any], build: bool, *, exact: bool
    ) -> Parsed | Fault | None:
        """`_decode_one` of a payload parsed into `obj` (`exact`: by Python's json, whose
        integers are exact; orjson reads one beyond 64 bits as a float)."""
        leaves: dict[Path, list[pa.Array]] = {}
        # Screening runs this for every value of a chunk that did not parse: per path, a
        # walk and one type test in the common case (the rest only when something is off).
        for path, col, type_name, quick in self._screen_plan:
            if len(path) == 1:  # a top-level field (the usual case): no walk
                item: Any = obj.get(path[0])
            else:
                item = self._walk(obj, path, col)
                if isinstance(item, tuple):  # a fault (JSON values are never tuples)
                    return item
            if type(item) in quick and not build:
                continue
            problem = kind_problem(item, type_name)
            if problem is not None and type(item) is float and not exact:
                # Perhaps an integer beyond 64 bits, which the detail should show as sent.
                with contextlib.suppress(ValueError, RecursionError):
                    return self._fill_one(payload, loads(payload), build, exact=True)
            if problem is None and build:
                arr = _coerce_one(item, type_name)
                if isinstance(arr, str):
                    problem = arr
                else:
                    leaves[path] = [arr]
            if problem is not None:
                return ("wrong_type", f"{col.name!r} ({col.where}) {problem}")
        return Parsed(np.zeros(1, np.int64), leaves, [pa.array([True])]) if build else None

    @staticmethod
    def _walk(obj: dict[str, Any], path: Path, col: ColumnPlan) -> Any:
        """The value at `path` in `obj` (None past a null), or the ``wrong_type`` fault of
        a value on the way that is not an object."""
        item: Any = obj
        for depth, name in enumerate(path):
            if item is None:
                break
            if not isinstance(item, dict):
                kind = article(json_kind(item))
                where = "$" + "".join("." + step for step in path[:depth])
                return (
                    "wrong_type",
                    f"{col.name!r} ({col.where}): {where} is {kind}, not an object",
                )
            item = item.get(name)
        return item

    # -- tombstones and assembly ----------------------------------------------------------
