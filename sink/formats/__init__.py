"""Registry formats: Avro, Protobuf and JSON Schema in the Confluent wire format.

`sink.decode.Decoder` uses a `RecordFormat` for ``source.format`` avro, protobuf and
json_schema: the format turns payloads into Python records with the library that owns it
(`sink.formats.avro`, ...), and `parse_records` turns the records into one column per
record path (`sink.formats.records`). Everything after that (required columns, primary
keys, vector checks, tombstones, Kafka metadata, assembly) is the JSON path's, unchanged.
See docs/formats.md for the configuration, the type mapping and the dead-letter reasons.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import pyarrow as pa
import structlog

from config.settings import REGISTRY_FORMATS, SourceSettings
from engine.errors import ControlFlow, RetriableError
from sink.formats.leaves import Column, fit_leaves
from sink.formats.records import Fault, column_values, to_column

__all__ = [
    "RecordColumns",
    "RecordFormat",
    "RegistryUnavailable",
    "SchemaCheck",
    "SchemaCheckMode",
    "SchemaEvolution",
    "WriterLeaves",
    "check_schema_block",
    "check_writer_schemas",
    "epoch_ms_paths",
    "parse_records",
    "record_column",
    "record_format",
]

Path = tuple[str, ...]

log = structlog.get_logger("lance_sink.formats")

#: How new writer schemas are checked (`SchemaCheck`): not at all (configured columns,
#: JSON), logged (derived columns), or evolving the table (derived, ``table.evolve``).
SchemaCheckMode = Literal["off", "warn", "evolve"]


class RegistryUnavailable(RetriableError):
    """The Schema Registry cannot answer (unreachable, timing out, or failing): not the
    message's fault. `Decoder.decode` raises it; the consumer loop pauses the partition
    and decodes the same messages again later (nothing goes to the DLQ for it)."""


class SchemaEvolution(ControlFlow):
    """Messages were written with a schema that has fields the derived table lacks (or
    widens one), and ``table.evolve`` is on: the sink restarts itself to evolve the table
    before it writes any of them (`sink.service`, `sink.cli`).

    Attributes:
        schema_ids: the writer schema ids that need the evolution.
        leaves: the leaves (`sink.formats.leaves`) of schemas that have no id (change
            events' schema blocks in the json format, `sink.cdc`) that need it.
    """

    def __init__(
        self,
        message: str,
        schema_ids: tuple[int, ...],
        leaves: tuple[tuple[tuple[str, ...], str | None], ...] = (),
    ) -> None:
        super().__init__(message)
        self.schema_ids = schema_ids
        self.leaves = leaves


@dataclass
class SchemaCheck:
    """What `parse_records` checks each new writer schema against (derived columns): the
    table's columns (`sink.formats.leaves.fit_leaves` fits the schema's fields to them).

    With `evolve` (``table.evolve``) a schema with fields that would add or widen a column
    raises `SchemaEvolution`; without, those fields are logged once per schema id
    (``schema_fields_not_in_table``) and not read. Fields that get no column are logged once
    per schema id (``schema_field_skipped``). Schemas checked (all but those that raised)
    are remembered, shared by the decode threads.
    """

    columns: dict[str, Column]
    evolve: bool
    #: Change events (`sink.cdc`): the row image whose fields get columns (`fit_leaves`).
    row: tuple[str, ...] = ()
    checked: set[bytes] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


class WriterLeaves(Protocol):
    """What tells the leaves of a payload's writer schema (a `RecordFormat`, or change
    events' `sink.cdc.Debezium`)."""

    def writer_leaves(self, payload: bytes) -> list[tuple[tuple[str, ...], str | None]] | None:
        """See `RecordFormat.writer_leaves`."""
        ...


class RecordFormat(Protocol):
    """Turns framed payloads into Python records; safe to call from several threads."""

    name: str

    def records(
        self, payloads: Sequence[bytes], epoch_ms: frozenset[Path] = frozenset()
    ) -> tuple[list[int], list[Any], dict[int, Fault]]:
        """The positions of the payloads that decoded, their records, the others' faults.

        `epoch_ms`: record paths whose values fill only timestamp columns: there the format
        may give a timestamp as epoch milliseconds (an int) rather than a datetime, where
        that is cheaper (Avro's timestamp-millis); the column is the same either way.

        Raises:
            RegistryUnavailable: the registry could not be asked (not the messages' fault).
        """
        ...

    def writer_leaves(self, payload: bytes) -> list[tuple[tuple[str, ...], str | None]] | None:
        """The leaves (`sink.formats.derive`) of the schema `payload` was written with, or
        None when the format cannot tell (then writer schemas are not checked)."""
        ...


def record_format(source: SourceSettings, *, key: bool = False) -> RecordFormat | None:
    """The format of ``source.format`` (`key`: of ``source.key_format``), or None for json
    and raw."""
    name = source.key_format if key else source.format
    if name not in REGISTRY_FORMATS:
        return None
    # The registry client and the format libraries load only when a registry format is used.
    from sink.formats.registry import build_client  # noqa: PLC0415

    registry = source.schema_registry
    client = None if registry is None else build_client(registry)
    if name == "protobuf":
        from sink.formats.protobuf import ProtobufFormat  # noqa: PLC0415

        pb = None if key else source.protobuf
        if pb is None:
            return ProtobufFormat(client)
        return ProtobufFormat(client, pb.descriptor_set, pb.message)
    assert client is not None  # checked by the settings
    if name == "avro":
        from sink.formats.avro import AvroFormat  # noqa: PLC0415

        return AvroFormat(client)
    from sink.formats.json_schema import JsonSchemaFormat  # noqa: PLC0415

    # Change events are written by Kafka Connect's converter, which does not validate
    # (its default decimal.format writes a Decimal as base64 text under "type": "number").
    return JsonSchemaFormat(client, validate=key or source.envelope != "debezium")


@dataclass(frozen=True, slots=True)
class RecordColumns:
    """Columns of the payloads that decoded.

    Attributes:
        positions: positions (in the payloads given) of the decoded records, ascending.
        leaves: one array per record path, aligned with `positions`.
        faults: faults of payloads that did not decode, by payload position.
        column_faults: per path, faults of values that do not fit the column, by row
            (index into `positions`); those rows are null in `leaves`.
    """

    positions: np.ndarray
    leaves: dict[Path, pa.Array]
    faults: dict[int, Fault]
    column_faults: dict[Path, dict[int, Fault]]


#: Payloads decoded and turned into columns at a time: the records of one chunk (Python
#: objects, ~2 MB for 1,000 vector messages) are still in the CPU caches when their
#: columns are built. Decoding a whole consume batch (10,000) of Avro vector messages at
#: once was 10-30% slower (small records: no difference), on a busy 2-core VM; the join of
#: the chunks' arrays is a small copy next to that (~1 ms per 10,000 vectors).
_CHUNK = 1_000


def parse_records(
    fmt: RecordFormat,
    payloads: Sequence[bytes],
    paths: Sequence[tuple[Path, str, str]],
    check: SchemaCheck | None = None,
) -> RecordColumns:
    """Decode payloads with `fmt` and build a column for each ``(path, type, describe)``.

    Raises:
        RegistryUnavailable: from `fmt`.
        SchemaEvolution: (with a `check` that evolves) a decoded payload's writer schema
            has fields the table lacks or widens one.
    """
    epoch_ms = epoch_ms_paths(paths)
    if len(payloads) <= _CHUNK:
        return _parse_chunk(fmt, payloads, paths, check, epoch_ms)
    parts = [
        _parse_chunk(fmt, payloads[start : start + _CHUNK], paths, check, epoch_ms)
        for start in range(0, len(payloads), _CHUNK)
    ]
    faults: dict[int, Fault] = {}
    column_faults: dict[Path, dict[int, Fault]] = {path: {} for path, _, _ in paths}
    rows = 0
    for i, part in enumerate(parts):
        faults.update((i * _CHUNK + pos, fault) for pos, fault in part.faults.items())
        for path, bad in part.column_faults.items():
            column_faults[path].update((rows + row, fault) for row, fault in bad.items())
        rows += len(part.positions)
    return RecordColumns(
        np.concatenate([part.positions + i * _CHUNK for i, part in enumerate(parts)]),
        {path: pa.concat_arrays([part.leaves[path] for part in parts]) for path, _, _ in paths},
        faults,
        column_faults,
    )


def epoch_ms_paths(paths: Sequence[tuple[Path, str, str]]) -> frozenset[Path]:
    """The paths of timestamp columns that no other path reads through or into: there a
    format may give epoch milliseconds instead of a datetime (`RecordFormat.records`), and
    no other column sees the difference.

    Args:
        paths: ``(path, column type name, describe)`` per column, as `parse_records` takes.
    """
    every = [path for path, _, _ in paths]
    return frozenset(
        path
        for path, type_name, _ in paths
        if type_name == "timestamp"
        and not any(other != path and other[: len(path)] == path[: len(other)] for other in every)
    )


def _parse_chunk(
    fmt: RecordFormat,
    payloads: Sequence[bytes],
    paths: Sequence[tuple[Path, str, str]],
    check: SchemaCheck | None,
    epoch_ms: frozenset[Path] = frozenset(),
) -> RecordColumns:
    """`parse_records` of up to `_CHUNK` payloads.

    A value of an `epoch_ms` path that its column refuses may be one the format would have
    refused as a datetime (a long beyond the datetime range faults the whole message in
    fastavro): then the chunk is read again without `epoch_ms`, so the faults are the
    format's own."""
    positions, records, faults = fmt.records(payloads, epoch_ms)
    if check is not None:
        check_writer_schemas(fmt, [payloads[p] for p in positions], check)
    if set(map(type, records)) - {dict}:
        not_records = [i for i, r in enumerate(records) if not isinstance(r, dict)]
        for i in not_records:
            kind = type(records[i]).__name__
            faults[positions[i]] = (
                "not_an_object",
                f"value is a {fmt.name} {kind}, not a record",
            )
        drop = set(not_records)
        positions = [p for i, p in enumerate(positions) if i not in drop]
        records = [r for i, r in enumerate(records) if i not in drop]
    leaves: dict[Path, pa.Array] = {}
    column_faults: dict[Path, dict[int, Fault]] = {}
    for path, type_name, describe in paths:
        arr, bad = record_column(records, path, type_name, describe)
        if bad and path in epoch_ms:
            return _parse_chunk(fmt, payloads, paths, check)
        leaves[path] = arr
        column_faults[path] = bad
    return RecordColumns(np.asarray(positions, np.int64), leaves, faults, column_faults)


def record_column(
    records: Sequence[Any], path: Path, type_name: str, describe: str
) -> tuple[pa.Array, dict[int, Fault]]:
    """The column `path` reads in `records` (decoded records), in its canonical type, and
    the faults of the rows whose value does not fit it (null in the array), by row."""
    values, problems = column_values(records, path)
    arr, bad = to_column(values, type_name, describe)
    for row, problem in problems.items():
        bad.setdefault(row, ("wrong_type", f"{describe}: {problem}"))
    return arr, bad


#: Bytes of the Confluent framing that name a value's schema (magic byte and schema id).
_HEADER_BYTES = 5


def check_writer_schemas(fmt: WriterLeaves, payloads: list[bytes], check: SchemaCheck) -> None:
    """Fit each writer schema among `payloads` (which decoded) not checked yet to the
    table's columns: raise `SchemaEvolution` if one needs the table evolved and
    `check.evolve`, else log what the table will not hold, once per schema."""

    new = {p[:_HEADER_BYTES]: p for p in payloads} if payloads else {}
    needs: dict[int, list[str]] = {}
    for header, payload in new.items():
        if header in check.checked:
            continue
        leaves = fmt.writer_leaves(payload)
        fit = None if leaves is None else fit_leaves(leaves, check.columns, check.row)
        schema_id = int.from_bytes(header[1:], "big")
        if fit is not None and fit.changes and check.evolve:
            needs[schema_id] = fit.changes
            continue
        with check.lock:
            if header in check.checked:
                continue
            check.checked.add(header)
        if fit is None:
            continue
        for name, type_name, reason in fit.skipped:
            log.warning(
                "schema_field_skipped",
                schema_id=schema_id,
                field=name,
                type=type_name,
                reason=reason,
            )
        if fit.changes:
            log.warning(
                "schema_fields_not_in_table",
                schema_id=schema_id,
                fields=fit.changes,
                hint="not read; table.evolve = true would add or widen their columns",
            )
    if needs:
        what = "; ".join(f"schema id {i}: {', '.join(f)}" for i, f in sorted(needs.items()))
        raise SchemaEvolution(f"writer schemas need the table evolved: {what}", tuple(needs))


def check_schema_block(
    key: bytes, leaves: list[tuple[tuple[str, ...], str | None]], check: SchemaCheck
) -> None:
    """`check_writer_schemas` for a schema that travels in the messages (change events'
    schema blocks in the json format), known by `key` (its bytes, or a digest of them):
    raise `SchemaEvolution` carrying its `leaves` if it needs the table evolved and
    `check.evolve`, else log what the table will not hold, once per schema."""
    if key in check.checked:
        return
    fit = fit_leaves(leaves, check.columns, check.row)
    if fit.changes and check.evolve:
        raise SchemaEvolution(
            f"a schema block needs the table evolved: {', '.join(fit.changes)}",
            (),
            tuple(leaves),
        )
    with check.lock:
        if key in check.checked:
            return
        check.checked.add(key)
    for name, type_name, reason in fit.skipped:
        log.warning("schema_field_skipped", field=name, type=type_name, reason=reason)
    if fit.changes:
        log.warning(
            "schema_fields_not_in_table",
            fields=fit.changes,
            hint="not read; table.evolve = true would add or widen their columns",
        )
