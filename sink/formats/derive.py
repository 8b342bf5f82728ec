"""Table columns from a schema, for registry formats with no ``table.columns``.

`derive_settings` fills ``table.columns`` (and ``source.columns`` for nested fields) before
the engine opens the table:

- the table does not exist yet: from the latest schema of the first topic's value subject
  (TopicNameStrategy: ``<topic>-value``), or, for protobuf without a registry, from the
  descriptor set's message;
- the table exists: from the table's own columns, so a later start never depends on
  what producers registered since (``table.evolve`` adds new fields then).

`fit_leaves` is the one rule of which schema fields the table's columns read, which
fields would add or widen a column, and which are skipped; the check of each new writer
schema while running (`sink.formats`) uses it too, so what the check finds missing is
exactly what a restart's derivation adds.

Every derived column is nullable (a field of today's schema may be gone from tomorrow's).
A nested record's fields become columns named ``<parent>__<field>`` read from
``$.parent.field``. Fields that map to no column type (arrays other than the vector
column, maps, unions of several types), whose derived name a Lance column cannot have or
would read another field (a field ``a__b`` would be read from ``$.a.b``), or whose name is
taken by a column that reads something else are skipped and logged. The full mapping is
in docs/formats.md.

Change events (``source.envelope = "debezium"``, `sink.cdc`): the columns are the fields of
the envelope schema's after image (``$.after.<field>``, columns named as the fields), a
field of a Connect logical type typed as `sink.cdc.DERIVED` says; the envelope's other
fields (``$.source.ts_ms``, ``$.op``) only type the columns ``source.columns`` maps to them.
In the json format the schema is the JSON converter's schema block, which travels in the
messages: a new table's columns come from the blocks of the first topic's newest events
(`peek_schema_blocks`), an evolution's from the blocks the running sink met (passed as
leaves).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any, Final

import orjson
import pyarrow as pa
import structlog

from config.settings import Settings
from engine.schema import SOURCE_COLUMNS, arrow_type
from sink.cdc import ROW, connect_leaves, row_leaves, schema_logical
from sink.formats import RegistryUnavailable
from sink.formats.leaves import (
    NESTED,
    Column,
    Fit,
    Leaf,
    Path,
    fit_leaves,
    proto_leaves,
    text_leaves,
)

__all__ = [
    "EVOLVE_LEAVES_ENV",
    "EVOLVE_SCHEMA_IDS_ENV",
    "derive_settings",
    "peek_schema_blocks",
    "schema_columns",
]

#: Schema ids a sink that restarted to evolve (`SchemaEvolution`) met in its messages: their
#: fields are added too, so the restart cannot repeat (the writer schema need not be the
#: subject's latest version). Set by `sink.cli` for the re-executed process only.
EVOLVE_SCHEMA_IDS_ENV = "LANCE_SINK_EVOLVE_SCHEMA_IDS"
#: The same for schemas without an id (json change events' schema blocks): their leaves,
#: as JSON (``[[["after", "color"], "string"], ...]``).
EVOLVE_LEAVES_ENV = "LANCE_SINK_EVOLVE_LEAVES"
#: Newest messages read per partition of the first topic to find schema blocks in
#: (`peek_schema_blocks`): a tombstone or a truncate has none, a few events past them do.
_PEEK_PER_PARTITION: Final = 20
#: How long the peek reads at most: long enough for a broker's first fetch, short next to
#: a sink's start (it runs once, when the table is created).
_PEEK_TIMEOUT_S: Final = 15.0

log = structlog.get_logger("lance_sink.formats")


def derive_settings(
    settings: Settings, schema_ids: tuple[int, ...] = (), leaves: tuple[Leaf, ...] = ()
) -> Settings:
    """`settings` with ``table.columns`` derived (unchanged when columns are configured).
    `schema_ids` and `leaves`: of the schemas a restart to evolve was for.

    With ``table.evolve`` and an existing table, the leaves of the subject's latest schema
    (and of `schema_ids`) are fitted to the table's columns (`fit_leaves`): new fields are
    added, widened types applied, columns ``source.columns`` maps and the table lacks
    added; the engine then evolves the table when it opens it. A registry that cannot
    answer then leaves the table's columns as they are (logged): the sink starts, and
    evolves when a message needs it.

    Raises:
        ValueError: no usable column could be derived, a mapped column's type is not given
            by the schema, or the result is not valid settings (e.g. the primary key names
            a field the schema lacks).
        LookupError: the subject is not in the registry.
        sink.formats.RegistryUnavailable: the registry could not answer for a table that
            does not exist yet, or for the type of a column ``source.columns`` newly maps.
    """
    if settings.table.columns:
        return settings
    row = _row(settings)
    configured = _configured_columns(settings)
    existing = _table_schema(settings)
    if existing is None:
        origin = "schema"
        # (json change events: the topic's schema blocks, unless a restart brought some)
        fit = _fit(schema_columns(settings, leaves=leaves, peek=not leaves), configured, row)
        # The schema's columns in its order, then the mapped ones.
        columns = {n: c for n, c in fit.columns.items() if n not in configured}
        columns.update((n, fit.columns[n]) for n in configured)
    else:
        origin = "table"
        columns = _from_table(existing, settings)
        if settings.table.evolve:
            mapped = {n: c for n, c in configured.items() if n not in columns}
            try:
                found = schema_columns(settings, schema_ids, leaves)
            except RegistryUnavailable as exc:
                # The table's columns suffice to start (a message whose writer schema has
                # fields they lack restarts the sink to evolve once the registry answers),
                # unless a newly mapped column needs the schema for its type.
                if any(c.type_name is None for c in mapped.values()):
                    raise
                log.warning("registry_unavailable_at_start", error=str(exc), columns="table")
                columns |= mapped
            else:
                columns = _fit(found, columns | mapped, row).columns
    columns = _key_columns(settings, columns)
    if settings.table.vector is not None:
        columns.pop(settings.table.vector.column, None)  # table.vector declares it
    for name, column in columns.items():
        if column.type_name is None:
            whose = "the key's schema" if _key_path(column.source) else "the schema"
            raise ValueError(
                f"source.columns maps {name!r} to {column.source!r}, whose type {whose} "
                "does not give; declare table.columns"
            )
    if not columns:
        raise ValueError(f"no column could be derived from the {origin} for table.columns")
    log.info("table_columns_derived", origin=origin, columns=list(columns))
    data = settings.model_dump()
    data["table"]["columns"] = [
        {"name": n, "type": c.type_name, "nullable": c.nullable} for n, c in columns.items()
    ]
    sources = {n: c.source for n, c in columns.items() if c.source != "$." + n}
    data["source"]["columns"] = {**sources, **settings.source.columns}
    return Settings.model_validate(data)


def _fit(leaves: list[Leaf], columns: dict[str, Column], row: Path = ()) -> Fit:
    """`fit_leaves`, logging the leaves skipped."""
    fit = fit_leaves(leaves, columns, row)
    for field, type_name, reason in fit.skipped:
        log.warning("schema_field_skipped", field=field, type=type_name, reason=reason)
    return fit


def _row(settings: Settings) -> Path:
    """The record path below which fields get columns: change events' after image."""
    return ROW if settings.source.envelope == "debezium" else ()


def _field_source(settings: Settings, name: str) -> str:
    """What an unmapped column `name` reads (``a__b``: ``$.a.b``, below `_row`)."""
    return "$." + ".".join((*_row(settings), *name.split(NESTED)))


#: Column types of the Kafka metadata sources a mapped column may read.
_METADATA_TYPES: Final = {
    "@timestamp": "timestamp",
    "@topic": "string",
    "@partition": "int32",
    "@offset": "int64",
}


def _configured_columns(settings: Settings) -> dict[str, Column]:
    """The columns the settings name: those ``source.columns`` maps, typed by the Kafka
    metadata they read (raw keys, values and headers are binary) or, for a record path,
    left for the schema's leaf to type; and the vector column."""
    raw_key = settings.source.key_format == "raw"
    out: dict[str, Column] = {}
    for name, src in settings.source.columns.items():
        if src.startswith("$."):
            type_name = None
        elif src in _METADATA_TYPES:
            type_name = _METADATA_TYPES[src]
        elif src == "@value" or src.startswith("@headers.") or (src == "@key" and raw_key):
            type_name = "binary"
        else:
            type_name = None  # a field of a decoded key: typed by the key's schema
        out[name] = Column(src, type_name)
    vector = settings.table.vector
    if vector is not None:
        out[vector.column] = Column(
            settings.source.columns.get(vector.column, _field_source(settings, vector.column)),
            "vector",
        )
    return out


def _table_schema(settings: Settings) -> pa.Schema | None:
    # Lance loads here only: the decoder imports this module for `fit_leaves`.
    import lance  # noqa: PLC0415

    options = {k: v.get_secret_value() for k, v in settings.table.storage_options.items()}
    try:
        return lance.dataset(settings.table.uri, storage_options=options).schema
    except (ValueError, FileNotFoundError, OSError):
        return None


def _from_table(schema: pa.Schema, settings: Settings) -> dict[str, Column]:
    """The table's columns (and its vector column), reading what ``source.columns`` maps
    them to, else what their derived name reads (``a__b``: ``$.a.b``)."""
    vector = settings.table.vector
    names = {arrow_type(n): n for n in _TYPE_NAMES}
    columns: dict[str, Column] = {}
    for field in schema:
        if vector is not None and field.name == vector.column:
            type_name: str | None = "vector"
        else:
            type_name = next((n for t, n in names.items() if t.equals(field.type)), None)
        if field.name in SOURCE_COLUMNS or type_name is None:
            continue
        src = settings.source.columns.get(field.name, _field_source(settings, field.name))
        columns[field.name] = Column(src, type_name, field.nullable)
    return columns


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


def schema_columns(
    settings: Settings,
    schema_ids: tuple[int, ...] = (),
    leaves: tuple[Leaf, ...] = (),
    *,
    peek: bool = False,
) -> list[Leaf]:
    """The leaves of the value schema the table would be derived from: registry subject
    ``<first topic>-value`` at its latest version (plus the schemas `schema_ids`), or the
    descriptor set's message; for json change events `leaves` and, with `peek`, the schema
    blocks of the topic's newest events.

    Raises:
        LookupError: (json change events, `peek`) no event with a schema block was found.
    """
    source = settings.source
    if source.format == "json":  # change events (the settings allow no other json)
        found = list(leaves)
        if peek:
            blocks = peek_schema_blocks(settings)
            if not blocks and not found:
                raise LookupError(
                    f"no change event with a schema block in topic {settings.kafka.topics[0]!r} "
                    "to derive table.columns from (the JSON converter's schemas.enable must be "
                    "on): declare table.columns, or start the sink once the connector has "
                    "written to the topic"
                )
            found += [leaf for block in blocks for leaf in connect_leaves(block)]
        return found
    pb = source.protobuf
    if source.format == "protobuf" and source.schema_registry is None:
        from sink.formats.protobuf import load_descriptor  # noqa: PLC0415

        assert pb is not None
        assert pb.descriptor_set is not None
        assert pb.message is not None
        desc = load_descriptor(pb.descriptor_set, pb.message)
        return _cdc_leaves(settings, proto_leaves(desc), "protobuf", desc)
    message = None if pb is None else pb.message
    return _subject_leaves(settings, "value", source.format, message, schema_ids)


def _key_columns(settings: Settings, columns: dict[str, Column]) -> dict[str, Column]:
    """`columns` with those ``source.columns`` maps to a field of a registry-encoded key
    (``@key.a.b``) typed by the key's schema: registry subject ``<first topic>-key`` at
    its latest version (TopicNameStrategy, as for values)."""
    key_format = settings.source.key_format
    wanted = {
        name: path
        for name, c in columns.items()
        if c.type_name is None and (path := _key_path(c.source)) is not None
    }
    if not wanted or key_format == "raw":
        return columns
    types = dict(_subject_leaves(settings, "key", key_format, None, ()))
    return {
        name: replace(c, type_name=types.get(wanted[name])) if name in wanted else c
        for name, c in columns.items()
    }


def _key_path(source: str) -> Path | None:
    return tuple(source[len("@key.") :].split(".")) if source.startswith("@key.") else None


def _subject_leaves(
    settings: Settings, kind: str, fmt: str, message: str | None, schema_ids: tuple[int, ...]
) -> list[Leaf]:
    """The leaves of subject ``<first topic>-<kind>`` at its latest version (plus the
    schemas `schema_ids`) in the registry format `fmt`."""
    from sink.formats.registry import build_client, latest_schema  # noqa: PLC0415

    source = settings.source
    assert source.schema_registry is not None
    client = build_client(source.schema_registry)
    subject = f"{settings.kafka.topics[0]}-{kind}"
    registered = latest_schema(client, subject, serialized=fmt == "protobuf")
    if fmt in {"avro", "json_schema"}:
        texts = [registered.schema.schema_str]
        texts += [client.get_schema(schema_id).schema_str for schema_id in schema_ids]
        if kind == "key":
            return [leaf for text in texts for leaf in text_leaves(fmt, text)]
        return [
            leaf
            for text in texts
            for leaf in _cdc_leaves(settings, text_leaves(fmt, text), fmt, text)
        ]
    from sink.formats.protobuf import registry_descriptor  # noqa: PLC0415

    schemas = [registered.schema]
    schemas += [client.get_schema(i, fmt="serialized") for i in schema_ids]
    descriptors = [registry_descriptor(client, schema, message) for schema in schemas]
    if kind == "key":
        return [leaf for desc in descriptors for leaf in proto_leaves(desc)]
    return [
        leaf
        for desc in descriptors
        for leaf in _cdc_leaves(settings, proto_leaves(desc), fmt, desc)
    ]


def _cdc_leaves(settings: Settings, leaves: list[Leaf], fmt: str, schema: Any) -> list[Leaf]:
    """A value schema's `leaves`; of change events, with the after image's fields of a
    logical type typed as they derive (`sink.cdc.row_leaves`). `schema`: the schema text
    (Avro, JSON Schema) or the message descriptor (Protobuf)."""
    if settings.source.envelope != "debezium":
        return leaves
    parsed = json.loads(schema) if isinstance(schema, str) else schema
    return row_leaves(leaves, schema_logical(fmt, parsed))


def peek_schema_blocks(settings: Settings) -> list[Any]:
    """The distinct JSON converter schema blocks (parsed) of the newest change events of
    the first topic: up to `_PEEK_PER_PARTITION` messages read from the end of each
    partition, for at most `_PEEK_TIMEOUT_S`. The partitions are assigned, not subscribed,
    and nothing is committed: the consumer group is not touched.

    Raises:
        ValueError: the first topic is a pattern (``^...``).
        LookupError: the topic could not be read (the broker's error).
    """
    import confluent_kafka  # noqa: PLC0415 - `check-config` stays light

    from sink.kafka_conf import kafka_security_conf  # noqa: PLC0415

    topic = settings.kafka.topics[0]
    if topic.startswith("^"):
        raise ValueError(
            f"kafka.topics[0] is a pattern ({topic!r}): the columns of json change events are "
            "derived from a topic's schema blocks; declare table.columns"
        )
    conf = kafka_security_conf(settings) | {
        "group.id": settings.kafka.group_id,
        "enable.auto.commit": False,
        "enable.partition.eof": True,
    }
    conf.update(settings.kafka.librdkafka)
    consumer = confluent_kafka.Consumer(conf)
    try:
        return _peek(consumer, topic)
    except confluent_kafka.KafkaException as exc:
        raise LookupError(f"cannot read topic {topic!r} for its schema blocks: {exc}") from exc
    finally:
        consumer.close()


def _peek(consumer: Any, topic: str) -> list[Any]:
    """`peek_schema_blocks` with its consumer (closed by the caller)."""
    import confluent_kafka  # noqa: PLC0415

    blocks: dict[bytes, Any] = {}
    deadline = time.monotonic() + _PEEK_TIMEOUT_S
    meta = consumer.list_topics(topic, timeout=_PEEK_TIMEOUT_S)
    found = meta.topics.get(topic)
    if found is None or found.error is not None:
        return []
    assign = []
    for partition in sorted(found.partitions):
        low, high = consumer.get_watermark_offsets(
            confluent_kafka.TopicPartition(topic, partition), timeout=_PEEK_TIMEOUT_S
        )
        if high > low:
            start = max(low, high - _PEEK_PER_PARTITION)
            assign.append(confluent_kafka.TopicPartition(topic, partition, start))
    if assign:
        consumer.assign(assign)
    pending = {tp.partition for tp in assign}
    while pending and time.monotonic() < deadline:
        for message in consumer.consume(500, timeout=0.5):
            error = message.error()
            if error is not None:
                if error.code() == confluent_kafka.KafkaError._PARTITION_EOF:
                    pending.discard(message.partition())
                continue
            block = _schema_block(message.value())
            if block is not None:
                blocks.setdefault(orjson.dumps(block), block)
    log.info("schema_blocks_peeked", topic=topic, blocks=len(blocks))
    return list(blocks.values())


def _schema_block(value: bytes | None) -> Any:
    """The schema block of a change event as the JSON converter wraps it, or None."""
    if not value:
        return None
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if type(parsed) is dict and type(parsed.get("schema")) is dict and "payload" in parsed:
        return parsed["schema"]
    return None
