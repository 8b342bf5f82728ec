"""Avro values in the Confluent wire format, through confluent-kafka's `AvroDeserializer`.

The deserializer reads the schema id after the magic byte, fetches the writer schema from
the registry once per id (the client caches it), and decodes with fastavro. No reader
schema is given: each message decodes with the schema it was written with, and columns
are looked up by record path, so messages of older and newer compatible schemas fill the
same columns (a field a message's schema lacks is null). Unions with null decode to the
value or None; logical types arrive as Python values (timestamp-millis/micros as
datetime, date as date, decimal as Decimal, uuid as UUID) that `sink.formats.records`
converts per column.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer

from sink.formats.records import Fault
from sink.formats.registry import decode_framed, writer_schema_text

__all__ = ["AvroFormat"]


class AvroFormat:
    """Decodes framed Avro payloads into Python records (dicts).

    Built once per `sink.decode.Decoder`; `records` may be called from several decode
    threads at once (the deserializer's caches are the client's, which locks them).
    """

    name = "Avro"

    def __init__(self, client: SchemaRegistryClient) -> None:
        self._client = client
        self._deserializer = AvroDeserializer(client)

    def writer_leaves(self, payload: bytes) -> list[tuple[tuple[str, ...], str | None]] | None:
        """The leaves of `payload`'s writer schema (fetched once per id by the client)."""
        from sink.formats.derive import text_leaves  # noqa: PLC0415

        text = writer_schema_text(self._client, payload)
        return None if text is None else text_leaves("avro", text)

    def records(self, payloads: Sequence[bytes]) -> tuple[list[int], list[Any], dict[int, Fault]]:
        """Decode each payload.

        Returns:
            The positions of the payloads that decoded, their records, and the fault of
            every other payload by position.

        Raises:
            RegistryUnavailable: the registry could not be asked for a schema.
        """
        deserialize = self._deserializer
        return decode_framed(payloads, lambda payload: deserialize(payload, None), self.name)
