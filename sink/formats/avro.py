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
from sink.formats.registry import classify, framing_fault

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

        if payload[0] != 0:
            return None  # a schema GUID: not checked
        schema = self._client.get_schema(int.from_bytes(payload[1:5], "big"))
        return None if schema.schema_str is None else text_leaves("avro", schema.schema_str)

    def records(self, payloads: Sequence[bytes]) -> tuple[list[int], list[Any], dict[int, Fault]]:
        """Decode each payload.

        Returns:
            The positions of the payloads that decoded, their records, and the fault of
            every other payload by position.

        Raises:
            RegistryUnavailable: the registry could not be asked for a schema.
        """
        deserialize = self._deserializer
        positions: list[int] = []
        records: list[Any] = []
        faults: dict[int, Fault] = {}
        unknown: dict[bytes, Fault] = {}  # schema ids the registry said it does not know
        for pos, payload in enumerate(payloads):
            fault = framing_fault(payload) or unknown.get(payload[:5])
            if fault is None:
                try:
                    record = deserialize(payload, None)
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
