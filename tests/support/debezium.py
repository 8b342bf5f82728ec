"""Debezium change events as the JSON converter writes them, for tests and benches.

The shapes follow Debezium's documentation of the PostgreSQL and MySQL connectors: the
envelope ``{"before", "after", "source", "op", "ts_ms", "transaction"}``, wrapped in
``{"schema": ..., "payload": ...}`` when the converter's ``schemas.enable`` is on, and the
key ``{"id": ...}`` (wrapped alike). Rows are given in Debezium's representation (a
decimal as base64 bytes, a date as days, ...): `decimal_b64`, `days`, `micros` make them.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
from typing import Any

import orjson

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

#: The products table: (field, Connect type, Connect schema name or None, parameters).
PRODUCT_FIELDS: list[tuple[str, str, str | None, dict[str, str] | None]] = [
    ("id", "int32", None, None),
    ("name", "string", None, None),
    ("price", "bytes", "org.apache.kafka.connect.data.Decimal", {"scale": "2"}),
    ("added", "int32", "io.debezium.time.Date", None),
    ("updated", "int64", "io.debezium.time.MicroTimestamp", None),
    ("attrs", "string", "io.debezium.data.Json", None),
    ("embedding", "array", "io.debezium.data.DoubleVector", None),
]


def field_schema(
    name: str, type_: str, logical: str | None, params: dict[str, str] | None, optional: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type_, "optional": optional, "field": name}
    if logical is not None:
        out["name"] = logical
        out["version"] = 1
    if params is not None:
        out["parameters"] = params
    if type_ == "array":
        out["items"] = {"type": "float64", "optional": False}
    return out


def row_schema(
    fields: list[tuple[str, str, str | None, dict[str, str] | None]], which: str, name: str
) -> dict[str, Any]:
    return {
        "type": "struct",
        "fields": [field_schema(*f, optional=f[0] != "id") for f in fields],
        "optional": True,
        "name": f"{name}.Value",
        "field": which,
    }


def envelope_schema(
    fields: list[tuple[str, str, str | None, dict[str, str] | None]] = PRODUCT_FIELDS,
    name: str = "dbserver1.public.products",
) -> dict[str, Any]:
    """The JSON converter's schema of an envelope whose rows have `fields`."""
    source_fields = [
        {"type": "string", "optional": False, "field": "version"},
        {"type": "string", "optional": False, "field": "connector"},
        {"type": "string", "optional": False, "field": "name"},
        {"type": "int64", "optional": False, "field": "ts_ms"},
        {"type": "string", "optional": False, "field": "db"},
        {"type": "string", "optional": False, "field": "table"},
        {"type": "int64", "optional": True, "field": "lsn"},
    ]
    return {
        "type": "struct",
        "fields": [
            row_schema(fields, "before", name),
            row_schema(fields, "after", name),
            {
                "type": "struct",
                "fields": source_fields,
                "optional": False,
                "name": "io.debezium.connector.postgresql.Source",
                "field": "source",
            },
            {"type": "string", "optional": False, "field": "op"},
            {"type": "int64", "optional": True, "field": "ts_ms"},
        ],
        "optional": False,
        "name": f"{name}.Envelope",
        "version": 1,
    }


def pg_source(lsn: int, ts_ms: int, table: str = "products", snapshot: str = "false") -> dict:
    """PostgreSQL's source block."""
    return {
        "version": "2.7.0.Final",
        "connector": "postgresql",
        "name": "dbserver1",
        "ts_ms": ts_ms,
        "snapshot": snapshot,
        "db": "inventory",
        "sequence": f'["{lsn - 8}","{lsn}"]',
        "schema": "public",
        "table": table,
        "txId": 780 + lsn % 1000,
        "lsn": lsn,
        "xmin": None,
    }


def mysql_source(pos: int, ts_ms: int, table: str = "products", snapshot: str = "false") -> dict:
    """MySQL's source block (binlog coordinates instead of an LSN)."""
    return {
        "version": "2.7.0.Final",
        "connector": "mysql",
        "name": "dbserver1",
        "ts_ms": ts_ms,
        "snapshot": snapshot,
        "db": "inventory",
        "sequence": None,
        "table": table,
        "server_id": 223344,
        "gtid": None,
        "file": "mysql-bin.000003",
        "pos": pos,
        "row": 0,
        "thread": 7,
        "query": None,
    }


def envelope(
    op: str | None,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    source: dict[str, Any],
    ts_ms: int = 1_700_000_000_000,
) -> dict[str, Any]:
    out: dict[str, Any] = {"before": before, "after": after, "source": source}
    if op is not None:
        out["op"] = op
    out["ts_ms"] = ts_ms
    out["transaction"] = None
    return out


def value(event: dict[str, Any], schema: dict[str, Any] | None = None) -> bytes:
    """The event as the JSON converter writes it (`schema` given: schemas.enable=true)."""
    whole = event if schema is None else {"schema": schema, "payload": event}
    try:
        return orjson.dumps(whole)
    except TypeError:  # an integer beyond 64 bits (fuzzing): Python's json writes it
        return json.dumps(whole, separators=(",", ":")).encode()


def key(id_: Any, schemas: bool = True) -> bytes:
    """The Kafka key Debezium gives a row of the products table."""
    if not schemas:
        return orjson.dumps({"id": id_})
    schema = {
        "type": "struct",
        "fields": [{"type": "int32", "optional": False, "field": "id"}],
        "optional": False,
        "name": "dbserver1.public.products.Key",
    }
    return orjson.dumps({"schema": schema, "payload": {"id": id_}})


def decimal_b64(number: str | decimal.Decimal, scale: int) -> str:
    """A Connect Decimal: the unscaled value's big-endian two's complement, base64."""
    exact = decimal.Context(prec=200)
    unscaled = int(decimal.Decimal(number).scaleb(scale, context=exact))
    size = max(1, (unscaled + (unscaled < 0)).bit_length() // 8 + 1)
    return base64.b64encode(unscaled.to_bytes(size, "big", signed=True)).decode()


def days(date: dt.date) -> int:
    return (date - dt.date(1970, 1, 1)).days


def micros(stamp: dt.datetime) -> int:
    return (stamp - EPOCH) // dt.timedelta(microseconds=1)
