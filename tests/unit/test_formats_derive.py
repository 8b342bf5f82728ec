"""Table columns derived from the value subject's latest schema (`sink.formats.derive`),
for each registry format, and from the existing table on later starts."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import lance
import pytest
from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, timestamp_pb2

from config.settings import SchemaRegistrySettings, Settings
from engine.schema import TableSpec
from sink.formats.derive import derive_settings
from sink.formats.registry import build_client
from tests.unit.test_formats_protobuf_json import make_order, order_class, order_file

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
