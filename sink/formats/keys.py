"""Kafka keys in a registry format (``source.key_format``): upsert primary keys and the key
a tombstone deletes.

The key is decoded with the same registry and format machinery as values (its subject is
``<topic>-key``, but like values it is read with the schema its id names). ``@key`` then
reads the whole decoded key (a primitive key: a string, a long, ...) and ``@key.a.b`` a
field of a record key; the value is converted to the column by the rules of
`sink.formats.records`. A key that does not decode is a dead letter with the value's
reasons (``missing_magic_byte``, ``unknown_schema_id``, ``not_matching_schema``), its
detail starting ``key``; a null key reads null.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from sink.formats import RecordFormat
from sink.formats.records import Fault, lookup, to_column

__all__ = ["KeyDecoder"]


class KeyDecoder:
    """Decodes the keys of one batch; shared by the decode threads (stateless)."""

    def __init__(self, fmt: RecordFormat) -> None:
        self._fmt = fmt

    def decode(self, keys: Sequence[bytes | None]) -> tuple[list[Any], dict[int, Fault]]:
        """The decoded key of each message (None for a null or faulted key) and the faults.

        Raises:
            RegistryUnavailable: the registry could not be asked.
        """
        present = [i for i, k in enumerate(keys) if k is not None]
        positions, records, faults = self._fmt.records([k for k in keys if k is not None])
        out: list[Any] = [None] * len(keys)
        for pos, record in zip(positions, records, strict=True):
            out[present[pos]] = record
        return out, {
            present[pos]: (reason, "key " + detail.removeprefix("value "))
            for pos, (reason, detail) in faults.items()
        }

    @staticmethod
    def column(
        records: Sequence[Any], path: Sequence[str], type_name: str, describe: str
    ) -> tuple[pa.Array, dict[int, Fault]]:
        """One column from decoded keys (`path` empty: the whole key), with the faults of
        keys that do not fit it, by position."""
        values: list[Any] = []
        faults: dict[int, Fault] = {}
        for pos, record in enumerate(records):
            value, problem = lookup(record, path) if path else (record, None)
            if problem is not None:
                faults[pos] = ("wrong_type", f"{describe}: {problem}")
            values.append(value)
        arr, bad = to_column(values, type_name, describe)
        for pos, fault in bad.items():
            faults.setdefault(pos, fault)
        return arr, faults
