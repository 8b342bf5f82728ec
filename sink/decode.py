"""Decode one topic-partition's consumed messages into one Arrow `RecordBatch`.

The consumer loop hands a `Decoder` the messages one ``consume()`` call returned for one
topic-partition (ascending offsets) and gets back a `Decoded`: a batch in
`TableSpec.batch_schema` that `ShardWriter.put` accepts, the `DeadLetter` of every message
that can never be written, and the offsets of tombstones skipped by policy. Every message
given is accounted for exactly once (a row, a dead letter or a skipped offset), so the
offset range ``first_offset..last_offset`` is complete and may be committed once the batch
is durable. A bad message never raises: it becomes a dead letter and the partition goes on.

Lifecycle: the consumer loop builds one `Decoder` per table when it starts (the constructor
checks the mapping against the table and raises `ValueError` on a configuration the data
can never satisfy) and calls `Decoder.decode` from the ``source.decode_workers`` threads
for each batch. The decoder is stateless apart from its JSON parser's two hints (guesses
about the next batch, `sink.json_parse`: their thread-safety rule is there) and, for
registry formats, caches of schemas (the registry client's, and the writer schemas
already checked for evolution), so it needs no `close` and may be shared by all
partitions of the table.

The stages live in modules of their own: the plan of each column (`sink.decode_plan`),
the JSON parse paths (`sink.json_parse`), what a JSON value may hold (`sink.json_values`),
the records decoding gives (`sink.decoded`) and its totality (`sink.decode_total`); this
module checks the parsed columns and assembles the rows.

Sources (``source.columns``; an unmapped table column reads the same-named top-level JSON
field in the json format and is null in the raw format):

    $.a.b            the field ``b`` of the object ``a`` in the JSON value
    @key             the Kafka key (bytes)
    @topic           the topic (string column)
    @partition       the partition (int32 or int64 column)
    @offset          the offset (int64 column)
    @timestamp       the Kafka timestamp, epoch ms (timestamp or int64 column); null if the
                     message carries none
    @headers.NAME    the value of the last header called NAME (bytes)
    @value           the whole payload (bytes; the raw format's column)

Coercions, JSON values (anything else is ``wrong_type`` naming the column and JSON path):

    string     JSON strings only
    int32/64   JSON integers only (no fractions, no exponents, no strings), in range
    float32/64 JSON numbers; the non-standard literals Arrow's reader takes (NaN, -NaN,
               Inf, -Inf, Infinity, -Infinity: `sink.json_values`, read alike on every path), and
               numbers beyond the double range (as +-inf);
               a finite number beyond the float32 range in a float32 column is
               ``wrong_type`` (it would be stored as infinity)
    bool       true / false
    timestamp  an integer of epoch milliseconds, or an ISO-8601 string (date, optional time
               with up to microseconds, optional ``Z`` or ``+hh:mm`` offset; no offset means
               UTC; sub-millisecond digits are truncated)
    binary     a base64 string
    vector     a JSON array of exactly ``dim`` numbers; no nulls inside; with
               ``vector.encoding = "base64_f32"`` instead a base64 string of ``4 * dim``
               bytes (little-endian float32), else ``wrong_type`` (not base64) or
               ``wrong_vector_dimension`` (another length)

Coercions, byte sources (``@key``, ``@headers.NAME``, ``@value``): a binary column takes the
bytes as they are; a string column takes them if they are UTF-8 (else ``invalid_utf8``); an
int32/int64 column takes ASCII decimal text (``-?[0-9]+``, else ``wrong_type``). Other column
types cannot be fed from bytes; the constructor refuses such a mapping.

Checks after coercion, per row: a null or missing primary key is ``missing_primary_key``; a
null or missing value in a non-nullable column (the vector column always is) is
``missing_required``; a vector of another length is ``wrong_vector_dimension``; a NaN or an
infinity in it is ``nan_in_vector`` unless ``vector.allow_nan``. Before parsing, a value above
``max_message_bytes`` is ``oversized``, one that is not UTF-8 is ``invalid_utf8``, one that is
not JSON is ``invalid_json`` and JSON that is not an object (``null`` included) is
``not_an_object``. When one message has several faults, the first found in this order is
reported: message-level, primary key, then columns in table order.

A dead letter's detail says what is wrong and where it came from: the column, its source as
configured (``$.a.b``, ``@key``, ``@headers.NAME``; a tombstone's key is ``@key``), and the
value (a number, a short string, a JSON kind) or the vector component at fault, e.g.
``'n' ($.n) is 1.5, expected an integer`` or ``vector 'vec' ($.vec) component 3 is 1e+39,
beyond the float32 range``.

Tombstones (value ``None``): on an upsert table a tombstone is a delete row (``_op`` = 1)
whose single-column primary key comes from the Kafka key (string key: the UTF-8 key bytes;
integer key: its decimal text; binary key: the bytes); a missing or unusable key is
``missing_primary_key``, as is any tombstone of a table with a composite key. On an append
table ``tombstones = "skip"`` records the offset in `Decoded.skipped_offsets` and ``"dlq"``
makes a ``tombstone`` dead letter.

Registry formats (``avro``, ``protobuf``, ``json_schema``; `sink.formats`, docs/formats.md):
values are deserialized with the schema each names and columns read record paths exactly
like JSON paths; the reasons ``missing_magic_byte``, ``unknown_schema_id`` and
``not_matching_schema`` are theirs. A registry that cannot answer raises
`sink.formats.RegistryUnavailable` out of `decode` (not the messages' fault); with derived
columns each new writer schema is fitted to the table's columns: with ``table.evolve`` one
with new fields raises `sink.formats.SchemaEvolution`, without they are logged once.
Everything else below is the JSON format's.

How it is fast: the per-message Python work is reading the Message accessors. On a table
with a vector column, `sink.vector_scan` reads each value's vector (simdjson's On-Demand
reader in C++, outside the interpreter lock, straight into one float32 matrix per batch; a
base64 vector's text into one buffer, decoded in one pybase64 call) and gives its text back
with the vector stripped, which Arrow's reader below parses for the other columns. Small
batches of base64 vectors are parsed by `sink.vector_json` instead (simdjson in Python,
without the scan's fixed cost). What either is not sure of (anything not clean, see there)
is parsed whole by `sink.vector_json` and Arrow's reader, so rows and dead letters are the
same as Arrow's alone (``vector_fast_path=False``). Otherwise the JSON
values are parsed by `pyarrow.json.read_json` with an explicit schema of only the mapped
fields, in chunks of about 4 MiB (one call each, its blocks parsed on all cores). Each value
is wrapped as ``{"v":<value>}`` and the rows are newline-joined, so a value that is empty,
holds two documents or is not an object can never shift rows: it fails to parse. UTF-8 is
checked by Arrow over the whole chunk at once. Arrow's reader is as strict as the rules
above, so a clean parse needs no further type checks; the row checks (nulls, vector
length, NaN) are Arrow compute and numpy kernels over whole columns.

When a chunk does not parse, each of its values is screened with orjson and kind checks
(linear in the chunk, however many values are bad), the values that pass are parsed in
bulk again, and only if Arrow still refuses some (it is stricter than the rules on
duplicate keys, where the last one wins, and on numbers beyond the double range) are
those bisected down to single values, decoded one by one. Binary JSON columns decode
base64 per value (Arrow has no base64 kernel).

Python's cyclic GC is left alone: decoding keeps almost no GC-tracked objects alive (Arrow
buffers are not tracked; screened orjson objects die at once), and pausing the GC around
`decode` measured no difference, clean or with 1% bad messages, next to a live heap of two
million objects. The GC cost of big batches lies in the `Message` objects ``consume()``
creates, so any freeze/pause belongs around the consumer loop's ``consume()``.
"""

from __future__ import annotations

import binascii
import gc
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pybase64

from config.settings import SourceSettings
from engine.schema import (
    OP_COLUMN,
    OP_DELETE,
    OP_UPSERT,
    SOURCE_COLUMNS,
    TableSpec,
)
from sink.decode_plan import ColumnPlan, Fault, Kind, Path, take, type_name_of
from sink.decode_total import total
from sink.decoded import (
    TIMESTAMP_NOT_AVAILABLE,
    DeadLetter,
    Decoded,
    MessageLike,
    Reason,
    dead_letter,
    value_sizes,
)
from sink.formats import (
    SchemaCheck,
    SchemaCheckMode,
    parse_records,
    record_format,
)
from sink.formats.keys import KeyDecoder
from sink.formats.leaves import Column
from sink.formats.records import FLOAT32_MAX, float32_beyond, to_float
from sink.json_parse import JsonParser
from sink.json_values import (
    INT_RANGES,
    RANGE_NAMES,
    is_utf8,
    loads,
    show,
    utf8_error,
)

__all__ = ["DeadLetter", "Decoded", "Decoder", "MessageLike", "Reason"]


_DECIMAL_RE: Final = r"^-?[0-9]+$"

_BYTES_TARGETS: Final = frozenset({"binary", "string", "int32", "int64"})


# ---------------------------------------------------------------------------------------
# The plan: what each output column is made from, fixed at construction.


_METADATA_TARGETS: Final[dict[str, frozenset[str]]] = {
    "@topic": frozenset({"string"}),
    "@partition": frozenset({"int32", "int64"}),
    "@offset": frozenset({"int64"}),
    "@timestamp": frozenset({"timestamp", "int64"}),
}


def freeze_gc() -> None:
    """Move what the process holds now out of the cyclic GC's reach and make collections
    rare: decoding makes and frees many objects, and collections that rescanned the large,
    long-lived heap made it 5-8x slower (the sink's loop and each decode worker call it
    once they are set up; messages are freed by reference counting)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


@dataclass(slots=True)
class _Rows:
    """Rows under decoding: message index per row, columns, and faults by message index."""

    index: np.ndarray
    columns: dict[str, pa.Array] = field(default_factory=dict)
    faults: dict[int, Fault] = field(default_factory=dict)

    def fault(self, positions: Iterable[int] | np.ndarray, fault: Fault) -> None:
        """Record `fault` for rows at `positions` that have none yet (first fault wins)."""
        for pos in positions:
            self.faults.setdefault(int(self.index[int(pos)]), fault)


class Decoder:
    """Turns one topic-partition's messages into one batch plus dead letters.

    Built once per table by the consumer loop; `decode` is called from the
    ``source.decode_workers`` threads, several batches at once on one decoder (its only
    shared state, the JSON parser's hints, are guesses that any thread may set). `decode` does
    not raise for bad messages: each one becomes a `DeadLetter`. There is nothing to close.

    Args:
        spec: the table's shape (`TableSpec.from_settings`).
        source: how messages become rows (`Settings.source`).
        schema_check: registry formats with derived columns: each new writer schema is
            fitted to the table's columns; "evolve" (``table.evolve``) raises
            `sink.formats.SchemaEvolution` for fields that would add or widen one, "warn"
            logs them once per schema (`sink.formats.SchemaCheck`).
        vector_fast_path: parse vector tables' JSON with `sink.vector_scan` (vectors as
            arrays) or `sink.vector_json` (base64 vectors, and what the scan leaves) first; False
            keeps every value on Arrow's reader (the reference the fast path is tested
            against).
        scan_simd: let the vector scan read short decimals with its SSSE3 reader where the
            CPU has one; False keeps it to the portable reader (the same rows: the tests
            decode both ways).

    Raises:
        ValueError: the mapping can never fill the table: a source feeding a column type it
            cannot produce, JSON paths that overlap, or (raw format) a required column
            without a source.
    """

    def __init__(
        self,
        spec: TableSpec,
        source: SourceSettings,
        *,
        schema_check: SchemaCheckMode = "off",
        vector_fast_path: bool = True,
        scan_simd: bool = True,
    ) -> None:
        self._spec = spec
        self._source = source
        self._schema: pa.Schema = spec.batch_schema
        self._max_bytes = int(source.max_message_bytes)
        self._json = source.format == "json"
        # Registry formats read record paths like JSON paths (sink.formats).
        self._records = record_format(source)
        self._paths = self._json or self._records is not None
        # Registry-encoded keys (source.key_format): @key reads the decoded key.
        key_format = record_format(source, key=True)
        self._keys = KeyDecoder(key_format) if key_format is not None else None
        self._allow_nan = spec.vector.allow_nan if spec.vector is not None else False
        self._base64 = spec.vector is not None and spec.vector.encoding == "base64_f32"
        if self._base64 and not self._json:
            raise ValueError(
                'table.vector.encoding = "base64_f32" is for the json format only '
                f"(source.format is {source.format!r})"
            )
        unknown = sorted(set(source.columns) - set(spec.table_schema.names))
        if unknown:
            raise ValueError(f"source.columns maps unknown table columns: {', '.join(unknown)}")
        required = {
            f.name for f in spec.table_schema if not f.nullable or f.name in spec.primary_key
        }
        columns = [
            self._plan_column(f, f.name in required)
            for f in spec.table_schema
            if f.name not in SOURCE_COLUMNS
        ]
        # Primary key columns first: a row missing its key reports that before anything else.
        self._columns = sorted(columns, key=lambda c: not c.primary_key)
        self._source_columns = all(n in spec.table_schema.names for n in SOURCE_COLUMNS)
        json_columns = [c for c in self._columns if c.kind == "json"]
        self._path_columns = {c.path: c for c in reversed(json_columns)}
        # Derived columns: new writer schemas are checked against all columns (sink.formats).
        self._schema_check = (
            SchemaCheck(
                {c.name: Column(c.where, c.type_name) for c in self._columns},
                evolve=schema_check == "evolve",
            )
            if schema_check != "off" and self._records is not None
            else None
        )
        # Vector tables in the JSON format take the vector fast paths (`JsonParser`).
        # (Its checks of overlapping paths run for every format: registry formats read
        # record paths the same way.)
        fast_dim = (
            spec.vector.dim if vector_fast_path and self._json and spec.vector is not None else None
        )
        self._parser = JsonParser(
            json_columns, base64=self._base64, vector_dim=fast_dim, scan_simd=scan_simd
        )
        self._tombstone_key: ColumnPlan | None = None
        if spec.upsert and len(spec.primary_key) == 1:
            self._tombstone_key = next(c for c in self._columns if c.primary_key)

    def _plan_column(self, f: pa.Field, required: bool) -> ColumnPlan:
        type_name = type_name_of(f.type)
        pk = f.name in self._spec.primary_key
        mapped = self._source.columns.get(f.name)
        if mapped is None:
            if self._paths:
                return ColumnPlan(f.name, type_name, f.type, "json", (f.name,), required, pk)
            if required:
                raise ValueError(f"column {f.name!r} is required but has no source (raw format)")
            return ColumnPlan(f.name, type_name, f.type, "none")
        if mapped.startswith("$."):
            if not self._paths:
                raise ValueError(f"column {f.name!r}: JSON path {mapped!r} in the raw format")
            path = tuple(mapped[2:].split("."))
            return ColumnPlan(f.name, type_name, f.type, "json", path, required, pk)
        if self._keys is not None and (mapped == "@key" or mapped.startswith("@key.")):
            path = tuple(mapped.split(".")[1:])
            return ColumnPlan(f.name, type_name, f.type, "key", path, required, pk)
        if mapped in {"@key", "@value"} or mapped.startswith("@headers."):
            if type_name not in _BYTES_TARGETS:
                raise ValueError(
                    f"column {f.name!r} is {type_name}; {mapped} gives bytes, which feed "
                    "binary, string, int32 or int64 columns only"
                )
            header = mapped.removeprefix("@headers.")
            path = (mapped,) if header == mapped else ("@headers", header)
            return ColumnPlan(f.name, type_name, f.type, "bytes", path, required, pk)
        allowed = _METADATA_TARGETS[mapped]
        if type_name not in allowed:
            raise ValueError(
                f"column {f.name!r} is {type_name}; {mapped} feeds {', '.join(sorted(allowed))}"
            )
        kinds: dict[str, Kind] = {
            "@topic": "topic",
            "@partition": "partition",
            "@offset": "offset",
            "@timestamp": "timestamp",
        }
        return ColumnPlan(f.name, type_name, f.type, kinds[mapped], (), required, pk)

    # -- decode -----------------------------------------------------------------------

    def decode(self, messages: Sequence[MessageLike]) -> Decoded:
        """Decode the messages of one topic-partition (ascending offsets) into one batch.

        Args:
            messages: consumed messages of one topic-partition in ascending offset order, at
                least one, none with an error set.

        Returns:
            The good rows, the dead letters and the skipped tombstones; together they
            account for every message given.

        Raises:
            ValueError: `messages` is empty.
            RegistryUnavailable: the schema registry cannot answer (not the messages'
                fault: the consumer loop decodes them again later).
            SchemaEvolution: the table must evolve before these messages are written.
        """
        if not messages:
            raise ValueError("decode needs at least one message")
        return total(self._decode, messages)

    def _decode(self, messages: Sequence[MessageLike]) -> Decoded:
        """`decode` without the guarantee that nothing else raises (`total` gives it)."""
        first = messages[0]
        topic, partition = first.topic() or "", first.partition() or 0
        offsets = np.array([m.offset() for m in messages], dtype=np.int64)
        values = [m.value() for m in messages]
        sizes = value_sizes(values)
        candidates = np.flatnonzero((sizes >= 0) & (sizes <= self._max_bytes))
        dead: dict[int, Fault] = {
            int(i): (
                "oversized",
                (
                    f"value is {int(sizes[i])} bytes, more than source.max_message_bytes "
                    f"({self._max_bytes})"
                ),
            )
            for i in np.flatnonzero(sizes > self._max_bytes)
        }
        payloads: list[bytes] = (
            cast("list[bytes]", values)
            if len(candidates) == len(values)
            else [cast("bytes", values[i]) for i in candidates]
        )
        meta = _Metadata(messages, offsets, values, topic, partition)
        rows, early = self._decode_candidates(candidates, payloads, sizes[candidates], meta)
        dead.update(early)
        dead.update(rows.faults)

        skipped: list[int] = []
        deletes: list[tuple[int, Any]] = []
        for i in np.flatnonzero(sizes < 0).tolist():
            if self._spec.upsert:
                key, fault = self._tombstone_key_value(messages[i].key())
                if fault is None:
                    deletes.append((i, key))
                else:
                    dead[i] = fault
            elif self._source.tombstones == "skip":
                skipped.append(int(offsets[i]))
            else:
                dead[i] = ("tombstone", "null value on an append table (source.tombstones = dlq)")

        return Decoded(
            batch=self._assemble(rows, deletes, meta),
            dead_letters=[dead_letter(messages[i], *dead[i]) for i in sorted(dead)],
            skipped_offsets=skipped,
            first_offset=int(offsets[0]),
            last_offset=int(offsets[-1]),
        )

    def _decode_candidates(
        self, candidates: np.ndarray, payloads: list[bytes], sizes: np.ndarray, meta: _Metadata
    ) -> tuple[_Rows, dict[int, Fault]]:
        """Decode the messages that have a value of an allowed size.

        Returns:
            The rows of the messages that parsed (some with row faults), and the faults of
            the messages that did not, both keyed by message index.
        """
        early: dict[int, Fault] = {}
        index = candidates
        leaves: dict[Path, pa.Array] = {}
        is_object: pa.Array | None = None
        column_faults: dict[Path, dict[int, Fault]] = {}
        if self._records is not None:
            paths = [
                (path, c.type_name, f"{c.name!r} ({c.where})")
                for path, c in self._path_columns.items()
            ]
            parsed = parse_records(self._records, payloads, paths, self._schema_check)
            early = {int(candidates[pos]): cast("Fault", f) for pos, f in parsed.faults.items()}
            index = index[parsed.positions]
            leaves = parsed.leaves
            column_faults = cast("dict[Path, dict[int, Fault]]", parsed.column_faults)
        elif self._json:
            positions, leaves, is_object, faults = self._parser.parse(payloads, sizes)
            early = {int(candidates[pos]): fault for pos, fault in faults.items()}
            index = index[positions]
        rows = _Rows(index=np.asarray(index, dtype=np.int64))
        if is_object is not None and is_object.false_count:
            not_object = np.flatnonzero(~is_object.to_numpy(zero_copy_only=False))
            rows.fault(not_object, ("not_an_object", "value is JSON null, not an object"))
        for col in self._columns:
            if col.path in column_faults:
                for pos, fault in column_faults[col.path].items():
                    rows.fault((pos,), fault)
            rows.columns[col.name] = self._column(col, rows, leaves, meta)
        return rows, early

    def _column(
        self, col: ColumnPlan, rows: _Rows, leaves: dict[Path, pa.Array], meta: _Metadata
    ) -> pa.Array:
        """One column for `rows`, in its canonical type, faulting rows it cannot hold."""
        if col.kind == "json":
            arr = leaves[col.path]
            if col.type_name == "float32" and self._json:
                _check_float32(arr, col, rows, meta)
            elif col.type_name == "binary" and self._json:
                arr = _from_base64(arr, col, rows)
            elif col.type_name == "vector":
                if self._base64:
                    arr = self._from_base64_f32(arr, col, rows)
                self._check_vectors(arr, col, rows, meta)
        elif col.kind == "none":
            arr = pa.nulls(len(rows.index), col.arrow_type)
        elif col.kind == "bytes":
            arr = _bytes_to(meta.bytes_source(col.path).take(rows.index), col, rows)
        elif col.kind == "key":
            arr = self._key_column(col, rows, meta)
        else:
            arr = meta.metadata(col.kind, col.arrow_type).take(rows.index)
        if col.required and arr.null_count:
            nulls = np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))
            if col.primary_key:
                reason: Reason = "missing_primary_key"
                what = f"primary key {col.name!r} ({col.where}) is null or missing"
            else:
                reason, what = "missing_required", f"{col.name!r} ({col.where}) is null or missing"
            rows.fault(nulls, (reason, what))
        return arr

    def _key_column(self, col: ColumnPlan, rows: _Rows, meta: _Metadata) -> pa.Array:
        """A column read from the decoded keys (source.key_format), faulting the rows whose
        key does not decode or does not fit."""
        assert self._keys is not None
        records, faults = meta.decoded_keys(self._keys)
        describe = f"{col.name!r} ({col.where})"
        arr, bad = self._keys.column(records, col.path, col.type_name, describe)
        for index, fault in bad.items():
            faults.setdefault(index, fault)
        if faults:
            hit = np.flatnonzero(np.isin(rows.index, np.fromiter(faults, np.int64)))
            for pos in hit.tolist():
                rows.fault((pos,), cast("Fault", faults[int(rows.index[pos])]))
        return arr.take(pa.array(rows.index))

    def _check_vectors(self, arr: pa.Array, col: ColumnPlan, rows: _Rows, meta: _Metadata) -> None:
        """Fault rows whose vector has the wrong length, a null, or (unless allowed) NaN/inf.

        A component is non-finite in the float32 column when the JSON has NaN or an infinity
        or a number beyond the float32 range; the faulted rows' payloads are read again to
        say which component and which of these (only bad rows pay for it)."""
        assert self._spec.vector is not None
        dim = self._spec.vector.dim
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
        if self._allow_nan:
            return
        finite = np.isfinite(flat.to_numpy())
        if not finite.all():
            values = flat.to_numpy()
            starts = pc.list_parent_indices(arr).to_numpy()
            for pos, first in _first_in_row(~finite, arr):
                if self._base64:
                    number = float(values[int(np.searchsorted(starts, pos)) + first])
                    what = f"vector {col.name!r} ({col.where}) component {first} is {show(number)}"
                else:
                    what = _non_finite(col, first, meta.value(int(rows.index[pos])))
                rows.fault((pos,), ("nan_in_vector", what))

    def _from_base64_f32(self, arr: pa.Array, col: ColumnPlan, rows: _Rows) -> pa.Array:
        """Base64 text of little-endian float32 as ``list<float32>`` (null where the text is
        null or faulted: not base64, or not 4 * dim bytes)."""
        assert self._spec.vector is not None
        dim = self._spec.vector.dim
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

    def _tombstone_key_value(self, key: bytes | None) -> tuple[Any, Fault | None]:
        """The primary key value a tombstone deletes, or why it has none."""
        col = self._tombstone_key
        if col is None:
            keys = ", ".join(self._spec.primary_key)
            return None, (
                "missing_primary_key",
                (
                    f"tombstone cannot delete: the primary key ({keys}) has several columns "
                    "and a Kafka key gives one"
                ),
            )
        if key is None:
            return None, ("missing_primary_key", "tombstone cannot delete: it has no Kafka key")
        if self._keys is not None:
            return self._decoded_tombstone_key(col, key)
        probe = _Rows(index=np.zeros(1, np.int64))
        from_key = replace(col, kind="bytes", path=("@key",))
        arr = _bytes_to(pa.array([key], pa.binary()), from_key, probe)
        if probe.faults:
            return None, ("missing_primary_key", f"tombstone cannot delete: {probe.faults[0][1]}")
        return arr[0].as_py(), None

    def _decoded_tombstone_key(self, col: ColumnPlan, key: bytes) -> tuple[Any, Fault | None]:
        """The primary key a registry-encoded tombstone key gives: the key column's path
        (``@key.a``, or the whole key), else the record key's field of the column's name."""
        assert self._keys is not None
        records, faults = self._keys.decode([key])
        if faults:
            return None, cast("Fault", faults[0])
        path = col.path if col.kind == "key" else ()
        if col.kind != "key" and isinstance(records[0], dict):
            path = (col.name,)
        where = ".".join(("@key", *path))
        arr, bad = self._keys.column(records, path, col.type_name, f"{col.name!r} ({where})")
        if bad:
            return None, ("missing_primary_key", f"tombstone cannot delete: {bad[0][1]}")
        if arr[0].as_py() is None:
            what = f"{col.name!r} ({where}) is null"
            return None, ("missing_primary_key", f"tombstone cannot delete: {what}")
        return arr[0].as_py(), None

    def _assemble(
        self, rows: _Rows, deletes: list[tuple[int, Any]], meta: _Metadata
    ) -> pa.RecordBatch | None:
        """The batch in `batch_schema`: good rows and delete rows, in offset order."""
        if rows.faults:
            bad = np.fromiter(rows.faults, np.int64, len(rows.faults))
            keep = np.flatnonzero(~np.isin(rows.index, bad))
        else:
            keep = None
        index = rows.index if keep is None else rows.index[keep]
        n_good, n_del = len(index), len(deletes)
        if n_good + n_del == 0:
            return None
        arrays: dict[str, pa.Array] = {}
        for col in self._columns:
            arr = rows.columns[col.name]
            if keep is not None:
                arr = take(arr, keep)
            if col.type_name == "vector":
                arr = pa.FixedSizeListArray.from_arrays(pc.list_flatten(arr), type=col.arrow_type)
            elif not arr.type.equals(col.arrow_type):
                arr = arr.cast(col.arrow_type)
            if n_del:
                if col is self._tombstone_key:
                    extra = pa.array([k for _, k in deletes], col.arrow_type)
                else:
                    extra = pa.nulls(n_del, col.arrow_type)
                arr = pa.concat_arrays([arr, extra])
            arrays[col.name] = arr
        if n_del:
            index = np.concatenate([index, np.fromiter((i for i, _ in deletes), np.int64, n_del)])
        if self._source_columns:
            arrays["_topic"] = meta.metadata("topic", pa.string()).take(index)
            arrays["_partition"] = meta.metadata("partition", pa.int32()).take(index)
            arrays["_offset"] = pa.array(meta.offsets[index])
        if self._spec.upsert:
            ops = np.full(n_good + n_del, OP_UPSERT, np.int8)
            ops[n_good:] = OP_DELETE
            arrays[OP_COLUMN] = pa.array(ops)
        batch = pa.RecordBatch.from_arrays(
            [arrays[f.name] for f in self._schema], schema=self._schema
        )
        if n_del:
            batch = batch.take(pa.array(np.argsort(index, kind="stable")))
        return batch


# ---------------------------------------------------------------------------------------
# Helpers


class _Metadata:
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


def _last_header(headers: Sequence[tuple[str, bytes | None]] | None, name: str) -> bytes | None:
    found = None
    for key, value in headers or ():
        if key == name:
            found = value
    return found


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


def _constant_string(value: str, n: int) -> pa.Array:
    """A string array of `n` times `value`, built from buffers (no per-row Python)."""
    data = value.encode()
    offsets = np.arange(0, (n + 1) * len(data), len(data) or 1, dtype=np.int64)[: n + 1]
    if not data:
        offsets = np.zeros(n + 1, np.int64)
    return pa.LargeStringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data * n)).cast(
        pa.string()
    )


def _from_base64(arr: pa.Array, col: ColumnPlan, rows: _Rows) -> pa.Array:
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


def _bytes_to(arr: pa.Array, col: ColumnPlan, rows: _Rows) -> pa.Array:
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


def _check_float32(arr: pa.Array, col: ColumnPlan, rows: _Rows, meta: _Metadata) -> None:
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
