"""A schema's leaves, and the one rule that fits them to a table's columns.

A leaf is a field of a record schema (Avro, JSON Schema, a Protobuf message type) that a
column can read: its path and its column type (None: no column type fits it, e.g. an
array or a map). `text_leaves` and `proto_leaves` walk a schema to its leaves;
`fit_leaves` is the one rule of which leaves the table's columns read, which would add or
widen a column, and which are skipped, used both where the table's columns are derived
(`sink.formats.derive`) and where each new writer schema is checked while running
(`sink.formats.SchemaCheck`), so what the check finds missing is exactly what a restart's
derivation adds (DESIGN I20). Nothing here imports the formats themselves.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Final

from engine.schema import SOURCE_COLUMNS

__all__ = ["NESTED", "Column", "Fit", "Leaf", "Path", "fit_leaves", "proto_leaves", "text_leaves"]

_WIDEN_NAMES: Final = frozenset({("int32", "int64"), ("float32", "float64")})

#: Separator of nested field names in derived column names: ``meta__n`` <- ``$.meta.n``.
NESTED: Final = "__"
_NAME_OK: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")

_AVRO: Final = {
    "boolean": "bool",
    "int": "int32",
    "long": "int64",
    "float": "float32",
    "double": "float64",
    "bytes": "binary",
    "fixed": "binary",
    "string": "string",
    "enum": "string",
}
_AVRO_LOGICAL: Final[dict[str, str | None]] = {
    "time-millis": None,  # fastavro gives datetime.time: no column type
    "time-micros": None,
    "timestamp-millis": "timestamp",
    "timestamp-micros": "timestamp",
    "local-timestamp-millis": "timestamp",
    "local-timestamp-micros": "timestamp",
    "date": "timestamp",
    "uuid": "string",
    "decimal": "float64",
}
_JSON: Final = {"string": "string", "integer": "int64", "number": "float64", "boolean": "bool"}
# Protobuf FieldDescriptor.TYPE_* numbers.
_PROTO: Final = {
    1: "float64",  # double
    2: "float32",  # float
    3: "int64",  # int64
    4: "int64",  # uint64 (values above 2^63 - 1 are wrong_type)
    5: "int32",  # int32
    6: "int64",  # fixed64
    7: "int64",  # fixed32
    8: "bool",
    9: "string",
    12: "binary",  # bytes
    13: "int64",  # uint32
    14: "string",  # enum (its value names)
    15: "int32",  # sfixed32
    16: "int64",  # sfixed64
    17: "int32",  # sint32
    18: "int64",  # sint64
}
_PROTO_MESSAGE: Final = 11
_PROTO_WELL_KNOWN: Final = {
    "google.protobuf.Timestamp": "timestamp",
    "google.protobuf.Duration": "float64",
    "google.protobuf.DoubleValue": "float64",
    "google.protobuf.FloatValue": "float32",
    "google.protobuf.Int64Value": "int64",
    "google.protobuf.UInt64Value": "int64",
    "google.protobuf.Int32Value": "int32",
    "google.protobuf.UInt32Value": "int64",
    "google.protobuf.BoolValue": "bool",
    "google.protobuf.StringValue": "string",
    "google.protobuf.BytesValue": "binary",
}

Path = tuple[str, ...]
Leaf = tuple[Path, str | None]  # (path, column type or None = skipped)


@dataclass(frozen=True, slots=True)
class Column:
    """A column of a table with derived columns, as a schema's leaves are fitted to it.

    Attributes:
        source: what it reads, as ``source.columns`` writes it (``$.customer.id``,
            ``@timestamp``).
        type_name: its type name (``vector`` for ``table.vector``); None for a column
            ``source.columns`` maps that the table does not have yet: the leaf its path
            reads gives the type.
        nullable: as in the table (a derived column is nullable).
    """

    source: str
    type_name: str | None
    nullable: bool = True

    @property
    def path(self) -> Path | None:
        """The record path it reads; None for Kafka metadata and decoded keys."""
        return tuple(self.source[2:].split(".")) if self.source.startswith("$.") else None


@dataclass(frozen=True, slots=True)
class Fit:
    """What a schema's leaves make of a table's columns (`fit_leaves`).

    Attributes:
        columns: the table's columns, typed or widened by the leaves, then the new ones.
        changes: the leaves that add or widen a column, described for logs and errors
            (``customer.id (int32 -> int64)``, ``coupon (new, string)``).
        skipped: the leaves that get no column, as ``(field, type, reason)``.
    """

    columns: dict[str, Column]
    changes: list[str]
    skipped: list[tuple[str, str | None, str]]


def fit_leaves(leaves: list[Leaf], columns: dict[str, Column], row: Path = ()) -> Fit:
    """Fit a schema's leaves to a table's columns (by name). The one rule of both
    `derive_settings`, which creates and evolves the table, and the check of each new
    writer schema while running (`sink.formats`): what the check finds missing is what a
    derivation adds, so a restart to evolve cannot repeat for the same schema.

    A leaf a column reads (by its derived or its mapped path) types that column when it
    has no type yet, and widens it (int32 -> int64, float32 -> float64); another type
    change is no change (such values are ``wrong_type`` dead letters). Any other leaf
    gets a new column named ``<parent>__<field>``, unless it has no column type, the name
    would not read the leaf back (``a__b`` reads ``$.a.b``, never a field ``a__b``), or a
    column of that name reads something else: then the leaf is skipped, with the reason.

    With a `row` (change events: ``("after",)``, `sink.cdc`) only the leaves under it get
    columns of their own, named by their path below it (``$.after.a.b``: ``a__b``); the
    others only type the columns that read them.
    """
    out = dict(columns)
    reads = {c.path: name for name, c in out.items() if c.path is not None}
    changes: list[str] = []
    skipped: dict[tuple[str, str | None], str] = {}
    for path, type_name in leaves:
        field = ".".join(path)
        name = reads.get(path)
        if name is not None:
            have = out[name].type_name
            if have is None or (have, type_name) in _WIDEN_NAMES:
                out[name] = replace(out[name], type_name=type_name)
                if have is not None:
                    changes.append(f"{field} ({have} -> {type_name})")
            continue
        if path[: len(row)] != row or len(path) == len(row):
            continue  # (an envelope's own fields: only the columns mapped to them)
        name = NESTED.join(path[len(row) :])
        reason = _no_column(path, type_name, name, out, row)
        if reason is not None:
            skipped[field, type_name] = reason
            continue
        out[name] = Column("$." + field, type_name)
        reads[path] = name
        changes.append(f"{field} (new, {type_name})")
    return Fit(out, changes, [(f, t, reason) for (f, t), reason in skipped.items()])


def _no_column(
    path: Path, type_name: str | None, name: str, columns: dict[str, Column], row: Path = ()
) -> str | None:
    """Why the leaf `path` gets no column `name` of its own (None: it gets one); `name`
    is its path below `row`."""
    if type_name is None:
        return (
            "its type has no column type (arrays, maps, unions of several types, times of "
            "day); to keep a value inside it, declare table.columns and map the path with "
            "source.columns"
        )
    field = ".".join(path)
    mapping = f'map it to a column of another name in source.columns (NAME = "$.{field}")'
    if name.startswith("_"):
        return (
            f"{name!r}: names starting with '_' are reserved for the sink's own columns "
            f"({', '.join(SOURCE_COLUMNS)}); {mapping}"
        )
    if not name[:1].isalpha() or not set(name) <= _NAME_OK:
        return f"{name!r} is not a column name; {mapping}"
    named = tuple(name.split(NESTED))
    if named != path[len(row) :]:
        return f"a column named {name} reads $.{'.'.join((*row, *named))}; {mapping}"
    if name in columns:
        return f"column {name} reads {columns[name].source}; {mapping}"
    return None


def text_leaves(fmt: str, text: str) -> list[Leaf]:
    """The leaves of an Avro or JSON Schema schema text."""
    if fmt == "avro":
        return list(_avro_leaves(json.loads(text), (), {}))
    return list(_json_leaves(json.loads(text), ()))


def _avro_leaves(schema: Any, path: tuple[str, ...], named: dict[str, Any]) -> Iterator[Leaf]:
    """Leaves of an Avro schema (`named`: named types seen so far, for references)."""
    if isinstance(schema, str):
        schema = named.get(schema, schema)
    if isinstance(schema, list):  # a union: [null, T] is T; anything else has no column
        others = [s for s in schema if s != "null"]
        if len(others) == 1:
            yield from _avro_leaves(others[0], path, named)
        else:
            yield path, None
        return
    if isinstance(schema, dict):
        if "name" in schema and schema.get("type") in {"record", "enum", "fixed"}:
            named[schema["name"]] = schema
            if "namespace" in schema:
                named[f"{schema['namespace']}.{schema['name']}"] = schema
        kind = schema.get("type")
        logical = schema.get("logicalType")
        if logical in _AVRO_LOGICAL:
            yield path, _AVRO_LOGICAL[logical]
            return
        if kind == "record":
            for field in schema.get("fields", []):
                yield from _avro_leaves(field["type"], (*path, field["name"]), named)
            return
        if kind in {"array", "map"}:
            yield path, None
            return
        schema = kind
        if isinstance(schema, dict | list):
            yield from _avro_leaves(schema, path, named)
            return
    yield path, _AVRO.get(str(schema))


def _json_leaves(schema: Any, path: tuple[str, ...]) -> Iterator[Leaf]:
    if isinstance(schema, dict) and "type" not in schema:
        # oneOf (anyOf) null and one type: an optional field as Kafka Connect's JSON Schema
        # converter writes it, that type; any other combination has no column.
        branches = schema.get("oneOf", schema.get("anyOf"))
        if isinstance(branches, list):
            others = [b for b in branches if not (isinstance(b, dict) and b.get("type") == "null")]
            if len(others) == 1:
                yield from _json_leaves(others[0], path)
            else:
                yield path, None
            return
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        others = [k for k in kind if k != "null"]
        kind = others[0] if len(others) == 1 else None
    if kind == "object" and "properties" in schema:
        for name, sub in schema["properties"].items():
            yield from _json_leaves(sub, (*path, name))
        return
    if kind == "string" and schema.get("format") in {"date-time", "date"}:
        yield path, "timestamp"
    elif kind == "string" and schema.get("contentEncoding") == "base64":
        yield path, "binary"
    else:
        yield path, _JSON.get(str(kind))


def proto_leaves(desc: Any) -> list[Leaf]:
    """The leaves of a Protobuf message type."""
    return list(_proto_leaves(desc, ()))


def _proto_leaves(desc: Any, path: tuple[str, ...]) -> Iterator[Leaf]:
    for field in desc.fields:
        sub = (*path, field.name)
        if field.is_repeated:
            yield sub, None
        elif field.type == _PROTO_MESSAGE:
            name = field.message_type.full_name
            if name in _PROTO_WELL_KNOWN:
                yield sub, _PROTO_WELL_KNOWN[name]
            else:
                yield from _proto_leaves(field.message_type, sub)
        else:
            yield sub, _PROTO.get(field.type)
