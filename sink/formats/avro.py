"""Avro values in the Confluent wire format: confluent-kafka's registry client and schema
parsing, fastavro's ``schemaless_reader`` per message.

The schema id after the magic byte names the writer schema; the registry client fetches
it once per id (and caches it), and it is parsed once per id, by confluent-kafka's own
`AvroDeserializer` (so named references to other subjects resolve as they do there). Each
message then decodes with fastavro's ``schemaless_reader`` against that parsed schema,
which is what `AvroDeserializer` does underneath. The deserializer itself is called per
message only for payloads that name their schema by GUID (magic byte 1): per message it
costs up to ~3x the fastavro read itself (it looks the schema up in the client, rebuilds the
framing reader and expands the schema for rules on every call), and with no
serialization context (the sink has none) it applies no rules, migrations or ``from_dict``,
so the direct read gives the same records. `tests/unit/test_formats_avro_reader.py` checks
records and dead letters against the deserializer on a corpus of several schema versions,
logical types, unions, bytes and bad payloads.

No reader schema is given: each message decodes with the schema it was written with, and
columns are looked up by record path, so messages of older and newer compatible schemas
fill the same columns (a field a message's schema lacks is null). Unions with null decode
to the value or None; logical types arrive as Python values (timestamp-millis/micros as
datetime, date as date, decimal as Decimal, uuid as UUID) that `sink.formats.records`
converts per column.

Except where a timestamp-millis (or local-timestamp-millis) field fills only a timestamp
column (`records`' ``epoch_ms``): there the long is read as it is, epoch milliseconds,
which the column takes in one Arrow call. fastavro's datetime per value was ~25-45% of a
small record's read, and the column turned it back into milliseconds. The column is the
same; a long beyond the datetime range (which fastavro refuses, faulting the message) is
caught by `sink.formats.parse_records`, which then reads the chunk again as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from io import BytesIO
from typing import Any, Final

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from fastavro import schemaless_reader

from sink.formats.leaves import text_leaves
from sink.formats.records import Fault
from sink.formats.registry import classify, decode_framed, framing_fault, writer_schema_text

__all__ = ["AvroFormat"]

#: The magic byte of a payload that names its writer schema by a 4-byte id, and of one
#: that names it by a 16-byte GUID.
_MAGIC_ID: Final = 0
_MAGIC_GUID: Final = 1
#: Bytes of the Confluent framing before the Avro data (magic byte and schema id).
_HEADER_BYTES: Final = 5


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
        # The deserializer's own parser, cached per schema (named references resolve as they
        # do there). A private method: taken here so that a confluent-kafka release without
        # it fails at start-up rather than dead-lettering every message.
        self._parse = self._deserializer._get_parsed_schema
        #: A reader per schema id that has been fetched and parsed. Ids the registry did not
        #: know are not kept: the id may be registered later.
        self._readers: dict[int, _Reader] = {}

    def writer_leaves(self, payload: bytes) -> list[tuple[tuple[str, ...], str | None]] | None:
        """The leaves of `payload`'s writer schema (fetched once per id by the client)."""

        text = writer_schema_text(self._client, payload)
        return None if text is None else text_leaves("avro", text)

    def writer_schema(self, payload: bytes) -> Any:
        """The parsed writer schema `payload` names by id (as fastavro reads it: extra
        attributes such as Kafka Connect's ``connect.name`` kept), or None when there is
        none to read (not framed by id, an unknown id, a schema that does not parse).

        Raises:
            RegistryUnavailable: the registry could not be asked.
        """
        if len(payload) < _HEADER_BYTES or payload[0] != _MAGIC_ID:
            return None
        reader = self._reader(payload)
        return None if isinstance(reader, tuple) else reader.parsed

    def records(
        self, payloads: Sequence[bytes], epoch_ms: frozenset[tuple[str, ...]] = frozenset()
    ) -> tuple[list[int], list[Any], dict[int, Fault]]:
        """Decode each payload (`epoch_ms`: see `sink.formats.RecordFormat` and above).

        Payloads are grouped by their framing (magic byte and schema id): a group whose
        payloads all decode is read in one list comprehension; a group with a payload that
        does not is read again one payload at a time, to fault just that one.

        Returns:
            The positions of the payloads that decoded, their records, and the fault of
            every other payload by position.

        Raises:
            RegistryUnavailable: the registry could not be asked for a schema.
        """
        headers = [payload[:_HEADER_BYTES] for payload in payloads]
        groups: dict[bytes, list[int]] = {}
        if headers and headers.count(headers[0]) == len(headers):
            groups[headers[0]] = list(range(len(headers)))  # one schema id (the usual case)
        else:
            for pos, header in enumerate(headers):
                groups.setdefault(header, []).append(pos)
        faults: dict[int, Fault] = {}
        decoded: list[tuple[list[int], list[Any]]] = []
        guid: list[int] = []  # payloads that name their schema by GUID: the deserializer's
        for header, group in groups.items():
            if len(header) < _HEADER_BYTES or header[0] not in {_MAGIC_ID, _MAGIC_GUID}:
                faults.update((i, _framing_fault(payloads[i])) for i in group)
            elif header[0] == _MAGIC_GUID:
                guid += group
            else:
                decoded.append(self._read_group(payloads, group, faults, epoch_ms))
        if guid:
            deserialize = self._deserializer
            at, got, bad = decode_framed(
                [payloads[p] for p in guid], lambda payload: deserialize(payload, None), self.name
            )
            faults.update((guid[i], fault) for i, fault in bad.items())
            decoded.append(([guid[i] for i in at], got))
        if len(decoded) == 1:
            return decoded[0][0], decoded[0][1], faults
        pairs = sorted(
            (
                (p, r)
                for positions, records in decoded
                for p, r in zip(positions, records, strict=True)
            ),
            key=_first,
        )
        return [p for p, _ in pairs], [r for _, r in pairs], faults

    def _read_group(
        self,
        payloads: Sequence[bytes],
        group: list[int],
        faults: dict[int, Fault],
        epoch_ms: frozenset[tuple[str, ...]],
    ) -> tuple[list[int], list[Any]]:
        """Read the payloads at `group` (one schema id); the faults of those that do not
        decode go in `faults`.

        Raises:
            RegistryUnavailable: the registry could not be asked for the schema.
        """
        members = payloads if len(group) == len(payloads) else [payloads[i] for i in group]
        if min(map(len, members)) <= _HEADER_BYTES:  # the framing alone, with no data
            short = {j for j, payload in enumerate(members) if len(payload) <= _HEADER_BYTES}
            faults.update((group[j], _framing_fault(members[j])) for j in sorted(short))
            group = [pos for j, pos in enumerate(group) if j not in short]
            members = [payload for j, payload in enumerate(members) if j not in short]
            if not group:
                return [], []
        reader = self._reader(members[0])
        if isinstance(reader, tuple):  # the id is unknown, or its schema does not parse
            faults.update((pos, reader) for pos in group)
            return [], []
        if epoch_ms:
            reader = reader.with_epoch_ms(epoch_ms)
        with contextlib.suppress(Exception):  # then one by one, to fault just the bad ones
            return group, reader.read_all(members)
        positions: list[int] = []
        records: list[Any] = []
        for pos, payload in zip(group, members, strict=True):
            try:
                record = reader.read(payload)
            except Exception as exc:  # noqa: BLE001 - every failure is sorted by classify
                faults[pos] = classify(exc, payload, self.name)
            else:
                positions.append(pos)
                records.append(record)
        return positions, records

    def _reader(self, payload: bytes) -> _Reader | Fault:
        """The reader of the schema id `payload` names, or the fault of every payload that
        names it (an id the registry does not know, a schema that does not parse).

        Raises:
            RegistryUnavailable: the registry could not be asked.
        """
        schema_id = int.from_bytes(payload[1:_HEADER_BYTES], "big")
        reader = self._readers.get(schema_id)
        if reader is not None:
            return reader
        try:
            # The same calls AvroDeserializer makes for a message (the tests compare records).
            parsed = self._parse(self._client.get_schema(schema_id))
        except Exception as exc:  # noqa: BLE001 - every failure is sorted by classify
            return classify(exc, payload, self.name)
        reader = self._readers[schema_id] = _Reader(parsed)
        return reader


class _Reader:
    """Reads the Avro data of framed payloads that name one writer schema."""

    __slots__ = ("_epoch_ms", "_parsed", "_raw")

    def __init__(self, parsed: Any) -> None:
        self._parsed = parsed
        # A writer schema that is plain ``bytes``: the deserializer returns the data as is.
        self._raw = parsed == "bytes" or (
            isinstance(parsed, dict) and parsed.get("type") == "bytes"
        )
        #: Readers of this schema with timestamp-millis longs read as they are, per set of
        #: record paths (one per decoder, in practice).
        self._epoch_ms: dict[frozenset[tuple[str, ...]], _Reader] = {}

    @property
    def parsed(self) -> Any:
        """The parsed writer schema."""
        return self._parsed

    def with_epoch_ms(self, paths: frozenset[tuple[str, ...]]) -> _Reader:
        """This reader, with the timestamp-millis longs at `paths` read as epoch
        milliseconds (itself when the schema has none there)."""
        reader = self._epoch_ms.get(paths)
        if reader is None:
            plain = _plain_millis(self._parsed, paths)
            reader = self if plain is self._parsed else _Reader(plain)
            self._epoch_ms[paths] = reader  # a race builds an equal one: either is kept
        return reader

    def read(self, payload: bytes) -> Any:
        """One payload's value.

        Raises:
            Exception: whatever fastavro raises for data that does not match the schema.
        """
        if self._raw:
            return payload[_HEADER_BYTES:]
        return schemaless_reader(BytesIO(payload[_HEADER_BYTES:]), self._parsed, None)

    def read_all(self, payloads: Sequence[bytes]) -> list[Any]:
        """Every payload's value, in one comprehension (the per-message cost is fastavro's).

        Raises:
            Exception: for the first payload that does not match the schema.
        """
        if self._raw:
            return [payload[_HEADER_BYTES:] for payload in payloads]
        parsed = self._parsed
        # Slicing copies the data (a few hundred ns for a 2 KB vector), but is cheaper
        # than a second call to skip the framing with seek on small messages.
        return [schemaless_reader(BytesIO(p[_HEADER_BYTES:]), parsed, None) for p in payloads]


#: Logical types of a long that fastavro reads as a datetime from epoch milliseconds.
_MILLIS: Final = frozenset({"timestamp-millis", "local-timestamp-millis"})


def _plain_millis(schema: Any, paths: frozenset[tuple[str, ...]]) -> Any:
    """`schema` (parsed) with the timestamp-millis longs at `paths` made plain longs: new
    nodes on the way to them, the rest shared; `schema` itself when nothing changes.

    Only records' fields and unions are crossed: the items of an array and the values of
    a map, like named types referenced by name, are left as they are (another path may
    read them too)."""
    if not paths:
        return schema
    if isinstance(schema, list):  # a union: each branch
        branches = [_plain_millis(branch, paths) for branch in schema]
        changed = any(b is not a for a, b in zip(branches, schema, strict=True))
        return branches if changed else schema
    if not isinstance(schema, dict):  # a primitive, or a named type referenced by name
        return schema
    kind = schema.get("type")
    if () in paths and kind == "long" and schema.get("logicalType") in _MILLIS:
        return "long"
    if kind == "record":
        fields = []
        for f in schema["fields"]:
            below = frozenset(p[1:] for p in paths if p and p[0] == f["name"])
            plain = _plain_millis(f["type"], below)
            fields.append(f if plain is f["type"] else {**f, "type": plain})
        if all(a is b for a, b in zip(fields, schema["fields"], strict=True)):
            return schema
        return {**schema, "fields": fields}
    return schema


def _framing_fault(payload: bytes) -> Fault:
    """The framing fault of a payload known to lack the framing."""
    fault = framing_fault(payload)
    assert fault is not None  # the caller checked the framing
    return fault


def _first(pair: tuple[int, Any]) -> int:
    return pair[0]
