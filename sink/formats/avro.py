"""Avro values in the Confluent wire format: confluent-kafka's registry client and schema
parsing, fastavro's ``schemaless_reader`` per message.

The schema id after the magic byte names the writer schema; the registry client fetches
it once per id (and caches it), and it is parsed once per id, by confluent-kafka's own
`AvroDeserializer` (so named references to other subjects resolve as they do there). Each
message then decodes with fastavro's ``schemaless_reader`` against that parsed schema,
which is what `AvroDeserializer` does underneath. The deserializer itself is called per
message only for payloads that name their schema by GUID (magic byte 1): per message it
costs ~3x the fastavro read itself (it looks the schema up in the client, rebuilds the
framing reader and expands the schema for rules on every call), and with no
serialization context (the sink has none) it applies no rules, migrations or ``from_dict``,
so the direct read gives the same records. `tests/unit/test_formats_avro.py` checks
records and dead letters against the deserializer on a corpus of several schema versions,
logical types, unions, bytes and bad payloads.

No reader schema is given: each message decodes with the schema it was written with, and
columns are looked up by record path, so messages of older and newer compatible schemas
fill the same columns (a field a message's schema lacks is null). Unions with null decode
to the value or None; logical types arrive as Python values (timestamp-millis/micros as
datetime, date as date, decimal as Decimal, uuid as UUID) that `sink.formats.records`
converts per column.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from io import BytesIO
from typing import Any, Final

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from fastavro import schemaless_reader

from sink.formats.records import Fault
from sink.formats.registry import classify, decode_framed, framing_fault, writer_schema_text

__all__ = ["AvroFormat"]

#: The magic byte of a payload that names its writer schema by a 4-byte id.
_MAGIC_ID: Final = 0
#: Bytes of the Confluent framing before the Avro data (magic byte and schema id).
_HEADER_BYTES: Final = 5

#: Reads one message's Avro data (after the framing) into a Python value.
_Read = Callable[[bytes], Any]


class AvroFormat:
    """Decodes framed Avro payloads into Python records (dicts).

    Built once per `sink.decode.Decoder`; `records` may be called from several decode
    threads at once: the readers cached per schema id are immutable (two threads that miss
    at once both build one, and either is kept), and the client locks its own caches.
    """

    name = "Avro"

    def __init__(self, client: SchemaRegistryClient) -> None:
        self._client = client
        self._deserializer = AvroDeserializer(client)
        #: A reader per schema id that has been fetched and parsed. Ids the registry did not
        #: know are not kept: the id may be registered later.
        self._readers: dict[int, _Read] = {}

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
        positions: list[int] = []
        records: list[Any] = []
        faults: dict[int, Fault] = {}
        # Per header (magic byte and id): its reader, or the fault of every payload with it.
        # A header the registry does not know is asked about once per call.
        readers: dict[bytes, _Read | Fault] = {}
        guid: list[int] = []  # payloads that name their schema by GUID: the deserializer's
        for pos, payload in enumerate(payloads):
            header = payload[:_HEADER_BYTES]
            read = readers.get(header)
            if read is None or len(payload) <= _HEADER_BYTES:
                fault = framing_fault(payload)
                if fault is not None:
                    faults[pos] = fault
                    continue
                if payload[0] != _MAGIC_ID:
                    guid.append(pos)
                    continue
                read = readers[header] = self._reader(payload)
            if isinstance(read, tuple):
                faults[pos] = read
                continue
            try:
                record = read(payload)
            except Exception as exc:  # noqa: BLE001 - every failure is sorted by classify
                faults[pos] = classify(exc, payload, self.name)
            else:
                positions.append(pos)
                records.append(record)
        if guid:
            deserialize = self._deserializer
            at, got, bad = decode_framed(
                [payloads[p] for p in guid], lambda payload: deserialize(payload, None), self.name
            )
            faults.update((guid[i], fault) for i, fault in bad.items())
            positions, records = _merge(positions, records, [guid[i] for i in at], got)
        return positions, records, faults

    def _reader(self, payload: bytes) -> _Read | Fault:
        """The reader of the schema id `payload` names, or the fault of every payload that
        names it (an id the registry does not know, a schema that does not parse).

        Raises:
            RegistryUnavailable: the registry could not be asked.
        """
        schema_id = int.from_bytes(payload[1:_HEADER_BYTES], "big")
        read = self._readers.get(schema_id)
        if read is not None:
            return read
        try:
            # The same calls AvroDeserializer makes for a message: the client's cached
            # schema, parsed with its named references by the deserializer's own method
            # (private, but the one place that parsing is done; the tests compare records).
            schema = self._client.get_schema(schema_id)
            parsed = self._deserializer._get_parsed_schema(schema)
        except Exception as exc:  # noqa: BLE001 - every failure is sorted by classify
            return classify(exc, payload, self.name)
        read = _bytes_reader if _is_bytes(parsed) else _record_reader(parsed)
        self._readers[schema_id] = read
        return read


def _is_bytes(parsed: Any) -> bool:
    """A writer schema that is plain ``bytes``: the deserializer returns the data as is."""
    return parsed == "bytes" or (isinstance(parsed, dict) and parsed.get("type") == "bytes")


def _bytes_reader(payload: bytes) -> bytes:
    return payload[_HEADER_BYTES:]


def _record_reader(parsed: Any) -> _Read:
    def read(payload: bytes) -> Any:
        # BytesIO shares the bytes it is given (no copy); the framing is skipped by a seek.
        stream = BytesIO(payload)
        stream.seek(_HEADER_BYTES)
        return schemaless_reader(stream, parsed, None)

    return read


def _merge(
    positions: list[int], records: list[Any], more_positions: list[int], more: list[Any]
) -> tuple[list[int], list[Any]]:
    """Two (positions, records) lists merged in ascending position order."""
    pairs = sorted(zip(positions + more_positions, records + more, strict=True), key=_first)
    return [p for p, _ in pairs], [r for _, r in pairs]


def _first(pair: tuple[int, Any]) -> int:
    return pair[0]
