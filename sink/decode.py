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
the checks that bring each column into its type and fault the rows that cannot hold it
(`sink.decode_columns`), the records decoding gives (`sink.decoded`) and its totality
(`sink.decode_total`); this module wires them: it screens sizes and tombstones, runs the
parse and the checks column by column, and assembles the rows.

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

Change events (``source.envelope = "debezium"``, `sink.cdc`, docs/formats.md "Change data
capture"): each value (json, or a registry format's record) is read as Debezium's
envelope; unmapped columns read ``$.after.<column>`` and mapped paths address the
envelope. Ops c, r and u give a row from the after image, whose columns are built like a
registry format's (`sink.formats.record_column`); d gives a delete row of the key in
before or the Kafka key; Debezium's tombstones, and truncates with ``source.truncate =
"skip"``, are skipped offsets (the truncates counted in `Decoded.truncates`). With derived
columns each new writer schema (json: schema block) is fitted to the after image's fields.
In json the after image's vector is read by `sink.vector_scan` (below), the rest of the
event by orjson from the stripped text (`sink.cdc`). Reasons of their own:
``cdc_missing_op``, ``cdc_unknown_op``, ``cdc_missing_after``, ``cdc_missing_key``,
``cdc_truncate``.

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

import gc
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import structlog

from config.settings import SourceSettings
from engine.schema import (
    OP_COLUMN,
    OP_DELETE,
    OP_UPSERT,
    SOURCE_COLUMNS,
    TableSpec,
)
from sink.cdc import ROW, Debezium
from sink.decode_columns import (
    Metadata,
    Rows,
    bytes_to,
    check_float32,
    check_vectors,
    from_base64,
    from_base64_f32,
)
from sink.decode_plan import ColumnPlan, Fault, Path, plan_column, take
from sink.decode_total import total
from sink.decoded import (
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
    record_column,
    record_format,
)
from sink.formats.keys import KeyDecoder
from sink.formats.leaves import Column
from sink.formats.records import to_column
from sink.json_parse import JsonParser

__all__ = ["DeadLetter", "Decoded", "Decoder", "MessageLike", "Reason"]

log = structlog.get_logger("lance_sink.decode")


def freeze_gc() -> None:
    """Move what the process holds now out of the cyclic GC's reach and make collections
    rare: decoding makes and frees many objects, and collections that rescanned the large,
    long-lived heap made it 5-8x slower (the sink's loop and each decode worker call it
    once they are set up; messages are freed by reference counting)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


class Decoder:
    """Turns one topic-partition's messages into one batch plus dead letters.

    Built once per table by the consumer loop; `decode` is called from the
    ``source.decode_workers`` threads, several batches at once on one decoder (its only
    shared state, the JSON parser's hints, are guesses that any thread may set). `decode` does
    not raise for bad messages: each one becomes a `DeadLetter`. There is nothing to close.

    Args:
        spec: the table's shape (`TableSpec.from_settings`).
        source: how messages become rows (`Settings.source`).
        schema_check: registry formats (and json change events) with derived columns: each
            new writer schema (schema block) is fitted to the table's columns; "evolve"
            (``table.evolve``) raises
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
        cdc = source.envelope == "debezium"
        if cdc and not spec.upsert:
            raise ValueError("source.envelope = 'debezium' needs an upsert table")
        if cdc and self._base64:
            raise ValueError("source.envelope = 'debezium' reads vectors as arrays of numbers")
        unknown = sorted(set(source.columns) - set(spec.table_schema.names))
        if unknown:
            raise ValueError(f"source.columns maps unknown table columns: {', '.join(unknown)}")
        required = {
            f.name for f in spec.table_schema if not f.nullable or f.name in spec.primary_key
        }
        columns = [
            plan_column(
                f,
                source.columns.get(f.name),
                required=f.name in required,
                primary_key=f.name in spec.primary_key,
                paths=self._paths,
                decoded_keys=self._keys is not None,
            )
            for f in spec.table_schema
            if f.name not in SOURCE_COLUMNS
        ]
        if cdc:  # unmapped columns read the after image (sink.cdc)
            columns = [
                replace(c, path=("after", c.name))
                if c.kind == "json" and c.name not in source.columns
                else c
                for c in columns
            ]
        # Primary key columns first: a row missing its key reports that before anything else.
        self._columns = sorted(columns, key=lambda c: not c.primary_key)
        self._source_columns = all(n in spec.table_schema.names for n in SOURCE_COLUMNS)
        # Derived columns: new writer schemas are checked against all columns (sink.formats;
        # change events' against the after image's fields, json ones' schema blocks too).
        self._schema_check = (
            SchemaCheck(
                {c.name: Column(c.where, c.type_name) for c in self._columns},
                evolve=schema_check == "evolve",
                row=ROW if cdc else (),
            )
            if schema_check != "off" and (self._records is not None or cdc)
            else None
        )
        # Change events: read as records (JSON ones by orjson), so JSON's Arrow leaves'
        # extra steps (base64 text, float32 range) are the record path's here. A JSON
        # after image's vector (a top-level field no other column reads) is read by the
        # vector scan, the rest of the event by orjson from the stripped text.
        self._cdc_vector: Path | None = None
        if cdc and self._json and vector_fast_path and spec.vector is not None:
            vec = next(c for c in self._columns if c.type_name == "vector")
            shared = [c for c in self._columns if c.kind == "json" and c.path == vec.path]
            if (
                vec.kind == "json"
                and len(vec.path) == 2
                and vec.path[0] == "after"
                and len(shared) == 1
            ):
                self._cdc_vector = vec.path
        self._cdc = (
            Debezium(
                self._columns,
                truncate=source.truncate,
                records=self._records,
                check=self._schema_check,
                vector=(
                    (self._cdc_vector[1], spec.vector.dim)
                    if self._cdc_vector is not None and spec.vector is not None
                    else None
                ),
                scan_simd=scan_simd,
            )
            if cdc
            else None
        )
        self._json_leaves = self._json and self._cdc is None
        json_columns = [c for c in self._columns if c.kind == "json"]
        self._path_columns = {c.path: c for c in reversed(json_columns)}
        # Vector tables in the JSON format take the vector fast paths (`JsonParser`).
        # (Its checks of overlapping paths run for every format: registry formats read
        # record paths the same way.)
        fast_dim = (
            spec.vector.dim
            if vector_fast_path and self._json_leaves and spec.vector is not None
            else None
        )
        self._parser = JsonParser(
            json_columns, base64=self._base64, vector_dim=fast_dim, scan_simd=scan_simd
        )
        self._tombstone_key: ColumnPlan | None = None
        if spec.upsert and len(spec.primary_key) == 1:
            self._tombstone_key = next(c for c in self._columns if c.primary_key)
        self._key_columns = [c for c in self._columns if c.primary_key]

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
        meta = Metadata(messages, offsets, values, topic, partition)
        skipped: list[int] = []
        deletes: list[tuple[int, tuple[Any, ...]]] = []
        truncates = 0
        if self._cdc is not None:
            rows, early = self._decode_changes(
                messages, candidates, payloads, meta, deletes, skipped
            )
            truncates = len(skipped)  # (tombstones are added below)
        else:
            rows, early = self._decode_candidates(candidates, payloads, sizes[candidates], meta)
        dead.update(early)
        dead.update(rows.faults)

        for i in np.flatnonzero(sizes < 0).tolist():
            if self._cdc is not None:  # Debezium's tombstone after a delete: done already
                skipped.append(int(offsets[i]))
            elif self._spec.upsert:
                key, fault = self._tombstone_key_value(messages[i].key())
                if fault is None:
                    deletes.append((i, (key,)))
                else:
                    dead[i] = fault
            elif self._source.tombstones == "skip":
                skipped.append(int(offsets[i]))
            else:
                dead[i] = ("tombstone", "null value on an append table (source.tombstones = dlq)")

        if deletes:
            deletes.sort(key=lambda d: d[0])
        skipped.sort()
        return Decoded(
            batch=self._assemble(rows, deletes, meta),
            dead_letters=[dead_letter(messages[i], *dead[i]) for i in sorted(dead)],
            skipped_offsets=skipped,
            first_offset=int(offsets[0]),
            last_offset=int(offsets[-1]),
            truncates=truncates,
        )

    def _decode_candidates(
        self, candidates: np.ndarray, payloads: list[bytes], sizes: np.ndarray, meta: Metadata
    ) -> tuple[Rows, dict[int, Fault]]:
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
        rows = Rows(index=np.asarray(index, dtype=np.int64))
        if is_object is not None and is_object.false_count:
            not_object = np.flatnonzero(~is_object.to_numpy(zero_copy_only=False))
            rows.fault(not_object, ("not_an_object", "value is JSON null, not an object"))
        for col in self._columns:
            if col.path in column_faults:
                for pos, fault in column_faults[col.path].items():
                    rows.fault((pos,), fault)
            rows.columns[col.name] = self._column(col, rows, leaves, meta)
        return rows, early

    def _decode_changes(
        self,
        messages: Sequence[MessageLike],
        candidates: np.ndarray,
        payloads: list[bytes],
        meta: Metadata,
        deletes: list[tuple[int, tuple[Any, ...]]],
        skipped: list[int],
    ) -> tuple[Rows, dict[int, Fault]]:
        """`_decode_candidates` for change events (`sink.cdc`): the rows the upserts give,
        the faults of the messages that give none; the keys deletes delete are added to
        `deletes` and the offsets of skipped truncates to `skipped`."""
        assert self._cdc is not None
        keys = self._keys

        def key_of(pos: int) -> Any:
            index = int(candidates[pos])
            if keys is not None:
                return meta.decoded_keys(keys)[0][index]
            return messages[index].key()

        split = self._cdc.split(payloads, key_of)
        early: dict[int, Fault] = {
            int(candidates[pos]): fault for pos, fault in split.faults.items()
        }
        for pos in split.skipped:
            offset = int(meta.offsets[int(candidates[pos])])
            skipped.append(offset)
            log.warning(
                "cdc_truncate_skipped",
                topic=messages[0].topic(),
                partition=messages[0].partition(),
                offset=offset,
                hint="a truncate is not applied (source.truncate = 'skip'); rows stay",
            )
        if split.deletes:
            self._delete_keys(candidates[split.deletes], split.keys, deletes, early)
        rows = Rows(index=np.asarray(candidates[split.upserts], dtype=np.int64))
        leaves: dict[Path, pa.Array] = {}
        column_faults: dict[Path, dict[int, Fault]] = {}
        # Every upsert's after is a dict: its fields are read one step deep (one C loop
        # per column, `column_values`), not walked from the envelope per record.
        afters = [r["after"] for r in split.records]
        for path, c in self._path_columns.items():
            describe = f"{c.name!r} ({c.where})"
            if path == self._cdc_vector and split.vectors is not None:
                leaves[path], bad = _scanned_vectors(afters, path[1:], describe, split.vectors)
            elif len(path) == 2 and path[0] == "after":
                leaves[path], bad = record_column(afters, path[1:], c.type_name, describe)
            else:
                leaves[path], bad = record_column(split.records, path, c.type_name, describe)
            column_faults[path] = cast("dict[int, Fault]", bad)
        for col in self._columns:
            if col.kind == "json":
                for pos, fault in column_faults[col.path].items():
                    rows.fault((pos,), fault)
            rows.columns[col.name] = self._column(col, rows, leaves, meta)
        return rows, early

    def _delete_keys(
        self,
        index: np.ndarray,
        keys: list[dict[str, Any]],
        deletes: list[tuple[int, tuple[Any, ...]]],
        faults: dict[int, Fault],
    ) -> None:
        """The keys of change events that delete (message `index`, key by column) into
        `deletes`, each column's value in its type; a key that does not fit is a fault."""
        values: list[list[Any]] = []
        bad: dict[int, Fault] = {}
        for col in self._key_columns:
            describe = f"primary key {col.name!r} ({col.path[-1]} of before or the Kafka key)"
            arr, wrong = to_column([k[col.name] for k in keys], col.type_name, describe)
            for pos, fault in wrong.items():
                bad.setdefault(pos, cast("Fault", fault))
            values.append(arr.to_pylist())
        for pos, i in enumerate(index.tolist()):
            if pos in bad:
                faults[i] = bad[pos]
            else:
                deletes.append((i, tuple(v[pos] for v in values)))

    def _column(
        self, col: ColumnPlan, rows: Rows, leaves: dict[Path, pa.Array], meta: Metadata
    ) -> pa.Array:
        """One column for `rows`, in its canonical type, faulting rows it cannot hold."""
        if col.kind == "json":
            arr = leaves[col.path]
            if col.type_name == "float32" and self._json_leaves:
                check_float32(arr, col, rows, meta)
            elif col.type_name == "binary" and self._json_leaves:
                arr = from_base64(arr, col, rows)
            elif col.type_name == "vector":
                assert self._spec.vector is not None
                dim = self._spec.vector.dim
                if self._base64:
                    arr = from_base64_f32(arr, col, rows, dim)
                check_vectors(
                    arr, col, rows, meta, dim=dim, allow_nan=self._allow_nan, base64=self._base64
                )
        elif col.kind == "none":
            arr = pa.nulls(len(rows.index), col.arrow_type)
        elif col.kind == "bytes":
            arr = bytes_to(meta.bytes_source(col.path).take(rows.index), col, rows)
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

    def _key_column(self, col: ColumnPlan, rows: Rows, meta: Metadata) -> pa.Array:
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
        probe = Rows(index=np.zeros(1, np.int64))
        from_key = replace(col, kind="bytes", path=("@key",))
        arr = bytes_to(pa.array([key], pa.binary()), from_key, probe)
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
        self, rows: Rows, deletes: list[tuple[int, tuple[Any, ...]]], meta: Metadata
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
                if col.primary_key:
                    at = self._key_columns.index(col)
                    extra = pa.array([k[at] for _, k in deletes], col.arrow_type)
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


def _scanned_vectors(
    afters: list[dict[str, Any]],
    path: Path,
    describe: str,
    scanned: tuple[np.ndarray, np.ndarray],
) -> tuple[pa.Array, dict[int, Any]]:
    """The vector column of change events' after images (`sink.cdc.Split.vectors`): the
    rows the vector scan read from its matrix, the others by the record path (with their
    faults, by row)."""
    at, matrix = scanned
    n, dim = len(afters), matrix.shape[1]
    offsets = np.arange(0, (len(at) + 1) * dim, dim, dtype=np.int32)
    read = pa.ListArray.from_arrays(
        pa.array(offsets), pa.array(matrix.ravel()), type=pa.list_(pa.float32())
    )
    if len(at) == n:
        return read, {}
    others = np.ones(n, bool)
    others[at] = False
    rest = np.flatnonzero(others)
    arr, bad = record_column([afters[i] for i in rest.tolist()], path, "vector", describe)
    # The rows in order: row i of the result is row order[i] of read + arr.
    order = np.empty(n, np.int64)
    order[at] = np.arange(len(at))
    order[rest] = len(at) + np.arange(len(rest))
    merged = take(pa.concat_arrays([read, arr.cast(read.type)]), order)
    return merged, {int(rest[k]): f for k, f in bad.items()}
