"""Debezium change events (``source.envelope = "debezium"``) into upserts and deletes.

`sink.decode.Decoder` hands `Debezium.split` the payloads of a batch (values of an
allowed size, tombstones left out) and gets back which of them upsert a row, which delete
a key, which are skipped, and the dead letters of the rest. Each payload is read on its
own (its fate depends on its bytes and its Kafka key alone, never on its neighbours); the
upserting events' columns are then built by the registry formats' record path
(`sink.formats.record_column`), in bulk per column.

In json, the table's vector (a top-level field of after, ``vector``) is first read by
`sink.vector_scan` (at ``after.<field>``, or ``payload.after.<field>`` in the JSON
converter's compact wrapper) into one float32 matrix, and the event by orjson from the
stripped text (the vector null); `Split.vectors` says which upserts' vectors it holds. The
scan reads a vector only when its float32 values are those orjson's doubles round to (it
leaves out components whose double is halfway between two float32 values, the integer -0,
NaN, infinities, other lengths: see there), and a stripped text is used
only when orjson takes it and it is wrapped as the scan's path said; any other event is
read whole as before. So every event's fate is the same scanned or not, alone or in any
batch (tests/unit/test_decode_metamorphic.py decodes each way).

A change event is Debezium's envelope, ``{"before", "after", "source", "op", "ts_ms",
"transaction"}``: in the ``json`` format with or without the JSON converter's wrapper
``{"schema": ..., "payload": <envelope>}`` (told apart per message), in a registry format
the record the value decodes to. By ``op``:

    c, r, u   upsert the after image (``after`` null or missing: ``cdc_missing_after``)
    d         delete the primary key found in ``before`` (every key field non-null), else
              in the Kafka key (a JSON object, wrapped or not, or a record key decoded with
              ``source.key_format``, holding the key fields); neither: ``cdc_missing_key``
    t         truncate: never applied (a table-wide event has no order against the other
              partitions); ``source.truncate = "skip"`` skips its offset (the decoder logs
              ``cdc_truncate_skipped`` and counts it in `sink.decoded.Decoded.truncates`,
              the loop's ``lance_sink_cdc_truncates_total``), ``"dlq"`` makes it a
              ``cdc_truncate`` dead letter
    missing   ``cdc_missing_op``; any other op (``m`` included): ``cdc_unknown_op``

Paths: ``$.a.b`` in ``source.columns`` addresses the envelope (``$.op``, ``$.ts_ms``,
``$.source.ts_ms``, ``$.source.lsn``, ``$.after.x``); an unmapped column reads the field of
its name in ``after`` (``$.after.<column>``). A primary key column reads a top-level field
of ``after``, so that a delete finds the same field in ``before`` and in the key.

Logical types: each field of ``after`` and ``before`` (and of a wrapped Kafka key) that a
column reads is converted for the column's type before the column is built, by the logical
type its converter's schema names: the JSON converter's schema block (Connect schema
names, `LOGICAL`), once per distinct block; in a registry format the writer schema, once
per schema id (`_WRITER_LOGICAL`: Avro's ``connect.name``, JSON Schema's ``title``,
Protobuf's messages of `_PROTO_LOGICAL`). Without a schema block the values are read as
they are (docs/formats.md, "Change data capture").

Derived columns (``table.columns`` left out, `sink.formats.derive`): the fields of the
envelope schema's after image (`ROW`), typed by their logical types (`DERIVED`,
`row_leaves`; a schema block's by `connect_leaves`). With a `SchemaCheck` each new writer
schema (json: schema block) is fitted to the table's columns, and `split` raises
`sink.formats.SchemaEvolution` when ``table.evolve`` must add one.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import decimal
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast

import numpy as np
import orjson

from sink.decode_plan import ColumnPlan, Fault
from sink.formats import RecordFormat, SchemaCheck, check_schema_block, check_writer_schemas
from sink.formats.leaves import Leaf
from sink.json_values import is_utf8, loads, show, utf8_error
from sink.vector_scan import scan

__all__ = [
    "DERIVED",
    "LOGICAL",
    "OPS",
    "ROW",
    "Debezium",
    "Split",
    "connect_leaves",
    "logical_converter",
    "logical_value",
    "row_leaves",
    "schema_logical",
]

#: The ops of a change event: create, snapshot read, update, delete, truncate.
OPS: Final = frozenset({"c", "r", "u", "d", "t"})

_DAY_MS: Final = 86_400_000

#: The Connect schema names whose values are converted, by what they hold.
LOGICAL: Final = frozenset(
    {
        "io.debezium.time.Date",  # int32 days since the epoch
        "io.debezium.time.Time",  # int32 ms past midnight
        "io.debezium.time.MicroTime",  # int64 us past midnight
        "io.debezium.time.NanoTime",  # int64 ns past midnight
        "io.debezium.time.Timestamp",  # int64 ms since the epoch, no zone
        "io.debezium.time.MicroTimestamp",  # int64 us since the epoch, no zone
        "io.debezium.time.NanoTimestamp",  # int64 ns since the epoch, no zone
        "io.debezium.time.ZonedTimestamp",  # ISO-8601 text with an offset
        "org.apache.kafka.connect.data.Date",  # int32 days (Connect's own)
        "org.apache.kafka.connect.data.Time",  # int32 ms past midnight (Connect's own)
        "org.apache.kafka.connect.data.Timestamp",  # int64 ms (Connect's own)
        "org.apache.kafka.connect.data.Decimal",  # base64 two's complement, big-endian
        "io.debezium.data.VariableScaleDecimal",  # {"scale": n, "value": base64}
    }
)
#: The messages Confluent's Protobuf converter writes Connect's logical types as (it keeps
#: no Connect schema name: Debezium's own types, ``io.debezium.time.*``, are plain ints).
_PROTO_LOGICAL: Final = frozenset(
    {
        "confluent.type.Decimal",  # {value: unscaled big-endian bytes, precision, scale}
        "google.type.Date",  # {year, month, day}
        "google.type.TimeOfDay",  # {hours, minutes, seconds, nanos}
    }
)

#: Per unit: how many of them make a millisecond (timestamp columns are ms).
_PER_MS: Final = {
    "io.debezium.time.Time": 1,
    "io.debezium.time.MicroTime": 1_000,
    "io.debezium.time.NanoTime": 1_000_000,
    "io.debezium.time.Timestamp": 1,
    "io.debezium.time.MicroTimestamp": 1_000,
    "io.debezium.time.NanoTimestamp": 1_000_000,
    "org.apache.kafka.connect.data.Time": 1,
    "org.apache.kafka.connect.data.Timestamp": 1,
}
_TIMES: Final = frozenset(
    {
        "io.debezium.time.Time",
        "io.debezium.time.MicroTime",
        "io.debezium.time.NanoTime",
        "org.apache.kafka.connect.data.Time",
    }
)
_DATES: Final = frozenset({"io.debezium.time.Date", "org.apache.kafka.connect.data.Date"})
_DECIMALS: Final = frozenset(
    {"org.apache.kafka.connect.data.Decimal", "io.debezium.data.VariableScaleDecimal"}
)
#: The column type a row field of each logical type derives (``table.columns`` left out):
#: what `logical_value` makes of it best.
DERIVED: Final = {
    **dict.fromkeys(
        (
            "io.debezium.time.Date",
            "io.debezium.time.Timestamp",
            "io.debezium.time.MicroTimestamp",
            "io.debezium.time.NanoTimestamp",
            "io.debezium.time.ZonedTimestamp",
            "org.apache.kafka.connect.data.Date",
            "org.apache.kafka.connect.data.Timestamp",
            "google.type.Date",
        ),
        "timestamp",
    ),
    **dict.fromkeys(
        (
            "io.debezium.time.Time",
            "io.debezium.time.MicroTime",
            "io.debezium.time.NanoTime",
            "org.apache.kafka.connect.data.Time",
            "google.type.TimeOfDay",
        ),
        "string",  # a time of day: ISO text
    ),
    **dict.fromkeys(
        (
            "org.apache.kafka.connect.data.Decimal",
            "io.debezium.data.VariableScaleDecimal",
            "confluent.type.Decimal",
        ),
        "float64",
    ),
}
#: The record path of the row image whose fields derived columns read.
ROW: Final = ("after",)
_EPOCH: Final = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
#: Bytes of the Confluent framing that name a value's writer schema.
_HEADER_BYTES: Final = 5
#: How the JSON converter's compact wrapper starts, and what separates its two parts.
_WRAPPED: Final = b'{"schema":'
_PAYLOAD: Final = b',"payload":'
#: Schema blocks whose logical types are kept (a table has one per version): enough for
#: the tables of a topic pattern; beyond, the map starts over.
_SCHEMAS_KEPT: Final = 256

#: A field's Connect schema name and parameters.
Logical = tuple[str, dict[str, Any]]


@dataclass(slots=True)
class Split:
    """What a batch's change events do, by payload position (ascending in each list).

    Attributes:
        upserts: positions of the events that upsert their after image.
        records: their envelopes (logical types of the fields read converted), aligned.
        deletes: positions of the events that delete a key.
        keys: the key each deletes, primary key column -> value (converted), aligned.
        skipped: positions of the truncates skipped (``source.truncate = "skip"``).
        faults: the dead letters' (reason, detail) by position.
        vectors: (json, with ``vector``) the upserts whose after image's vector the scan
            read: their indices in `upserts` (ascending) and their vectors (a float32
            matrix, row by row); their records hold null in its place.
    """

    upserts: list[int] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    deletes: list[int] = field(default_factory=list)
    keys: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    faults: dict[int, Fault] = field(default_factory=dict)
    vectors: tuple[np.ndarray, np.ndarray] | None = None


class Debezium:
    """Reads change events for one table's columns; stateless, shared by decode threads.

    Args:
        columns: the decoder's column plans (unmapped columns already read
            ``("after", name)``).
        truncate: ``source.truncate``.
        records: the registry format the events are encoded in, or None for JSON.
        check: derived columns: what each new writer schema is checked against (its
            leaves as `writer_leaves` gives them, fitted with ``row = ROW``), raising
            `sink.formats.SchemaEvolution` from `split` when the table must evolve.
        vector: (json) the after image's field holding the table's vector (a top-level
            field, read by no other column) and its dimension: read by `sink.vector_scan`
            (`Split.vectors`); None parses every event whole with orjson.
        scan_simd: let the scan read short decimals with its SSSE3 reader.

    Raises:
        ValueError: a primary key column that does not read a top-level field of after.
    """

    def __init__(
        self,
        columns: Sequence[ColumnPlan],
        *,
        truncate: Literal["skip", "dlq"],
        records: RecordFormat | None,
        check: SchemaCheck | None = None,
        vector: tuple[str, int] | None = None,
        scan_simd: bool = True,
    ) -> None:
        self._truncate = truncate
        self._records = records
        self._check = check
        self._vector = vector if records is None else None
        self._scan_simd = scan_simd
        #: Logical types of the row fields per writer schema (registry framing bytes).
        self._by_schema: dict[bytes, dict[str, Logical]] = {}
        #: Logical types of the row fields per JSON converter schema block (its bytes).
        self._schemas: dict[bytes, dict[str, Logical]] = {}
        #: The schema block read last and its logical types (`_split_wrapper`).
        self._last_block: tuple[bytes, dict[str, Logical]] | None = None
        #: The field converters per logical type map (`_plan`), by its id.
        self._plans: dict[int, tuple[dict[str, Logical], list[tuple[str, Any]]]] = {}
        self._after: dict[str, str] = {}
        for c in columns:
            if c.kind == "json" and len(c.path) == 2 and c.path[0] == "after":
                self._after.setdefault(c.path[1], c.type_name)
        self._key: list[tuple[str, str, str]] = []  # (column, after field, type name)
        for c in columns:
            if not c.primary_key:
                continue
            if c.kind != "json" or len(c.path) != 2 or c.path[0] != "after":
                raise ValueError(
                    f"primary key column {c.name!r} reads {c.where}; with source.envelope = "
                    "'debezium' it must read a top-level field of after ($.after.<field>)"
                )
            self._key.append((c.name, c.path[1], c.type_name))

    def writer_leaves(self, payload: bytes) -> list[Leaf] | None:
        """The leaves of `payload`'s writer schema (its format's), the row fields of a
        logical type as one leaf each of the type they derive (`row_leaves`); None when the
        format cannot tell."""
        assert self._records is not None
        leaves = self._records.writer_leaves(payload)
        if leaves is None:
            return None
        return row_leaves(leaves, self._writer_logical(payload) or {})

    def split(self, payloads: Sequence[bytes], key_of: Callable[[int], Any]) -> Split:
        """Sort the change events `payloads` into upserts, deletes, skips and faults.

        Args:
            payloads: the values (no tombstones).
            key_of: the Kafka key of the payload at a position: the raw bytes, or the
                decoded key record with ``source.key_format``; asked for deletes only.

        Raises:
            RegistryUnavailable: from a registry format.
            SchemaEvolution: (derived columns, ``table.evolve``) a writer schema has row
                fields the table lacks.
        """
        out = Split()
        positions, events, logicals, faults, scanned = self._events(payloads)
        if self._check is not None and self._records is not None:
            check_writer_schemas(self, [payloads[p] for p in positions], self._check)
        out.faults.update(faults)
        vector_at: list[int] = []  # indices in upserts of the scanned vectors
        vector_row: list[int] = []  # their rows in the scans' matrices, stacked
        plan_of: dict[str, Logical] | None = None  # (the events of a batch share a schema)
        plan: list[tuple[str, Callable[[Any], Any]]] = []
        for pos, event, logical in zip(positions, events, logicals, strict=True):
            if type(event) is not dict:
                what = "JSON null" if event is None else show(event)
                out.faults[pos] = ("not_an_object", f"value is {what}, not an object")
                continue
            op = event.get("op")
            if op is None:
                out.faults[pos] = (
                    "cdc_missing_op",
                    "value has no op: not a Debezium change event ($.op is null or missing)",
                )
            elif op in ("c", "r", "u") and type(op) is str:
                after = event.get("after")
                if type(after) is not dict:
                    out.faults[pos] = (
                        "cdc_missing_after",
                        (
                            f"op {op!r} without an after image ($.after is "
                            f"{'null or missing' if after is None else show(after)})"
                        ),
                    )
                    continue
                if logical:
                    if logical is not plan_of:
                        plan_of, plan = logical, self._plan(logical)
                    for name, convert in plan:
                        if name in after:
                            after[name] = convert(after[name])
                if scanned is not None and pos in scanned[0]:
                    vector_at.append(len(out.upserts))
                    vector_row.append(scanned[0][pos])
                out.upserts.append(pos)
                out.records.append(event)
            elif op == "d" and type(op) is str:
                key = self._delete_key(event.get("before"), logical, pos, key_of)
                if isinstance(key, dict):
                    out.deletes.append(pos)
                    out.keys.append(key)
                else:
                    out.faults[pos] = ("cdc_missing_key", key)
            elif op == "t" and type(op) is str:
                if self._truncate == "skip":
                    out.skipped.append(pos)
                else:
                    out.faults[pos] = (
                        "cdc_truncate",
                        "truncate event (op 't'): not applied, source.truncate = 'dlq'",
                    )
            else:
                out.faults[pos] = (
                    "cdc_unknown_op",
                    f"op is {show(op)}; a change event's op is c, r, u, d or t",
                )
        if vector_at:
            assert scanned is not None
            matrix, rows = scanned[1], np.asarray(vector_row, np.int64)
            if len(rows) != len(matrix) or not np.array_equal(rows, np.arange(len(rows))):
                matrix = matrix[rows]
            out.vectors = (np.asarray(vector_at, np.int64), matrix)
        return out

    def _writer_logical(self, payload: bytes) -> dict[str, Logical] | None:
        """The logical types of the row fields of `payload`'s writer schema, once per
        schema id: what Kafka Connect's converter for the format writes (Avro:
        ``connect.name``; JSON Schema: ``title``; Protobuf: the message types of
        `_PROTO_LOGICAL`)."""
        writer_schema = getattr(self._records, "writer_schema", None)
        if writer_schema is None:
            return None
        # Framed payloads by their schema id; a plain Protobuf message (a descriptor set,
        # one type) never starts with a zero byte (no field number 0): one map for all.
        header = payload[:_HEADER_BYTES] if payload[:1] == b"\x00" else b""
        if header not in self._by_schema:
            walk = _WRITER_LOGICAL.get(getattr(self._records, "name", ""), _avro_logical)
            # A race computes the same map twice; either is kept.
            self._by_schema[header] = walk(writer_schema(payload))
        return self._by_schema[header]

    def _events(
        self, payloads: Sequence[bytes]
    ) -> tuple[
        list[int],
        list[Any],
        list[dict[str, Logical] | None],
        dict[int, Fault],
        tuple[dict[int, int], np.ndarray] | None,
    ]:
        """Each payload decoded: the positions that decoded, their envelopes (the JSON
        converter's wrapper taken off), the logical types of their row fields (None: no
        schema), the other payloads' faults, and (json, with a vector) the events whose
        vector the scan read: their rows in a float32 matrix by position, and the matrix
        (`_scan`)."""
        if self._records is not None:
            positions, records, record_faults = self._records.records(payloads)
            writers = [self._writer_logical(payloads[p]) for p in positions]
            faults = {p: cast("Fault", f) for p, f in record_faults.items()}
            return positions, records, writers, faults, None
        positions = []
        events: list[Any] = []
        logicals: list[dict[str, Logical] | None] = []
        faults = {}
        scanned = self._scan(payloads) if self._vector is not None and payloads else None
        read: dict[int, int] = {}
        for pos, payload in enumerate(payloads):
            if scanned is not None and pos in scanned[0]:
                row, wrapped, stripped = scanned[0][pos]
                # The stripped text is read as the event only if it is read the way the
                # scan's path took it (wrapped or not) and orjson takes it; else the value
                # is read whole, as if not scanned (a fault then names the value sent).
                decoded = self._decode(stripped, strict=True)
                if decoded is not None and decoded[2] == wrapped and decoded[3] is None:
                    read[pos] = row
                    positions.append(pos)
                    events.append(decoded[0])
                    logicals.append(decoded[1])
                    continue
            whole = self._decode(payload, strict=False)
            assert whole is not None  # (not strict: a value orjson refuses is read again)
            if whole[3] is not None:
                faults[pos] = whole[3]
                continue
            positions.append(pos)
            events.append(whole[0])
            logicals.append(whole[1])
        found = (read, scanned[1]) if scanned is not None else None
        return positions, events, logicals, faults, found

    def _scan(
        self, payloads: Sequence[bytes]
    ) -> tuple[dict[int, tuple[int, bool, bytes]], np.ndarray]:
        """The vectors `sink.vector_scan` reads at the after image's vector field: of an
        event in the JSON converter's compact wrapper (it starts ``{"schema":``) at
        ``payload.after.<field>``, of any other at ``after.<field>``. Returns, by position,
        the row of each vector read in the matrix, whether its path was the wrapped one,
        and its stripped text; and the matrix (the two scans' stacked)."""
        assert self._vector is not None
        name, dim = self._vector
        found: dict[int, tuple[int, bool, bytes]] = {}
        matrices: list[np.ndarray] = []
        groups: list[list[int]] = [[], []]
        for pos, payload in enumerate(payloads):
            groups[payload.startswith(_WRAPPED)].append(pos)
        done = 0
        for wrapped, group in ((False, groups[0]), (True, groups[1])):
            if not group:
                continue
            path = ("payload", "after", name) if wrapped else ("after", name)
            texts = payloads if len(group) == len(payloads) else [payloads[p] for p in group]
            where, matrix, stripped = scan(list(texts), path, dim, simd=self._scan_simd)
            for row, (at, text) in enumerate(zip(where.tolist(), stripped, strict=True)):
                found[group[at]] = (done + row, wrapped, text)
            done += len(where)
            matrices.append(matrix)
        if not matrices:
            return found, np.zeros((0, dim), np.float32)
        return found, matrices[0] if len(matrices) == 1 else np.concatenate(matrices)

    def _decode(
        self, payload: bytes, *, strict: bool
    ) -> tuple[Any, dict[str, Logical] | None, bool, Fault | None] | None:
        """One value as a change event: the envelope (the JSON converter's wrapper taken
        off), the logical types of its row fields (None: no schema), whether it was
        wrapped, and its fault (then nothing else). `strict`: None when orjson refuses the
        value (or the wrapper's payload), not read again by the JSON format's reader."""
        split = self._split_wrapper(payload)
        if split is not None:
            return split[1], split[0], True, None
        try:
            value = orjson.loads(payload)
        except orjson.JSONDecodeError:
            if strict:
                return None
            value, fault = _load(payload)
            if fault is not None:
                return None, None, False, fault
        if type(value) is dict and "payload" in value and "schema" in value and len(value) == 2:
            if self._check is not None:
                self._check_block(orjson.dumps(value["schema"]), value["schema"])
            return value["payload"], _envelope_logical(value["schema"]), True, None
        return value, None, False, None

    def _split_wrapper(self, payload: bytes) -> tuple[dict[str, Logical], Any] | None:
        """A wrapped event as the JSON converter writes it, ``{"schema":S,"payload":P}``
        compact, read without parsing S again when it was seen before (S is the same for
        every event of a table version, and most of the bytes): the logical types of S and
        P parsed. None when the value is not in exactly that form, or S or P does not parse
        alone; the caller then parses the whole value, to the same result.

        The cut is right: S is a JSON object, and no proper prefix of an object's text is a
        whole JSON value, so only the first ``,"payload":`` after S's closing brace leaves
        an S that parses (if one inside S did, S would parse cut short)."""
        if not payload.startswith(_WRAPPED) or not payload.endswith(b"}"):
            return None
        last = self._last_block
        if last is not None:
            # The block of the event before, compared in place (no search, no hash): the
            # same cut, since no proper prefix of a block that parsed, followed by the
            # separator, parses (the block would then not have parsed).
            block, known = last
            end = len(_WRAPPED) + len(block)
            if payload.startswith(block, len(_WRAPPED)) and payload.startswith(_PAYLOAD, end):
                try:
                    return known, orjson.loads(payload[end + len(_PAYLOAD) : -1])
                except orjson.JSONDecodeError:
                    return None
        cut = payload.find(_PAYLOAD, len(_WRAPPED))
        while cut > 0:
            schema = payload[len(_WRAPPED) : cut]
            logical = self._schemas.get(schema)
            if logical is None:
                try:
                    parsed = orjson.loads(schema)
                except orjson.JSONDecodeError:
                    cut = payload.find(_PAYLOAD, cut + 1)
                    continue
                self._check_block(schema, parsed)
                logical = _envelope_logical(parsed)
                if len(self._schemas) >= _SCHEMAS_KEPT:
                    self._schemas.clear()  # (a topic of many table versions: start over)
                self._schemas[schema] = logical
            self._last_block = (schema, logical)
            try:
                return logical, orjson.loads(payload[cut + len(_PAYLOAD) : -1])
            except orjson.JSONDecodeError:
                return None
        return None

    def _check_block(self, schema: bytes, parsed: Any) -> None:
        """Derived columns: fit a schema block not seen yet (`schema`: its bytes) to the
        table's columns (`sink.formats.check_schema_block`, by a digest of its bytes)."""
        if self._check is None:
            return
        key = hashlib.blake2b(schema, digest_size=16).digest()
        if key not in self._check.checked:
            check_schema_block(key, connect_leaves(parsed), self._check)

    def _plan(self, logical: dict[str, Logical]) -> list[tuple[str, Callable[[Any], Any]]]:
        """The converters (`logical_converter`) of the fields columns read that have a
        logical type in `logical`: made once per schema (`logical` is kept per schema
        block or writer schema; a map parsed with its whole event gets its own)."""
        kept = self._plans.get(id(logical))
        if kept is not None and kept[0] is logical:
            return kept[1]
        plan = [
            (name, logical_converter(*logical[name], type_name))
            for name, type_name in self._after.items()
            if name in logical
        ]
        if len(self._plans) >= 2 * _SCHEMAS_KEPT:
            self._plans.clear()
        self._plans[id(logical)] = (logical, plan)  # (holding `logical`: its id stays its)
        return plan

    def _delete_key(
        self,
        before: Any,
        logical: dict[str, Logical] | None,
        pos: int,
        key_of: Callable[[int], Any],
    ) -> dict[str, Any] | str:
        """The key an op d deletes (column -> value), or why there is none."""
        found = self._key_in(before, logical)
        if found is not None:
            return found
        raw = key_of(pos)
        key_record: Any = raw
        key_logical: dict[str, Logical] | None = None
        if isinstance(raw, bytes):
            try:
                key_record = orjson.loads(raw)
            except orjson.JSONDecodeError:
                key_record, fault = _load(raw)
                if fault is not None:
                    key_record = None
        if (
            type(key_record) is dict
            and "payload" in key_record
            and "schema" in key_record
            and len(key_record) == 2
        ):
            key_logical = _struct_logical(key_record["schema"])
            key_record = key_record["payload"]
        found = self._key_in(key_record, key_logical)
        if found is not None:
            return found
        fields = ", ".join(f for _, f, _ in self._key)
        return (
            f"op 'd' without its primary key ({fields}): before holds "
            f"{_holds(before)} and the Kafka key {_holds(key_record, raw is None)}"
        )

    def _key_in(self, image: Any, logical: dict[str, Logical] | None) -> dict[str, Any] | None:
        """The primary key in `image` (column -> value), None unless it has every field."""
        if type(image) is not dict:
            return None
        key: dict[str, Any] = {}
        for column, name, type_name in self._key:
            value = image.get(name)
            if value is None:
                return None
            if logical and name in logical:
                value = logical_value(*logical[name], value, type_name)
            key[column] = value
        return key


def _holds(image: Any, missing: bool = False) -> str:
    if missing:
        return "is missing"
    if image is None:
        return "null"
    if type(image) is dict:
        return "not all of them"
    return f"{show(image)}, not an object"


def _load(payload: bytes) -> tuple[Any, Fault | None]:
    """A value orjson refused, read by the JSON format's rules (`sink.json_values.loads`:
    the non-standard number literals, integers beyond 64 bits), or its fault."""
    if not is_utf8(payload):
        return None, ("invalid_utf8", "value is not UTF-8" + utf8_error(payload))
    try:
        return loads(payload), None
    except RecursionError:
        return None, ("invalid_json", "value is not JSON, or nests too deeply to read")
    except ValueError as exc:
        return None, ("invalid_json", f"value is not JSON: {exc}")


def _struct_logical(schema: Any) -> dict[str, Logical]:
    """The fields with a logical type (`LOGICAL`) of a Connect struct schema, by name."""
    out: dict[str, Logical] = {}
    if type(schema) is not dict or type(schema.get("fields")) is not list:
        return out
    for f in schema["fields"]:
        if type(f) is dict and f.get("name") in LOGICAL and type(f.get("field")) is str:
            params = f.get("parameters")
            out[f["field"]] = (f["name"], params if type(params) is dict else {})
    return out


def _envelope_logical(schema: Any) -> dict[str, Logical]:
    """The logical types of the after image (else before: the same row schema) in the JSON
    converter's schema of an envelope."""
    if type(schema) is not dict or type(schema.get("fields")) is not list:
        return {}
    rows = {
        f.get("field"): f
        for f in schema["fields"]
        if type(f) is dict and f.get("field") in ("after", "before")
    }
    return _struct_logical(rows.get("after") or rows.get("before"))


def _avro_logical(schema: Any) -> dict[str, Logical]:
    """The logical types (``connect.name``, ``connect.parameters``) of the row fields of a
    parsed Avro envelope schema (the record of after or before; by name if referenced)."""
    if type(schema) is not dict or type(schema.get("fields")) is not list:
        return {}
    named = schema.get("__named_schemas") or {}
    row: Any = None
    for f in schema["fields"]:
        if type(f) is dict and f.get("name") in ("after", "before"):
            kinds: Any = f.get("type")
            for kind in kinds if type(kinds) is list else [kinds]:
                branch = named.get(kind, kind) if type(kind) is str else kind
                if type(branch) is dict and branch.get("type") == "record":
                    row = branch
    out: dict[str, Logical] = {}
    for f in (row or {}).get("fields", ()):
        types: Any = f.get("type")
        for kind in types if type(types) is list else [types]:
            if type(kind) is dict and kind.get("connect.name") in LOGICAL:
                params = kind.get("connect.parameters")
                out[f["name"]] = (kind["connect.name"], params if type(params) is dict else {})
    return out


def _json_branch(node: Any) -> Any:
    """A JSON Schema node without the ``oneOf`` (or ``anyOf``) with null that Kafka
    Connect's converter wraps an optional field in: the branch that is not null."""
    if type(node) is dict:
        for key in ("oneOf", "anyOf"):
            if type(node.get(key)) is list:
                for branch in node[key]:
                    if type(branch) is dict and branch.get("type") != "null":
                        return branch
    return node


def _json_schema_logical(schema: Any) -> dict[str, Logical]:
    """The logical types (``title``, ``connect.parameters``) of the row fields of a parsed
    JSON Schema envelope as Kafka Connect's JSON Schema converter writes it (the object
    of after, else before)."""
    root = _json_branch(schema)
    if type(root) is not dict or type(root.get("properties")) is not dict:
        return {}
    props = root["properties"]
    row: Any = None
    for which in ("after", "before"):
        branch = _json_branch(props.get(which))
        if type(branch) is dict and type(branch.get("properties")) is dict:
            row = branch
            break
    out: dict[str, Logical] = {}
    for name, node in (row or {}).get("properties", {}).items():
        kind = _json_branch(node)
        if type(kind) is dict and kind.get("title") in LOGICAL:
            params = kind.get("connect.parameters")
            out[name] = (kind["title"], params if type(params) is dict else {})
    return out


def _proto_logical(desc: Any) -> dict[str, Logical]:
    """The row fields of a Protobuf envelope's descriptor (the message type of after, else
    before) whose message type is one of `_PROTO_LOGICAL`."""
    fields = getattr(desc, "fields_by_name", None)
    if not fields:
        return {}
    row: Any = None
    for which in ("after", "before"):
        found = fields.get(which)
        if found is not None and found.message_type is not None:
            row = found.message_type
            break
    out: dict[str, Logical] = {}
    for f in row.fields if row is not None else ():
        if f.message_type is not None and f.message_type.full_name in _PROTO_LOGICAL:
            out[f.name] = (f.message_type.full_name, {})
    return out


_WRITER_LOGICAL: Final[dict[str, Callable[[Any], dict[str, Logical]]]] = {
    "Avro": _avro_logical,
    "JSON Schema": _json_schema_logical,
    "Protobuf": _proto_logical,
}


#: Leaf column types of the Connect schema types (`connect_leaves`).
_CONNECT_TYPES: Final = {
    "int8": "int32",
    "int16": "int32",
    "int32": "int32",
    "int64": "int64",
    "float32": "float32",
    "float64": "float64",
    "boolean": "bool",
    "string": "string",
    "bytes": "binary",
}


def connect_leaves(schema: Any) -> list[Leaf]:
    """The leaves (`sink.formats.leaves`) of a JSON converter schema block of an envelope:
    every field by its path (structs walked; arrays and maps have no column type), the row
    fields of a logical type as they derive (`row_leaves`)."""
    return row_leaves(list(_connect_leaves(schema, ())), _envelope_logical(schema))


def _connect_leaves(schema: Any, path: tuple[str, ...]) -> Iterator[Leaf]:
    if type(schema) is not dict:
        return
    if schema.get("type") == "struct":
        for f in schema.get("fields") or ():
            if type(f) is dict and type(f.get("field")) is str:
                yield from _connect_leaves(f, (*path, f["field"]))
        return
    if path:
        yield path, _CONNECT_TYPES.get(str(schema.get("type")))


#: `_WRITER_LOGICAL` by ``source.format``.
_FORMATS: Final = {"avro": "Avro", "json_schema": "JSON Schema", "protobuf": "Protobuf"}


def schema_logical(fmt: str, schema: Any) -> dict[str, Logical]:
    """The logical types of the row fields of an envelope schema in the registry format
    `fmt` (``source.format``): a parsed Avro or JSON Schema schema, a Protobuf message
    descriptor."""
    return _WRITER_LOGICAL[_FORMATS[fmt]](schema)


def row_leaves(leaves: list[Leaf], logical: dict[str, Logical]) -> list[Leaf]:
    """An envelope schema's leaves (`sink.formats.leaves`) with each row field (of before
    and after) of a logical type (`logical`, by field) as one leaf of the column type it
    derives (`DERIVED`; None: no column type), in place of what its plain type gives (a
    Protobuf message's own fields, an Avro int)."""
    out: list[Leaf] = []
    done: set[tuple[str, ...]] = set()
    for path, type_name in leaves:
        if len(path) >= 2 and path[0] in ("after", "before") and path[1] in logical:
            field = path[:2]
            if field not in done:
                done.add(field)
                out.append((field, DERIVED.get(logical[path[1]][0], type_name)))
            continue
        out.append((path, type_name))
    return out


def _from_proto(schema_name: str, raw: Any) -> tuple[str, Any]:
    """A logical value of a `_PROTO_LOGICAL` message (a record) as the Connect type it
    was written from holds it; a record that is not one is left as it is."""
    if type(raw) is not dict:
        return schema_name, raw
    try:
        if schema_name == "google.type.Date":
            days = (dt.date(raw["year"], raw["month"], raw["day"]) - dt.date(1970, 1, 1)).days
            return "org.apache.kafka.connect.data.Date", days
        if schema_name == "google.type.TimeOfDay":
            seconds = (raw["hours"] * 60 + raw["minutes"]) * 60 + raw["seconds"]
            return "io.debezium.time.NanoTime", seconds * 1_000_000_000 + raw["nanos"]
        if schema_name == "confluent.type.Decimal":
            scaled = {"scale": raw["scale"], "value": raw["value"]}
            return "io.debezium.data.VariableScaleDecimal", scaled
    except (KeyError, TypeError, ValueError):
        pass  # (year 0: a date without a year; the column refuses the record)
    return schema_name, raw


def logical_value(schema_name: str, params: dict[str, Any], raw: Any, type_name: str) -> Any:
    """A value of a Connect logical type as the column of `type_name` takes it.

    Temporal values go into timestamp columns as epoch milliseconds (floored: a
    sub-millisecond part before 1970 counts down), a time of day as that time on
    1970-01-01; into string columns as ISO-8601 text; into integer columns as they are (the
    source's unit). Decimals become `decimal.Decimal` (float columns take their nearest
    double, string columns their plain text, integer columns an integral one). A value of
    another kind than its logical type holds is left as it is (its column says what is
    wrong with it).
    """
    if raw is None:
        return None
    if schema_name in _PROTO_LOGICAL:
        schema_name, raw = _from_proto(schema_name, raw)
        if schema_name in _PROTO_LOGICAL:
            return raw
    if schema_name in _DECIMALS:
        number = _decimal(schema_name, params, raw)
        if not isinstance(number, decimal.Decimal):
            return number
        if type_name == "string":
            return format(number, "f")
        if type_name in ("int32", "int64") and number == number.to_integral_value():
            return int(number)
        return number
    if type(raw) is not int or type_name not in ("timestamp", "string"):
        return raw  # ZonedTimestamp text; integer columns take the source's unit
    if schema_name in _DATES:
        if type_name == "timestamp":
            return raw * _DAY_MS
        try:
            return (dt.date(1970, 1, 1) + dt.timedelta(days=raw)).isoformat()
        except OverflowError:
            return raw
    per_ms = _PER_MS.get(schema_name)
    if per_ms is None:
        return raw  # a ZonedTimestamp that is not text: the column says what is wrong
    if type_name == "timestamp":
        return raw // per_ms
    try:
        stamp = _EPOCH + dt.timedelta(microseconds=raw * 1000 // per_ms)
    except OverflowError:
        return raw
    if schema_name in _TIMES:
        return stamp.time().isoformat()
    return stamp.replace(tzinfo=None).isoformat()


def logical_converter(
    schema_name: str, params: dict[str, Any], type_name: str
) -> Callable[[Any], Any]:
    """`logical_value` of one field's logical type for a column of `type_name`, as a
    function of the raw value: its common cases without the general path's dispatch
    (integer dates and times into timestamp columns; Connect Decimals of a short unscaled
    integer and scale into float64 columns, as the double nearest the decimal, as the
    general path's Decimal becomes)."""

    def general(raw: Any) -> Any:
        return logical_value(schema_name, params, raw, type_name)

    if type_name == "timestamp" and schema_name in _DATES:

        def days(raw: Any) -> Any:
            return raw * _DAY_MS if type(raw) is int else general(raw)

        return days
    if type_name == "timestamp" and schema_name in _PER_MS:
        per_ms = _PER_MS[schema_name]

        def units(raw: Any) -> Any:
            return raw // per_ms if type(raw) is int else general(raw)

        return units
    if type_name == "float64" and schema_name == "org.apache.kafka.connect.data.Decimal":
        try:
            scale = int(params.get("scale", 0))  # (the JSON converter's parameters are text)
        except (TypeError, ValueError):
            return general
        if not 0 <= scale < len(_EXACT_POWERS):
            return general
        power = _EXACT_POWERS[scale]

        def number(raw: Any) -> Any:
            if type(raw) is not str:
                return general(raw)
            try:
                data = binascii.a2b_base64(raw, strict_mode=True)
            except (binascii.Error, ValueError):
                return general(raw)
            unscaled = int.from_bytes(data, "big", signed=True)
            if -_EXACT_INT < unscaled < _EXACT_INT:
                # Both exact doubles: IEEE division rounds the exact quotient once, as
                # float(Decimal) does.
                return unscaled / power
            return general(raw)

        return number
    return general


#: Integers below this magnitude, and these powers of ten, are exact doubles.
_EXACT_INT: Final = 2**53
_EXACT_POWERS: Final = tuple(float(10**k) for k in range(23))


def _decimal(schema_name: str, params: dict[str, Any], raw: Any) -> Any:
    """A Connect Decimal (base64 of the unscaled big-endian two's complement integer,
    ``parameters.scale``) or a VariableScaleDecimal as a `decimal.Decimal`; anything else
    (``decimal.handling.mode`` double or string: a number or text) as it is."""
    if schema_name == "io.debezium.data.VariableScaleDecimal":
        if type(raw) is not dict:
            return raw
        scale, data = raw.get("scale"), raw.get("value")
    elif schema_name == "org.apache.kafka.connect.data.Decimal":
        scale, data = params.get("scale", 0), raw
    else:
        return raw
    try:
        scale = int(cast("Any", scale))
        if isinstance(data, str):
            data = base64.b64decode(data, validate=True)
        if not isinstance(data, bytes | bytearray):
            return raw
    except (ValueError, TypeError, binascii.Error):
        return raw
    unscaled = int.from_bytes(data, "big", signed=True)
    return decimal.Decimal(f"{unscaled}e{-scale}")  # exact (scaleb rounds to 28 digits)
