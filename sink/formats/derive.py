"""Table columns from a schema, for registry formats with no ``table.columns``.

`derive_settings` fills ``table.columns`` (and ``source.columns`` for nested fields) before
the engine opens the table:

- the table does not exist yet: from the latest schema of the first topic's value subject
  (TopicNameStrategy: ``<topic>-value``), or, for protobuf without a registry, from the
  descriptor set's message;
- the table exists: from the table's own columns, so a later start never depends on
  what producers registered since (``table.evolve`` adds new fields then: see
  `sink.formats.derive.new_fields`).

Every derived column is nullable (a field of today's schema may be gone from tomorrow's).
A nested record's fields become columns named ``<parent>__<field>`` read from
``$.parent.field``. Fields that map to no column type (arrays other than the vector
column, maps, unions of several types, names Lance columns cannot have) are skipped and
logged. The full mapping is in docs/formats.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Final

import lance
import pyarrow as pa
import structlog

from config.settings import Settings
from engine.schema import SOURCE_COLUMNS, arrow_type
from sink.formats import RegistryUnavailable

__all__ = ["EVOLVE_SCHEMA_IDS_ENV", "derive_settings", "evolution_needed", "schema_columns"]

#: Schema ids a sink that restarted to evolve (`SchemaEvolution`) met in its messages: their
#: fields are added too, so the restart cannot repeat (the writer schema need not be the
#: subject's latest version). Set by `sink.cli` for the re-executed process only.
EVOLVE_SCHEMA_IDS_ENV = "LANCE_SINK_EVOLVE_SCHEMA_IDS"
_WIDEN_NAMES: Final = frozenset({("int32", "int64"), ("float32", "float64")})

log = structlog.get_logger("lance_sink.formats")

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

Leaf = tuple[tuple[str, ...], str | None]  # (path, column type or None = skipped)


def derive_settings(settings: Settings, schema_ids: tuple[int, ...] = ()) -> Settings:
    """`settings` with ``table.columns`` derived (unchanged when columns are configured).

    With ``table.evolve`` and an existing table, the fields of the subject's latest schema
    (and of `schema_ids`) that the table lacks are added and widened types applied; the
    engine then evolves the table when it opens it. A registry that cannot answer then
    leaves the table's columns as they are (logged): the sink starts, and evolves when a
    message needs it.

    Raises:
        ValueError: no usable column could be derived, or the result is not valid
            settings (e.g. the primary key names a field the schema lacks).
        LookupError: the subject is not in the registry.
        sink.formats.RegistryUnavailable: the registry could not answer for a table that
            does not exist yet.
    """
    if settings.table.columns:
        return settings
    existing = _table_schema(settings)
    if existing is not None:
        columns, sources = _from_table(existing, settings)
        origin = "table"
        if settings.table.evolve:
            try:
                leaves = schema_columns(settings, schema_ids)
            except RegistryUnavailable as exc:
                # The table's columns suffice to start: a message whose writer schema has
                # fields they lack restarts the sink to evolve once the registry answers.
                log.warning("registry_unavailable_at_start", error=str(exc), columns="table")
            else:
                columns, sources = _merge(columns, sources, *_from_leaves(leaves, settings))
    else:
        leaves = schema_columns(settings)
        columns, sources = _from_leaves(leaves, settings)
        columns += _mapped_columns(settings, leaves, columns)
        origin = "schema"
    if not columns:
        raise ValueError(f"no column could be derived from the {origin} for table.columns")
    log.info("table_columns_derived", origin=origin, columns=[c["name"] for c in columns])
    data = settings.model_dump()
    data["table"]["columns"] = columns
    data["source"]["columns"] = {**sources, **settings.source.columns}
    return Settings.model_validate(data)


def _table_schema(settings: Settings) -> pa.Schema | None:
    options = {k: v.get_secret_value() for k, v in settings.table.storage_options.items()}
    try:
        return lance.dataset(settings.table.uri, storage_options=options).schema
    except (ValueError, FileNotFoundError, OSError):
        return None


def _from_table(
    schema: pa.Schema, settings: Settings
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    vector = settings.table.vector.column if settings.table.vector is not None else None
    names = {arrow_type(n): n for n in _TYPE_NAMES}
    columns: list[dict[str, Any]] = []
    sources: dict[str, str] = {}
    for field in schema:
        if field.name in SOURCE_COLUMNS or field.name == vector:
            continue
        type_name = next((n for t, n in names.items() if t.equals(field.type)), None)
        if type_name is None:
            continue
        columns.append({"name": field.name, "type": type_name, "nullable": field.nullable})
        if NESTED in field.name:
            sources[field.name] = "$." + field.name.replace(NESTED, ".")
    return columns, sources


_TYPE_NAMES: Final = (
    "string",
    "int32",
    "int64",
    "float32",
    "float64",
    "bool",
    "binary",
    "timestamp",
)


def _merge(
    columns: list[dict[str, Any]],
    sources: dict[str, str],
    new_columns: list[dict[str, Any]],
    new_sources: dict[str, str],
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The table's columns plus the schema's new ones, widened where the schema widens."""
    by_name = {c["name"]: c for c in columns}
    for column in new_columns:
        old = by_name.get(column["name"])
        if old is None:
            columns.append(column)
            by_name[column["name"]] = column
            if column["name"] in new_sources:
                sources[column["name"]] = new_sources[column["name"]]
        elif (old["type"], column["type"]) in _WIDEN_NAMES:
            old["type"] = column["type"]
    return columns, sources


def evolution_needed(leaves: list[Leaf], column_types: dict[tuple[str, ...], str]) -> list[str]:
    """The fields of a writer schema (`leaves`) that derived columns would add or widen,
    given the record paths the table's columns read (`column_types`); empty if none."""
    out: list[str] = []
    for path, type_name in leaves:
        name = _column_name(path, type_name)
        if name is None:
            continue
        have = column_types.get(path)
        if have is None:
            out.append(f"{'.'.join(path)} (new, {type_name})")
        elif (have, type_name) in _WIDEN_NAMES:
            out.append(f"{'.'.join(path)} ({have} -> {type_name})")
    return out


def _column_name(path: tuple[str, ...], type_name: str | None) -> str | None:
    """The derived column of a schema leaf, or None when it gets none."""
    name = NESTED.join(path)
    if type_name is None or not name[:1].isalpha() or not set(name) <= _NAME_OK:
        return None
    return name


#: Column types of the Kafka metadata sources a mapped column may read.
_METADATA_TYPES: Final = {
    "@timestamp": "timestamp",
    "@topic": "string",
    "@partition": "int32",
    "@offset": "int64",
}


def _mapped_columns(
    settings: Settings, leaves: list[Leaf], columns: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Columns ``source.columns`` names that the schema's leaves did not give: typed by the
    leaf their record path reads, or by the Kafka metadata they read (raw keys, values and
    headers are binary)."""
    have = {c["name"] for c in columns}
    if settings.table.vector is not None:
        have.add(settings.table.vector.column)
    types = dict(leaves)
    raw_key = settings.source.key_format == "raw"
    out: list[dict[str, Any]] = []
    for name, src in settings.source.columns.items():
        if name in have:
            continue
        if src.startswith("$."):
            type_name = types.get(tuple(src[2:].split(".")))
        elif src in _METADATA_TYPES:
            type_name = _METADATA_TYPES[src]
        elif src == "@value" or src.startswith("@headers.") or (src == "@key" and raw_key):
            type_name = "binary"
        else:
            type_name = None  # a field of a decoded key: declare the column in the settings
        if type_name is None:
            raise ValueError(
                f"source.columns maps {name!r} to {src!r}, whose type the schema does not "
                "give; declare table.columns"
            )
        out.append({"name": name, "type": type_name, "nullable": True})
    return out


def _from_leaves(
    leaves: list[Leaf], settings: Settings
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    vector = settings.table.vector.column if settings.table.vector is not None else None
    mapped = {tuple(s[2:].split(".")) for s in settings.source.columns.values() if s[:2] == "$."}
    columns: list[dict[str, Any]] = []
    sources: dict[str, str] = {}
    for path, type_name in leaves:
        if path == (vector,) or path in mapped:
            continue  # the vector, or a path a configured mapping reads into its own column
        name = _column_name(path, type_name)
        if name is None:
            log.warning(
                "schema_field_skipped",
                field=".".join(path),
                type=type_name,
                reason=_skipped_because(path, type_name),
            )
            continue
        columns.append({"name": name, "type": type_name, "nullable": True})
        if len(path) > 1:
            sources[name] = "$." + ".".join(path)
    return columns, sources


def _skipped_because(path: tuple[str, ...], type_name: str | None) -> str:
    """Why the schema leaf `path` gets no derived column (`_column_name` gave None)."""
    if type_name is None:
        return (
            "its type has no column type (arrays, maps, unions of several types, times of "
            "day); to keep a value inside it, declare table.columns and map the path with "
            "source.columns"
        )
    name = NESTED.join(path)
    if name.startswith("_"):
        return (
            f"{name!r}: names starting with '_' are reserved for the sink's own columns "
            f"({', '.join(SOURCE_COLUMNS)}); map the field to another column with source.columns"
        )
    return (
        f"{name!r} is not a column name (a letter, then letters, digits and '_'); map the "
        "field to one with source.columns"
    )


def schema_columns(settings: Settings, schema_ids: tuple[int, ...] = ()) -> list[Leaf]:
    """The leaves of the value schema the table would be derived from: registry subject
    ``<first topic>-value`` at its latest version (plus the schemas `schema_ids`), or the
    descriptor set's message."""
    source = settings.source
    pb = source.protobuf
    if source.format == "protobuf" and source.schema_registry is None:
        from sink.formats.protobuf import load_descriptor  # noqa: PLC0415

        assert pb is not None
        assert pb.descriptor_set is not None
        assert pb.message is not None
        desc = load_descriptor(pb.descriptor_set, pb.message)
        return list(_proto_leaves(desc, ()))
    from sink.formats.registry import build_client, latest_schema  # noqa: PLC0415

    assert source.schema_registry is not None
    client = build_client(source.schema_registry)
    subject = f"{settings.kafka.topics[0]}-value"
    registered = latest_schema(client, subject, serialized=source.format == "protobuf")
    if source.format in {"avro", "json_schema"}:
        texts = [registered.schema.schema_str]
        texts += [client.get_schema(schema_id).schema_str for schema_id in schema_ids]
        return [leaf for text in texts for leaf in text_leaves(source.format, text)]
    from sink.formats.protobuf import registry_descriptor  # noqa: PLC0415

    message = None if pb is None else pb.message
    schemas = [registered.schema]
    schemas += [client.get_schema(i, fmt="serialized") for i in schema_ids]
    return [
        leaf
        for schema in schemas
        for leaf in proto_leaves(registry_descriptor(client, schema, message))
    ]


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
