"""Protobuf (dynamic messages: from the registry's schema, or a descriptor set file) and
JSON Schema, produced with confluent-kafka's own serializers into the ``mock://`` registry.
The message classes are built at run time from descriptors: no generated code."""

from __future__ import annotations

import functools
import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, timestamp_pb2
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass

from config.settings import SchemaRegistrySettings, SourceSettings
from sink.decode import Decoder
from sink.formats import SchemaEvolution
from sink.formats.registry import build_client
from tests.unit.test_decode import Msg, decode, spec_for

TOPIC = "orders"
F = descriptor_pb2.FieldDescriptorProto


def order_file(extra_field: bool = False) -> descriptor_pb2.FileDescriptorProto:
    """shop.proto: Order {id, optional n, text, repeated float vec, Timestamp at, Meta
    meta, Status status, bytes blob}, Meta {int32 n}, enum Status."""
    fd = descriptor_pb2.FileDescriptorProto(
        name="shop.proto",
        package="shop",
        syntax="proto3",
        dependency=["google/protobuf/timestamp.proto"],
    )
    meta = fd.message_type.add(name="Meta")
    meta.field.add(name="n", number=1, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL)
    status = fd.enum_type.add(name="Status")
    status.value.add(name="UNKNOWN", number=0)
    status.value.add(name="OK", number=1)
    order = fd.message_type.add(name="Order")
    order.field.add(name="id", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    order.field.add(
        name="n", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL, proto3_optional=True,
        oneof_index=0,
    )  # fmt: skip
    order.oneof_decl.add(name="_n")
    order.field.add(name="text", number=3, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    order.field.add(name="vec", number=4, type=F.TYPE_FLOAT, label=F.LABEL_REPEATED)
    order.field.add(
        name="at", number=5, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
        type_name=".google.protobuf.Timestamp",
    )  # fmt: skip
    order.field.add(
        name="meta", number=6, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL, type_name=".shop.Meta"
    )
    order.field.add(
        name="status", number=7, type=F.TYPE_ENUM, label=F.LABEL_OPTIONAL, type_name=".shop.Status"
    )
    order.field.add(name="blob", number=8, type=F.TYPE_BYTES, label=F.LABEL_OPTIONAL)
    if extra_field:
        order.field.add(name="extra", number=9, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL)
    return fd


@functools.cache
def order_class(extra_field: bool = False) -> Any:
    pool = DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(order_file(extra_field))
    return GetMessageClass(pool.FindMessageTypeByName("shop.Order"))


SPEC_COLUMNS = [
    {"name": "id", "type": "string", "nullable": False},
    {"name": "n", "type": "int64"},
    {"name": "text", "type": "string"},
    {"name": "at", "type": "timestamp"},
    {"name": "meta_n", "type": "int32"},
    {"name": "status", "type": "string"},
    {"name": "blob", "type": "binary"},
]


def make_order(cls: Any, i: int, **extra: Any) -> Any:
    msg = cls(id=f"id-{i}", text=f"t{i}", vec=[i, 0.5, -1, 2], status=1, blob=b"\x00\x01", **extra)
    if i % 2 == 0:
        msg.n = i
        msg.meta.n = i * 10
    msg.at.FromDatetime(datetime(2026, 1, 2, 3, 4, 5, 6000))
    return msg


def check_orders(rows: list[dict[str, Any]], ids: list[int]) -> None:
    assert [r["id"] for r in rows] == [f"id-{i}" for i in ids]
    assert [r["n"] for r in rows] == [i if i % 2 == 0 else None for i in ids]
    assert [r["meta_n"] for r in rows] == [i * 10 if i % 2 == 0 else None for i in ids]
    assert rows[0]["at"] == datetime(2026, 1, 2, 3, 4, 5, 6000, tzinfo=UTC)
    assert rows[0]["status"] == "OK"
    assert rows[0]["blob"] == b"\x00\x01"
    assert rows[-1]["vec"] == [float(ids[-1]), 0.5, -1.0, 2.0]


def test_protobuf_dynamic_messages_from_the_registry() -> None:
    reg = {"url": f"mock://{uuid.uuid4().hex}"}
    client = build_client(SchemaRegistrySettings(**reg))
    ctx = SerializationContext(TOPIC, MessageField.VALUE)
    ser = ProtobufSerializer(order_class(), client, {"use.deprecated.format": False})
    newer = ProtobufSerializer(order_class(True), client, {"use.deprecated.format": False})
    good = [ser(make_order(order_class(), i), ctx) for i in range(3)]
    evolved = newer(make_order(order_class(True), 3, extra=7), ctx)
    truncated = good[0][:-1]  # inside the last field
    values = [*good, evolved, truncated, b"not framed"]
    spec = spec_for(SPEC_COLUMNS)
    columns = {"meta_n": "$.meta.n"}
    out, rows = decode(
        spec,
        [Msg(v, i) for i, v in enumerate(values)],
        format="protobuf",
        schema_registry=reg,
        columns=columns,
    )
    check_orders(rows, [0, 1, 2, 3])
    assert [(d.offset, d.reason) for d in out.dead_letters] == [
        (4, "not_matching_schema"),
        (5, "missing_magic_byte"),
    ]


def test_protobuf_from_a_descriptor_set_without_a_registry(tmp_path: Path) -> None:
    files = descriptor_pb2.FileDescriptorSet()
    files.file.add().ParseFromString(timestamp_pb2.DESCRIPTOR.serialized_pb)
    files.file.append(order_file())
    path = tmp_path / "shop.desc"
    path.write_bytes(files.SerializeToString())
    cls = order_class()
    values = [make_order(cls, i).SerializeToString() for i in range(2)] + [b"\xff\xff\xff"]
    out, rows = decode(
        spec_for(SPEC_COLUMNS),
        [Msg(v, i) for i, v in enumerate(values)],
        format="protobuf",
        protobuf={"descriptor_set": str(path), "message": "shop.Order"},
        columns={"meta_n": "$.meta.n"},
    )
    check_orders(rows, [0, 1])
    assert [(d.offset, d.reason) for d in out.dead_letters] == [(2, "not_matching_schema")]
    assert "not a shop.Order message" in out.dead_letters[0].detail


def test_descriptor_set_errors_name_the_problem(tmp_path: Path) -> None:
    files = descriptor_pb2.FileDescriptorSet()
    files.file.append(order_file())  # without timestamp.proto: protoc without --include_imports
    path = tmp_path / "shop.desc"
    path.write_bytes(files.SerializeToString())
    with pytest.raises(ValueError, match="--include_imports"):
        decode(
            spec_for(SPEC_COLUMNS),
            [Msg(b"", 0)],
            format="protobuf",
            protobuf={"descriptor_set": str(path), "message": "shop.Order"},
        )


def test_json_schema_validated_against_the_writer_schema() -> None:
    reg = {"url": f"mock://{uuid.uuid4().hex}"}
    client = build_client(SchemaRegistrySettings(**reg))
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "Order",
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "n": {"type": ["integer", "null"]},
            "at": {"type": "string", "format": "date-time"},
            "blob": {"type": "string", "contentEncoding": "base64"},
            "vec": {"type": "array", "items": {"type": "number"}},
        },
        "required": ["id", "vec"],
    }
    ser = JSONSerializer(json.dumps(schema), client)
    ctx = SerializationContext(TOPIC, MessageField.VALUE)
    good = [
        ser({"id": f"id-{i}", "n": i, "at": "2026-01-02T03:04:05.006Z", "blob": "AAE=",
             "vec": [i, 0.5, -1, 2]}, ctx)
        for i in range(2)
    ]  # fmt: skip
    # Framed with the same schema id but not valid against it (n is a string, no vec).
    invalid = good[0][:5] + json.dumps({"id": "x", "n": "seven"}).encode()
    not_json = good[0][:5] + b"{oops"
    spec = spec_for(
        [
            {"name": "id", "type": "string", "nullable": False},
            {"name": "n", "type": "int64"},
            {"name": "at", "type": "timestamp"},
            {"name": "blob", "type": "binary"},
        ]
    )
    values = [*good, invalid, not_json]
    out, rows = decode(
        spec, [Msg(v, i) for i, v in enumerate(values)], format="json_schema", schema_registry=reg
    )
    assert [r["id"] for r in rows] == ["id-0", "id-1"]
    assert rows[1]["at"] == datetime(2026, 1, 2, 3, 4, 5, 6000, tzinfo=UTC)
    assert rows[1]["blob"] == b"\x00\x01"
    assert rows[1]["vec"] == [1.0, 0.5, -1.0, 2.0]
    assert [(d.offset, d.reason) for d in out.dead_letters] == [
        (2, "not_matching_schema"),
        (3, "invalid_json"),
    ]


def test_protobuf_writer_schemas_needing_evolution_are_signalled() -> None:
    reg = {"url": f"mock://{uuid.uuid4().hex}"}
    client = build_client(SchemaRegistrySettings(**reg))
    ctx = SerializationContext(TOPIC, MessageField.VALUE)
    conf = {"use.deprecated.format": False}
    old = ProtobufSerializer(order_class(), client, conf)(make_order(order_class(), 0), ctx)
    new = ProtobufSerializer(order_class(True), client, conf)(
        make_order(order_class(True), 1, extra=5), ctx
    )
    source = SourceSettings(
        format="protobuf",
        schema_registry=reg,
        protobuf={"message": "shop.Order"},
        columns={"meta_n": "$.meta.n"},
    )
    dec = Decoder(spec_for(SPEC_COLUMNS), source, schema_check="evolve")
    assert dec.decode([Msg(old, 0)]).batch is not None
    with pytest.raises(SchemaEvolution, match=r"extra \(new, int32\)"):
        dec.decode([Msg(old, 0), Msg(new, 1)])
