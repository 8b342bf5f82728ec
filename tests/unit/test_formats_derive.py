"""Table columns derived from the value subject's latest schema (`sink.formats.derive`),
for each registry format, and from the existing table on later starts."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import lance
import pytest
import structlog
from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, timestamp_pb2

from config.settings import SchemaRegistrySettings, Settings
from engine.schema import TableSpec
from sink.decode import Decoder
from sink.formats import SchemaEvolution
from sink.formats.derive import derive_settings
from sink.formats.registry import build_client
from tests.unit.test_formats_avro import msgs, record_schema, serializer
from tests.unit.test_formats_protobuf_json import make_order, order_class, order_file
from tests.unit.test_settings import cli

TOPIC = "orders"

AVRO = {
    "type": "record",
    "name": "Order",
    "namespace": "shop",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "n", "type": ["null", "long"], "default": None},
        {"name": "price", "type": "double"},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "uid", "type": {"type": "string", "logicalType": "uuid"}},
        {
            "name": "meta",
            "type": {
                "type": "record",
                "name": "Meta",
                "fields": [
                    {"name": "count", "type": "int"},
                    {"name": "flag", "type": "boolean"},
                ],
            },
        },
        {"name": "other_meta", "type": ["null", "Meta"], "default": None},
        {"name": "status", "type": {"type": "enum", "name": "Status", "symbols": ["A", "B"]}},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "attrs", "type": {"type": "map", "values": "string"}},
        {"name": "either", "type": ["int", "string"]},
        {"name": "vec", "type": {"type": "array", "items": "float"}},
    ],
}


def settings(tmp_path: Path, source: dict[str, Any], **table: Any) -> Settings:
    return Settings.model_validate(
        {
            "kafka": {"bootstrap_servers": "localhost:9092", "topics": [TOPIC]},
            "source": source,
            "table": {
                "uri": str(tmp_path / "t.lance"),
                "vector": {"column": "vec", "dim": 4},
                **table,
            },
        }
    )


def registered(schema: str, schema_type: str) -> dict[str, Any]:
    reg = {"url": f"mock://{uuid.uuid4().hex}"}
    client = build_client(SchemaRegistrySettings(**reg))
    client.register_schema(f"{TOPIC}-value", Schema(schema, schema_type))
    return reg


def columns(s: Settings) -> dict[str, tuple[str, bool]]:
    return {c.name: (c.type, c.nullable) for c in s.table.columns}


def test_avro_schema_to_columns(tmp_path: Path) -> None:
    reg = registered(json.dumps(AVRO), "AVRO")
    derived = derive_settings(
        settings(tmp_path, {"format": "avro", "schema_registry": reg}, primary_key=["id"])
    )
    assert columns(derived) == {
        "id": ("string", True),
        "n": ("int64", True),
        "price": ("float64", True),
        "at": ("timestamp", True),
        "uid": ("string", True),
        "meta__count": ("int32", True),
        "meta__flag": ("bool", True),
        "other_meta__count": ("int32", True),
        "other_meta__flag": ("bool", True),
        "status": ("string", True),
    }
    assert derived.source.columns == {
        "meta__count": "$.meta.count",
        "meta__flag": "$.meta.flag",
        "other_meta__count": "$.other_meta.count",
        "other_meta__flag": "$.other_meta.flag",
    }
    assert derived.table.primary_key == ["id"]


def test_later_starts_derive_from_the_table(tmp_path: Path) -> None:
    reg = registered(json.dumps(AVRO), "AVRO")
    first = derive_settings(settings(tmp_path, {"format": "avro", "schema_registry": reg}))
    spec = TableSpec.from_settings(first.table)
    lance.write_dataset(spec.table_schema.empty_table(), first.table.uri)
    newer = {**AVRO, "fields": [*AVRO["fields"], {"name": "added", "type": "int"}]}
    build_client(SchemaRegistrySettings(**reg)).register_schema(
        f"{TOPIC}-value", Schema(json.dumps(newer), "AVRO")
    )
    again = derive_settings(settings(tmp_path, {"format": "avro", "schema_registry": reg}))
    assert columns(again) == columns(first)
    assert again.source.columns == first.source.columns


def test_json_schema_to_columns(tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "n": {"type": ["integer", "null"]},
            "x": {"type": "number"},
            "ok": {"type": "boolean"},
            "at": {"type": "string", "format": "date-time"},
            "blob": {"type": "string", "contentEncoding": "base64"},
            "inner": {"type": "object", "properties": {"k": {"type": "string"}}},
            "vec": {"type": "array", "items": {"type": "number"}},
        },
    }
    reg = registered(json.dumps(schema), "JSON")
    derived = derive_settings(settings(tmp_path, {"format": "json_schema", "schema_registry": reg}))
    assert columns(derived) == {
        "id": ("string", True),
        "n": ("int64", True),
        "x": ("float64", True),
        "ok": ("bool", True),
        "at": ("timestamp", True),
        "blob": ("binary", True),
        "inner__k": ("string", True),
    }


def test_protobuf_descriptor_set_to_columns(tmp_path: Path) -> None:
    files = descriptor_pb2.FileDescriptorSet()
    files.file.add().ParseFromString(timestamp_pb2.DESCRIPTOR.serialized_pb)
    files.file.append(order_file())
    path = tmp_path / "shop.desc"
    path.write_bytes(files.SerializeToString())
    source = {
        "format": "protobuf",
        "protobuf": {"descriptor_set": str(path), "message": "shop.Order"},
    }
    derived = derive_settings(settings(tmp_path, source))
    assert columns(derived) == {
        "id": ("string", True),
        "n": ("int64", True),
        "text": ("string", True),
        "at": ("timestamp", True),
        "meta__n": ("int32", True),
        "status": ("string", True),
        "blob": ("binary", True),
    }


def test_columns_are_required_without_a_registry_format(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs at least one column"):
        settings(tmp_path, {"format": "json"})


def test_an_unknown_subject_is_a_clear_error(tmp_path: Path) -> None:
    reg = {"url": f"mock://{uuid.uuid4().hex}"}
    with pytest.raises(LookupError, match="orders-value"):
        derive_settings(settings(tmp_path, {"format": "avro", "schema_registry": reg}))


def test_protobuf_registry_schema_to_columns(tmp_path: Path) -> None:
    reg = {"url": f"mock://{uuid.uuid4().hex}"}
    client = build_client(SchemaRegistrySettings(**reg))
    ser = ProtobufSerializer(order_class(), client, {"use.deprecated.format": False})
    ser(make_order(order_class(), 0), SerializationContext(TOPIC, MessageField.VALUE))
    source = {"format": "protobuf", "schema_registry": reg}
    first = derive_settings(settings(tmp_path, source))
    assert columns(first) == {"n": ("int32", True)}  # the first message: Meta
    source["protobuf"] = {"message": "shop.Order"}
    derived = derive_settings(settings(tmp_path, source))
    assert columns(derived)["meta__n"] == ("int32", True)
    assert columns(derived)["at"] == ("timestamp", True)
    assert "vec" not in columns(derived)


def test_evolve_adds_and_widens_from_newer_schemas(tmp_path: Path) -> None:
    older = {**AVRO, "fields": [f for f in AVRO["fields"] if f["name"] != "price"]}
    older["fields"] = [
        {"name": "n", "type": "int"} if f["name"] == "n" else f for f in older["fields"]
    ]
    reg = registered(json.dumps(older), "AVRO")
    first = derive_settings(settings(tmp_path, {"format": "avro", "schema_registry": reg}))
    assert columns(first)["n"] == ("int32", True)
    lance.write_dataset(
        TableSpec.from_settings(first.table).table_schema.empty_table(), first.table.uri
    )
    client = build_client(SchemaRegistrySettings(**reg))
    newest = client.register_schema(f"{TOPIC}-value", Schema(json.dumps(AVRO), "AVRO"))
    # A writer schema that is not the subject's latest: passed by id (a restart to evolve).
    other = {**AVRO, "fields": [*AVRO["fields"], {"name": "late", "type": "string"}]}
    other_id = client.register_schema("elsewhere-value", Schema(json.dumps(other), "AVRO"))
    assert newest != other_id
    src = {"format": "avro", "schema_registry": reg}
    evolved = derive_settings(settings(tmp_path, src, evolve=True), (other_id,))
    cols = columns(evolved)
    assert cols["n"] == ("int64", True)
    assert cols["price"] == ("float64", True)
    assert cols["late"] == ("string", True)
    unchanged = derive_settings(settings(tmp_path, src))
    assert columns(unchanged) == columns(first)


def test_mapped_columns_join_the_derived_ones(tmp_path: Path) -> None:
    reg = registered(json.dumps(AVRO), "AVRO")
    source = {
        "format": "avro",
        "schema_registry": reg,
        "columns": {"count": "$.meta.count", "placed_at": "@timestamp", "raw_key": "@key"},
    }
    derived = derive_settings(settings(tmp_path, source))
    cols = columns(derived)
    assert cols["count"] == ("int32", True)
    assert cols["placed_at"] == ("timestamp", True)
    assert cols["raw_key"] == ("binary", True)
    assert "meta__count" not in cols  # read into the configured column instead
    assert cols["meta__flag"] == ("bool", True)
    source["columns"] = {"k": "$.nowhere"}
    with pytest.raises(ValueError, match=r"'k' to '\$\.nowhere', whose type the schema does not"):
        derive_settings(settings(tmp_path, source))


def create_table(derived: Settings) -> None:
    lance.write_dataset(
        TableSpec.from_settings(derived.table).table_schema.empty_table(), derived.table.uri
    )


def running_check(derived: Settings) -> Decoder:
    """The decoder a sink started with `derived` settings runs, checking writer schemas."""
    return Decoder(TableSpec.from_settings(derived.table), derived.source, schema_check="evolve")


VEC = {"name": "vec", "type": "bytes"}


def test_evolve_widens_a_column_source_columns_maps(tmp_path: Path) -> None:
    """A newer schema that widens a field ``source.columns`` maps: the check while running
    asks for the widening, the restart's derivation widens the mapped column, and the check
    then asks for nothing (it widened only columns named like the field: a restart loop)."""
    customer = {"type": "record", "name": "Customer", "fields": [{"name": "id", "type": "int"}]}
    v1 = record_schema(
        {"name": "id", "type": "string"}, {"name": "customer", "type": customer}, VEC
    )
    reg = registered(v1, "AVRO")
    source = {
        "format": "avro",
        "schema_registry": reg,
        "columns": {"customer_id": "$.customer.id"},
    }
    first = derive_settings(settings(tmp_path, source, evolve=True))
    assert columns(first) == {"id": ("string", True), "customer_id": ("int32", True)}
    create_table(first)
    wider = {**customer, "fields": [{"name": "id", "type": "long"}]}
    v2 = record_schema({"name": "id", "type": "string"}, {"name": "customer", "type": wider}, VEC)
    value = serializer(reg, v2)({"id": "b", "customer": {"id": 5_000_000_000}, "vec": bytes(16)})
    with pytest.raises(SchemaEvolution, match=r"customer\.id \(int32 -> int64\)") as info:
        running_check(first).decode(msgs(value))
    evolved = derive_settings(settings(tmp_path, source, evolve=True), info.value.schema_ids)
    assert columns(evolved) == {"id": ("string", True), "customer_id": ("int64", True)}
    batch = running_check(evolved).decode(msgs(value)).batch
    assert batch is not None
    assert batch.column("customer_id").to_pylist() == [5_000_000_000]


def skipped_fields(logs: list[dict[str, Any]]) -> dict[str, str]:
    return {e["field"]: e["reason"] for e in logs if e["event"] == "schema_field_skipped"}


def test_a_field_named_like_a_nested_column_is_skipped_not_a_restart_loop(
    tmp_path: Path,
) -> None:
    """A newer field ``a__b`` beside the column ``a__b`` (which reads ``$.a.b``) gets no
    column: the check while running does not ask for it (it did, and the restart's
    derivation skipped it silently: a restart loop); both log why and how to map it."""
    inner = {"type": "record", "name": "A", "fields": [{"name": "b", "type": "int"}]}
    fields = [{"name": "id", "type": "string"}, {"name": "a", "type": inner}, VEC]
    reg = registered(record_schema(*fields), "AVRO")
    source = {"format": "avro", "schema_registry": reg}
    first = derive_settings(settings(tmp_path, source, evolve=True))
    assert first.source.columns == {"a__b": "$.a.b"}
    create_table(first)
    flat = {"name": "a__b", "type": ["null", "string"], "default": None}
    v2 = serializer(reg, record_schema(*fields, flat))
    value = v2({"id": "x", "a": {"b": 7}, "vec": bytes(16), "a__b": "flat"})
    with structlog.testing.capture_logs() as logs:
        batch = running_check(first).decode(msgs(value)).batch
    assert batch is not None
    assert batch.column("a__b").to_pylist() == [7]
    why = skipped_fields(logs)["a__b"]
    assert why.startswith("a column named a__b reads $.a.b; map it")
    assert '(NAME = "$.a__b")' in why
    with structlog.testing.capture_logs() as logs:
        again = derive_settings(settings(tmp_path, source, evolve=True))
    assert columns(again) == columns(first)
    assert skipped_fields(logs)["a__b"] == why


def test_a_field_named_like_a_nested_column_at_creation(tmp_path: Path) -> None:
    """Both in the first schema: the nested field gets the column, the other is skipped and
    logged (the settings had two columns a__b: a raw validation error at start-up)."""
    inner = {"type": "record", "name": "A", "fields": [{"name": "b", "type": "int"}]}
    flat = {"name": "a__b", "type": "string"}
    reg = registered(record_schema(flat, {"name": "a", "type": inner}, VEC), "AVRO")
    with structlog.testing.capture_logs() as logs:
        derived = derive_settings(settings(tmp_path, {"format": "avro", "schema_registry": reg}))
    assert columns(derived) == {"a__b": ("int32", True)}
    assert derived.source.columns == {"a__b": "$.a.b"}
    assert "a column named a__b reads $.a.b" in skipped_fields(logs)["a__b"]


def test_a_top_level_field_named_with_the_separator_is_mapped_not_derived(
    tmp_path: Path,
) -> None:
    """A field ``x__y`` cannot be a derived column (a later start reads ``x__y`` from
    ``$.x.y``: it read the field at the first start, then nothing); mapped in
    ``source.columns`` it is a column."""
    reg = registered(record_schema({"name": "x__y", "type": "int"}, VEC), "AVRO")
    src: dict[str, Any] = {"format": "avro", "schema_registry": reg}
    with pytest.raises(ValueError, match="no column could be derived from the schema"):
        derive_settings(settings(tmp_path, src))
    src["columns"] = {"x_y": "$.x__y"}
    derived = derive_settings(settings(tmp_path, src))
    create_table(derived)
    again = derive_settings(settings(tmp_path, src))
    assert columns(again) == {"x_y": ("int32", True)}
    assert again.source.columns == {"x_y": "$.x__y"}


def test_without_evolve_fields_the_table_lacks_are_logged_once_per_schema(
    tmp_path: Path,
) -> None:
    """Derived columns, ``table.evolve = false``: a writer schema with a new field and a
    widened one is decoded as before (the new field not read, a value beyond the column
    a dead letter), and one warning per schema id names both and the setting that would
    take them (the field was dropped silently)."""
    base = [{"name": "id", "type": "string"}, {"name": "qty", "type": "int"}, VEC]
    reg = registered(record_schema(*base), "AVRO")
    source = {"format": "avro", "schema_registry": reg}
    first = derive_settings(settings(tmp_path, source))
    create_table(first)
    v1 = serializer(reg, record_schema(*base))({"id": "a", "qty": 1, "vec": bytes(16)})
    newer = [
        {"name": "id", "type": "string"},
        {"name": "qty", "type": "long"},
        VEC,
        {"name": "coupon", "type": ["null", "string"], "default": None},
    ]
    v2 = serializer(reg, record_schema(*newer))
    dec = Decoder(TableSpec.from_settings(first.table), first.source, schema_check="warn")
    with structlog.testing.capture_logs() as logs:
        out = dec.decode(msgs(v1, v2({"id": "b", "qty": 2**40, "vec": bytes(16), "coupon": "c"})))
        again = dec.decode(msgs(v2({"id": "c", "qty": 3, "vec": bytes(16), "coupon": "d"})))
    assert [(d.reason, d.offset) for d in out.dead_letters] == [("wrong_type", 101)]
    assert again.batch is not None
    assert again.batch.column("qty").to_pylist() == [3]
    warned = [e for e in logs if e["event"] == "schema_fields_not_in_table"]
    assert len(warned) == 1
    assert warned[0]["schema_id"] == 2
    assert warned[0]["fields"] == ["qty (int32 -> int64)", "coupon (new, string)"]
    assert "table.evolve = true would add or widen" in warned[0]["hint"]


def test_derived_columns_that_do_not_fit_the_settings_name_the_key(tmp_path: Path) -> None:
    """`run` with derived columns the other settings refuse reports the key and its file,
    as other configuration errors (it printed pydantic's raw validation error)."""
    files = descriptor_pb2.FileDescriptorSet()
    files.file.add().ParseFromString(timestamp_pb2.DESCRIPTOR.serialized_pb)
    files.file.append(order_file())
    (tmp_path / "shop.desc").write_bytes(files.SerializeToString())
    config = tmp_path / "sink.toml"
    config.write_text(
        f"""
[kafka]
bootstrap_servers = "localhost:9092"
topics = ["{TOPIC}"]

[source]
format = "protobuf"
protobuf = {{ descriptor_set = "{tmp_path / "shop.desc"}", message = "shop.Order" }}

[table]
uri = "{tmp_path / "t.lance"}"
primary_key = ["order_id"]
"""
    )
    run = cli("run", "--config", str(config))
    assert run.returncode == 2, run.stderr
    assert (
        f"table.primary_key (file {config}): 'order_id' is not a column of the table" in run.stderr
    )
    assert "pydantic" not in run.stderr


def test_a_field_of_a_registry_key_is_typed_by_the_key_subject(tmp_path: Path) -> None:
    """An upsert table keyed by a field of an Avro key: `@key.id` is typed by the latest
    `<topic>-key` schema. It needed `table.columns` ("whose type the schema does not give")."""
    reg = registered(json.dumps(AVRO), "AVRO")
    key = {
        "type": "record",
        "name": "OrderKey",
        "fields": [{"name": "id", "type": "long"}, {"name": "region", "type": "string"}],
    }
    client = build_client(SchemaRegistrySettings(**reg))
    client.register_schema(f"{TOPIC}-key", Schema(json.dumps(key), "AVRO"))
    source = {
        "format": "avro",
        "key_format": "avro",
        "schema_registry": reg,
        "columns": {"order_id": "@key.id", "region": "@key.region"},
    }
    derived = derive_settings(settings(tmp_path, source, mode="upsert", primary_key=["order_id"]))
    cols = columns(derived)
    assert cols["order_id"] == ("int64", True)
    assert cols["region"] == ("string", True)
    assert cols["price"] == ("float64", True)  # the value's fields as before
    assert derived.source.columns["order_id"] == "@key.id"
    assert derived.table.primary_key == ["order_id"]
    source["columns"] = {"order_id": "@key.nowhere"}
    with pytest.raises(ValueError, match=r"'@key\.nowhere', whose type the key's schema does"):
        derive_settings(settings(tmp_path, source))
