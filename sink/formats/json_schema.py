"""JSON Schema values in the Confluent wire format, through confluent-kafka's
`JSONDeserializer`: the framing is read, the writer schema fetched once per id, the
document parsed and validated against that schema (a document that does not validate is
``not_matching_schema``, one that is not JSON ``invalid_json``). Columns are then filled
from record paths as for Avro; JSON has no timestamp or bytes type, so a timestamp column
takes an ISO-8601 string or epoch milliseconds and a binary column a base64 string.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.json_schema import JSONDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from sink.formats.records import Fault
from sink.formats.registry import classify, framing_fault

__all__ = ["JsonSchemaFormat"]


class JsonSchemaFormat:
    """Decodes framed JSON Schema payloads into Python records (validated dicts)."""

    name = "JSON Schema"

    def __init__(self, client: SchemaRegistryClient) -> None:
        self._client = client
        self._deserializer = JSONDeserializer(None, schema_registry_client=client)

    def writer_leaves(self, payload: bytes) -> list[tuple[tuple[str, ...], str | None]] | None:
        """The leaves of `payload`'s writer schema (fetched once per id by the client)."""
        from sink.formats.derive import text_leaves  # noqa: PLC0415

        if payload[0] != 0:
            return None  # a schema GUID: not checked
        schema = self._client.get_schema(int.from_bytes(payload[1:5], "big"))
        return None if schema.schema_str is None else text_leaves("json_schema", schema.schema_str)

    def records(self, payloads: Sequence[bytes]) -> tuple[list[int], list[Any], dict[int, Fault]]:
        """See `sink.formats.RecordFormat`."""
        deserialize = self._deserializer
        # The deserializer needs a context to name the subject; no rules or migrations are
        # configured, so only the writer schema (by id) is used.
        ctx = SerializationContext("", MessageField.VALUE)
        positions: list[int] = []
        records: list[Any] = []
        faults: dict[int, Fault] = {}
        unknown: dict[bytes, Fault] = {}
        for pos, payload in enumerate(payloads):
            fault = framing_fault(payload) or unknown.get(payload[:5])
            if fault is None:
                try:
                    record = deserialize(payload, ctx)
                except json.JSONDecodeError as exc:
                    fault = ("invalid_json", f"value is not JSON: {exc}")
                except Exception as exc:  # noqa: BLE001 - every failure is sorted by classify
                    fault = classify(exc, payload, self.name)
                    if fault[0] == "unknown_schema_id":
                        unknown[payload[:5]] = fault
                else:
                    positions.append(pos)
                    records.append(record)
                    continue
            faults[pos] = fault
        return positions, records, faults
