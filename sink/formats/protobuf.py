"""Protobuf values as dynamic messages: no generated code in the image.

With a registry, values are in the Confluent wire format (magic byte, schema id, message
indexes): confluent-kafka's `ProtobufDeserializer` machinery reads the framing, fetches the
writer schema once per id and builds its descriptors (`_DynamicDeserializer` reuses those
steps; the stock deserializer parses into one generated class given up front). Without a
registry, ``source.protobuf.descriptor_set`` (a ``FileDescriptorSet`` from ``protoc
--include_imports --descriptor_set_out``) and ``source.protobuf.message`` name the type,
and each value is that message's bytes, unframed.

Messages become Python records field by field (`message_record`): proto3 scalars without
presence read their default (0, "", false) when unset, as protobuf itself does; fields with
presence (``optional``, oneof members, messages) read null when unset; repeated fields are
lists, maps are dicts, enums their value names; the well-known types read as values
(``google.protobuf.Timestamp`` as a UTC datetime, ``Duration`` as seconds, the wrappers
as their value, ``Struct``/``Value``/``ListValue`` as JSON-like values).
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.common.serde import SchemaId
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
from google.protobuf import empty_pb2, json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from config.settings import descriptor_pool, find_message
from sink.formats.leaves import proto_leaves
from sink.formats.records import Fault
from sink.formats.registry import decode_framed

__all__ = ["ProtobufFormat", "message_record"]

_WRAPPERS: Final = frozenset(
    f"google.protobuf.{name}Value"
    for name in ("Double", "Float", "Int64", "UInt64", "Int32", "UInt32", "Bool", "String", "Bytes")
)
_JSON_LIKE: Final = frozenset(
    {"google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"}
)


def _well_known(full_name: str) -> Callable[[Any], Any] | None:
    if full_name == "google.protobuf.Timestamp":
        return lambda m: m.ToDatetime(tzinfo=dt.UTC)
    if full_name == "google.protobuf.Duration":
        return lambda m: m.ToTimedelta().total_seconds()
    if full_name in _WRAPPERS:
        return lambda m: m.value
    if full_name in _JSON_LIKE:
        to_dict: Callable[[Any], Any] = json_format.MessageToDict
        return to_dict
    return None


def message_record(msg: Message) -> Any:
    """A protobuf message as Python values (see the module docstring)."""
    convert = _well_known(msg.DESCRIPTOR.full_name)
    if convert is not None:
        return convert(msg)
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.is_repeated:
            entry = field.message_type
            if entry is not None and entry.GetOptions().map_entry:
                value_field = entry.fields_by_name["value"]
                out[field.name] = {k: _scalar(value_field, v) for k, v in value.items()}
            else:
                out[field.name] = [_scalar(field, v) for v in value]
        elif field.has_presence and not msg.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _scalar(field, value)
    return out


def _scalar(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_record(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        named = field.enum_type.values_by_number.get(value)
        return value if named is None else named.name
    return value


class _DynamicDeserializer(ProtobufDeserializer):
    """`ProtobufDeserializer`'s framing, schema fetch and descriptor building, parsing into
    a message class made from the writer's descriptor (cached per schema and index)."""

    def __init__(self, client: SchemaRegistryClient) -> None:
        # The stock constructor wants a generated class; it is never used here.
        super().__init__(empty_pb2.Empty, {}, client)
        self._classes: dict[tuple[int | str, tuple[int, ...]], type[Message]] = {}
        self._classes_lock = threading.Lock()
        self._known_ids: set[bytes] = set()  # framed ids whose writer schema was fetched

    def message(self, data: bytes) -> Message:
        cls, payload = self._message_class(data)
        msg = cls()
        msg.ParseFromString(payload.read())
        return msg

    def descriptor(self, data: bytes) -> Descriptor:
        """The writer's descriptor of a framed payload."""
        desc: Descriptor = self._message_class(data)[0].DESCRIPTOR
        return desc

    def _message_class(self, data: bytes) -> tuple[type[Message], Any]:
        framed_id = data[1:5] if data[:1] == b"\x00" else None
        if framed_id is not None and framed_id not in self._known_ids:
            # The writer schema first, by its id, as the other formats read it: an unknown
            # id is `unknown_schema_id` whatever the message indexes after it hold. (Read
            # after them, a bad index made a message `not_matching_schema` alone but
            # `unknown_schema_id` after another message naming that id, which
            # `decode_framed` asks the registry about once per batch.)
            self._registry.get_schema(int.from_bytes(framed_id, "big"), None, "serialized")
            self._known_ids.add(framed_id)
        schema_id = SchemaId("PROTOBUF")
        payload = self._schema_id_deserializer(data, None, schema_id)
        indexes = tuple(schema_id.message_indexes or (0,))
        key = (schema_id.id if schema_id.id is not None else str(schema_id.guid), indexes)
        cls = self._classes.get(key)
        if cls is None:
            writer = self._get_writer_schema(schema_id, None, fmt="serialized")
            fd_proto, pool = self._get_parsed_schema(writer)
            desc = self._get_message_desc(pool, pool.FindFileByName(fd_proto.name), list(indexes))
            cls = GetMessageClass(desc)
            with self._classes_lock:
                self._classes[key] = cls
        return cls, payload


class ProtobufFormat:
    """Decodes Protobuf payloads into Python records: framed with a registry, or plain
    messages of one type from a descriptor set. Safe to call from several threads."""

    name = "Protobuf"

    def __init__(
        self,
        client: SchemaRegistryClient | None,
        descriptor_set: str | None = None,
        message: str | None = None,
    ) -> None:
        self._deserializer = _DynamicDeserializer(client) if client is not None else None
        self._message = message  # with a registry: the type derived columns come from
        self._cls: type[Message] | None = None
        if client is None:
            if descriptor_set is None or message is None:
                raise ValueError("protobuf needs a schema registry or a descriptor set and message")
            self._cls = GetMessageClass(load_descriptor(descriptor_set, message))

    def writer_leaves(self, payload: bytes) -> list[tuple[tuple[str, ...], str | None]] | None:
        """The leaves of the writer's message type, if it is the type derived columns come
        from (``source.protobuf.message``, else its schema's first message); else None."""
        if self._deserializer is None or payload[:1] != b"\x00":
            return None

        desc = self._deserializer.descriptor(payload)
        if self._message is not None:
            derived_from = desc.full_name == self._message
        else:
            first = next(iter(desc.file.message_types_by_name.values()), None)
            derived_from = first is not None and first.full_name == desc.full_name
        return proto_leaves(desc) if derived_from else None

    def writer_schema(self, payload: bytes) -> Descriptor | None:
        """The message type `payload` was written with: the writer's (framed, with a
        registry; None when not framed) or the descriptor set's."""
        if self._cls is not None:
            desc: Descriptor = self._cls.DESCRIPTOR
            return desc
        if self._deserializer is None or payload[:1] != b"\x00":
            return None
        return self._deserializer.descriptor(payload)

    def records(
        self, payloads: Sequence[bytes], epoch_ms: frozenset[tuple[str, ...]] = frozenset()
    ) -> tuple[list[int], list[Any], dict[int, Fault]]:
        """See `sink.formats.RecordFormat` (timestamps come as they are: `epoch_ms` is
        unused)."""
        if self._cls is None:
            assert self._deserializer is not None
            deserializer = self._deserializer
            # Converted inside the per-message decode: a value Python cannot hold (a
            # Timestamp beyond the years 1-9999) is that message's fault.
            return decode_framed(
                payloads, lambda data: message_record(deserializer.message(data)), self.name
            )
        positions = []
        records: list[Any] = []
        faults = {}
        for pos, payload in enumerate(payloads):
            msg = self._cls()
            try:
                msg.ParseFromString(payload)
                record = message_record(msg)
            except Exception as exc:  # noqa: BLE001 - every failure is sorted by _plain_fault
                faults[pos] = _plain_fault(exc, self._cls)
                continue
            positions.append(pos)
            records.append(record)
        return positions, records, faults


def _plain_fault(exc: Exception, cls: type[Message]) -> Fault:
    name = cls.DESCRIPTOR.full_name
    if isinstance(exc, DecodeError):
        return ("not_matching_schema", f"value is not a {name} message: {exc}")
    if isinstance(exc, ValueError | OverflowError):  # a Timestamp beyond the years 1-9999
        return ("not_matching_schema", f"value is a {name} message Python cannot read: {exc}")
    raise exc


def registry_descriptor(
    client: SchemaRegistryClient, schema: Any, message: str | None = None
) -> Descriptor:
    """A message type of a registered Protobuf schema: `message` (a full name), or the
    schema's first message (message index 0, the Confluent default)."""
    helper = _DynamicDeserializer(client)
    fd_proto, pool = helper._get_parsed_schema(schema)
    if message is not None:
        try:
            found: Descriptor = pool.FindMessageTypeByName(message)
        except KeyError as exc:
            raise ValueError(f"the registered schema has no message {message!r}") from exc
        return found
    desc: Descriptor = helper._get_message_desc(pool, pool.FindFileByName(fd_proto.name), [0])
    return desc


def load_descriptor(path: str, message: str) -> Descriptor:
    """The descriptor of `message` from a ``FileDescriptorSet`` file (read as the settings
    check it: `config.settings.descriptor_pool`).

    Raises:
        ValueError: the file cannot be read or parsed, or lacks the message (or an import).
    """
    pool, names = descriptor_pool(path)
    return find_message(pool, names, path, message)
