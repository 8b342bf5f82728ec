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

from sink.formats.leaves import text_leaves
from sink.formats.records import Fault
from sink.formats.registry import decode_framed, writer_schema_text

__all__ = ["JsonSchemaFormat"]


class JsonSchemaFormat:
    """Decodes framed JSON Schema payloads into Python records (validated dicts)."""

    name = "JSON Schema"

    def __init__(self, client: SchemaRegistryClient, *, validate: bool = True) -> None:
        """`validate`: check each document against its writer schema (a document that
        does not validate is ``not_matching_schema``); off for change events, which Kafka
        Connect's converter writes without validating (`sink.cdc`)."""
        self._client = client
        self._deserializer = JSONDeserializer(
            None, schema_registry_client=client, conf={"validate": validate}
        )

    def writer_schema(self, payload: bytes) -> Any:
        """The parsed writer schema `payload` names by id (fetched once per id by the
        client), or None when it names none by id or does not parse."""
        text = writer_schema_text(self._client, payload)
        try:
            return None if text is None else json.loads(text)
        except ValueError:
            return None

    def writer_leaves(self, payload: bytes) -> list[tuple[tuple[str, ...], str | None]] | None:
        """The leaves of `payload`'s writer schema (fetched once per id by the client)."""

        text = writer_schema_text(self._client, payload)
        return None if text is None else text_leaves("json_schema", text)

    def records(
        self, payloads: Sequence[bytes], epoch_ms: frozenset[tuple[str, ...]] = frozenset()
    ) -> tuple[list[int], list[Any], dict[int, Fault]]:
        """See `sink.formats.RecordFormat` (timestamps come as they are: `epoch_ms` is
        unused)."""
        deserialize = self._deserializer
        # The deserializer needs a context to name the subject; no rules or migrations are
        # configured, so only the writer schema (by id) is used.
        ctx = SerializationContext("", MessageField.VALUE)
        return decode_framed(
            payloads, lambda payload: deserialize(payload, ctx), self.name, _json_fault
        )


def _json_fault(exc: Exception) -> Fault | None:
    """A value that is not JSON at all (any other failure is `classify`'s)."""
    if isinstance(exc, json.JSONDecodeError):
        return ("invalid_json", f"value is not JSON: {exc}")
    return None
