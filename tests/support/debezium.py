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


def product_image(id_: int, version: int, dim: int) -> dict[str, Any]:
    """Row `id_` of the products table at its `version`-th change, in Debezium's form."""
    return {
        "id": id_,
        "name": f"product {id_} v{version}",
        "price": decimal_b64(f"{(id_ * 7919 + version) % 100000 - 50000}.{version % 100:02d}", 2),
        "added": days(dt.date(1965, 1, 1)) + id_,
        "updated": micros(dt.datetime(2024, 1, 1, tzinfo=dt.UTC)) + version * 1_000_001,
        "attrs": json.dumps({"v": version}),
        "embedding": [
            round(((id_ + 1) * (k + 1) * (version + 1)) % 97 / 97.0, 4) for k in range(dim)
        ],
    }


def history(
    changes: int,
    keys: int,
    dim: int,
    *,
    seed: int = 7,
    schemas: bool = True,
    updates: float = 0.7,
    deletes: float = 0.1,
) -> tuple[list[tuple[bytes, bytes | None]], dict[int, dict[str, Any]]]:
    """A PostgreSQL products table's change history as Debezium writes it: a snapshot of
    half the keys (op r), then `changes` random changes (`updates` of them updates of a
    live row, `deletes` deletes, each followed by its tombstone, the rest inserts of a
    missing key, or updates when every key is live), keyed like Debezium (the Kafka key
    holds the id). Returns the (key, value) messages and the final table, id -> after image.
    """
    import random  # noqa: PLC0415 - tests and benches only

    rng = random.Random(seed)
    schema = envelope_schema() if schemas else None
    table: dict[int, dict[str, Any]] = {}
    version: dict[int, int] = {}
    out: list[tuple[bytes, bytes | None]] = []
    lsn = 1000

    def emit(
        op: str, id_: int, before: dict[str, Any] | None, after: dict[str, Any] | None
    ) -> None:
        nonlocal lsn
        lsn += 8
        source = pg_source(lsn, 1_700_000_000_000 + lsn, snapshot="true" if op == "r" else "false")
        out.append((key(id_, schemas), value(envelope(op, before, after, source), schema)))

    live, missing = _Pool(), _Pool(range(1, keys, 2))

    def add(id_: int) -> None:
        live.add(id_)
        missing.remove(id_)

    def remove(id_: int) -> None:
        live.remove(id_)
        missing.add(id_)

    for id_ in range(0, keys, 2):
        version[id_] = 0
        table[id_] = product_image(id_, 0, dim)
        add(id_)
        emit("r", id_, None, table[id_])
    for _ in range(changes):
        roll = rng.random()
        if live.items and (roll < updates or not missing.items):
            id_ = rng.choice(live.items)
            version[id_] += 1
            image = product_image(id_, version[id_], dim)
            emit("u", id_, {"id": id_}, image)
            table[id_] = image
        elif live.items and roll < updates + deletes:
            id_ = rng.choice(live.items)
            emit("d", id_, {"id": id_}, None)  # default replica identity: the key only
            out.append((key(id_, schemas), None))  # Debezium's tombstone
            del table[id_]
            remove(id_)
        else:
            id_ = rng.choice(missing.items)
            version[id_] = version.get(id_, 0) + 1
            table[id_] = product_image(id_, version[id_], dim)
            add(id_)
            emit("c", id_, None, table[id_])
    return out, table


class _Pool:
    """A set of keys to draw from at random: a list, and where each key is in it."""

    def __init__(self, keys: Any = ()) -> None:
        self.items: list[int] = list(keys)
        self._at = {k: i for i, k in enumerate(self.items)}

    def add(self, key: int) -> None:
        if key not in self._at:
            self._at[key] = len(self.items)
            self.items.append(key)

    def remove(self, key: int) -> None:
        at = self._at.pop(key, None)
        if at is None:
            return
        last = self.items.pop()
        if last != key:
            self.items[at] = last
            self._at[last] = at


def key_id(raw: bytes) -> Any:
    """The id in a products key (`key`), either shape."""
    record = orjson.loads(raw)
    return record["payload"]["id"] if "payload" in record else record["id"]


_JSON_TYPES = {
    "int8": "integer",
    "int16": "integer",
    "int32": "integer",
    "int64": "integer",
    "float32": "number",
    "float64": "number",
    "boolean": "boolean",
    "string": "string",
    "bytes": "string",
}


def json_schema_of(schema: dict[str, Any], index: int | None = None) -> dict[str, Any]:
    """A Connect schema (the JSON converter's form, e.g. `envelope_schema`) as Confluent's
    JSON Schema converter registers it: structs as objects, ``title`` for the Connect name,
    ``connect.type``/``connect.version``/``connect.parameters``/``connect.index``, an
    optional field as ``oneOf`` null and its type, a Decimal as a number."""
    kind = schema["type"]
    out: dict[str, Any]
    if kind == "struct":
        out = {
            "type": "object",
            "properties": {
                f["field"]: json_schema_of(f, i) for i, f in enumerate(schema["fields"])
            },
        }
    elif kind == "array":
        out = {"type": "array", "items": json_schema_of(schema["items"])}
    elif schema.get("name") == "org.apache.kafka.connect.data.Decimal":
        out = {"type": "number", "connect.type": "bytes"}
    else:
        out = {"type": _JSON_TYPES[kind]}
        if kind not in ("string", "boolean"):
            out["connect.type"] = kind
    if "name" in schema:
        out["title"] = schema["name"]
    if "version" in schema:
        out["connect.version"] = schema["version"]
    if "parameters" in schema:
        out["connect.parameters"] = schema["parameters"]
    if schema.get("optional"):
        out = {"oneOf": [{"type": "null"}, out]}
    if index is not None:
        out["connect.index"] = index
    return out
