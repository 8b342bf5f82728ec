"""Change data capture benchmark: a Debezium change stream against the same rows as plain
upserts, through the decoder and the engine, in one run.

    python -m bench.cdc [--small N] [--vectors N] [--repeat R] [--out FILE]

One generated change history of a products table (`tests.support.debezium.history`: a
snapshot of half the keys, then changes of which 70% are updates and 10% deletes, each
delete followed by Debezium's tombstone, the rest inserts), written three ways:

- ``debezium``: the events as the JSON converter writes them with ``schemas.enable = true``
  (the schema block in every event; Debezium's default), ``source.envelope = "debezium"``;
- ``debezium, no schemas``: the same without the schema block (``schemas.enable = false``;
  the decimal then as ``decimal.handling.mode = "double"``, dates and timestamps as the
  epoch milliseconds a plain table reads);
- ``plain upserts``: each event's after image as a flat JSON object keyed by id, and each
  delete as a Kafka tombstone of the id (the same row changes, the same table).

Each way: the sustained rate (messages/s) of decoding every message (`sink.decode.Decoder`,
batches of 10,000 as one ``consume()`` returns for a partition) and putting every batch into
one shard of an upsert table (`engine.shard.ShardWriter`, WAL durable, then every
memtable flushed into the Lance table by merge-insert before the clock stops), and of the
decoding alone. Data sets: small rows (no vector) and 384-dim vectors (pgvector, Debezium's
arrays of doubles). Runs interleave the ways, medians of ``--repeat``; the machine is
shared and noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import decimal
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.engine import BATCH_ROWS, timed_run, writer_config
from config.settings import SourceSettings, TableSettings
from engine.backpressure import BlockingValve
from engine.flusher import Flusher
from engine.schema import TableSpec
from engine.shard import ShardWriter
from engine.storage import open_storage
from engine.table import BaseTable
from engine.wal import SourceRange
from sink.decode import Decoder
from tests.support import debezium as dbz

TOPIC = "dbserver1.public.products"


@dataclass(frozen=True, slots=True)
class Message:
    """A consumed message: the accessors of `confluent_kafka.Message` the decoder reads."""

    key_: bytes | None
    value_: bytes | None
    offset_: int

    def topic(self) -> str:
        return TOPIC

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self.offset_

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000)

    def key(self) -> bytes | None:
        return self.key_

    def value(self) -> bytes | None:
        return self.value_

    def headers(self) -> None:
        return None


def table_settings(uri: str, dim: int | None) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "uri": uri,
        "mode": "upsert",
        "primary_key": ["id"],
        "columns": [
            {"name": "id", "type": "int64", "nullable": False},
            {"name": "name", "type": "string"},
            {"name": "price", "type": "float64"},
            {"name": "added", "type": "timestamp"},
            {"name": "updated", "type": "timestamp"},
            {"name": "attrs", "type": "string"},
        ],
    }
    if dim is not None:
        raw["vector"] = {"column": "embedding", "dim": dim}
    return raw


def spec_for(uri: str, dim: int | None) -> TableSpec:
    return TableSpec.from_settings(TableSettings.model_validate(table_settings(uri, dim)))


def _flat(image: dict[str, Any]) -> dict[str, Any]:
    """A Debezium after image as a plain row: the decimal a number, times in epoch ms."""
    scale_2 = base64.b64decode(image["price"])
    out = dict(image)
    out["price"] = float(decimal.Decimal(int.from_bytes(scale_2, "big", signed=True)) / 100)
    out["added"] = image["added"] * 86_400_000
    out["updated"] = image["updated"] // 1000
    return out


def streams(n: int, dim: int | None) -> dict[str, list[Message]]:
    """The same change history as Debezium events (with and without schemas) and as plain
    upserts; about `n` messages each."""
    # ~1.1 messages per change (a delete is two); a key space that keeps ~20% inserts.
    changes = int(n / 1.1)
    events, _ = dbz.history(changes, max(10, changes // 4), dim or 1, seed=3)
    with_schema: list[Message] = []
    without: list[Message] = []
    plain: list[Message] = []
    for offset, (key, value) in enumerate(events):
        with_schema.append(Message(key, value, offset))
        if value is None:
            without.append(Message(key, None, offset))
            plain.append(Message(str(dbz.key_id(key)).encode(), None, offset))
            continue
        event = orjson.loads(value)["payload"]
        after = event["after"]
        if dim is None:
            for image in (after, event["before"]):
                if image is not None:
                    image.pop("embedding", None)
        if after is not None:
            event["after"] = _flat(after)
        without.append(Message(key, orjson.dumps(event), offset))
        if after is None:  # a delete: its tombstone follows; the plain stream has it only
            plain.append(Message(str(dbz.key_id(key)).encode(), None, offset))
        else:
            plain.append(Message(str(after["id"]).encode(), orjson.dumps(event["after"]), offset))
    if dim is None:  # the schema-block stream without the vector too
        with_schema = [
            Message(m.key_, _drop_vector(m.value_), m.offset_) if m.value_ else m
            for m in with_schema
        ]
    return {"debezium": with_schema, "debezium, no schemas": without, "plain upserts": plain}


def _drop_vector(value: bytes) -> bytes:
    whole = orjson.loads(value)
    for image in (whole["payload"]["after"], whole["payload"]["before"]):
        if image is not None:
            image.pop("embedding", None)
    return orjson.dumps(whole)


def sources(dim: int | None) -> dict[str, SourceSettings]:
    vector = {} if dim is None else {"embedding": "$.after.embedding"}
    cdc = SourceSettings(envelope="debezium", columns=vector)
    return {
        "debezium": cdc,
        "debezium, no schemas": cdc,
        "plain upserts": SourceSettings(columns={"id": "@key"}),
    }


def batches_of(messages: Sequence[Message]) -> list[Sequence[Message]]:
    return [messages[i : i + BATCH_ROWS] for i in range(0, len(messages), BATCH_ROWS)]


def decode_only(spec: TableSpec, source: SourceSettings, messages: Sequence[Message]) -> float:
    decoder = Decoder(spec, source)
    start = time.perf_counter()
    for part in batches_of(messages):
        out = decoder.decode(part)
        assert not out.dead_letters, out.dead_letters[:1]
    return time.perf_counter() - start


def decode_and_put(
    workdir: Path, dim: int | None, source: SourceSettings, messages: Sequence[Message]
) -> float:
    """Seconds to decode every message, put each batch into one shard and flush it all."""
    spec = spec_for(str(workdir / "products.lance"), dim)
    table = BaseTable(spec, sync=True)
    table.open()
    storage = open_storage(str(workdir / "wal"), fsync=True)
    flusher = Flusher(2)
    valve = BlockingValve(1 << 30)
    writer = ShardWriter.open("bench-0", spec, table, storage, writer_config(), valve, flusher)
    decoder = Decoder(spec, source)
    start = time.perf_counter()
    futures = []
    for part in batches_of(messages):
        out = decoder.decode(part)
        assert not out.dead_letters, out.dead_letters[:1]
        if out.batch is not None:
            src = SourceRange(TOPIC, 0, out.first_offset, out.last_offset)
            futures.append(writer.put(out.batch, src))
    for f in futures:
        f.result(600)
    writer.close(flush=True, timeout=600)
    seconds = time.perf_counter() - start
    flusher.shutdown()
    ids = table.dataset().to_table(columns=["id"]).column("id").to_pylist()
    assert len(set(ids)) == len(ids), "a key in the table twice"
    return seconds


def run(label: str, n: int, dim: int | None, repeat: int) -> list[str]:
    data = streams(n, dim)
    srcs = sources(dim)
    spec = spec_for("/tmp/unused", dim)
    sizes = {name: sum(len(m.value_ or b"") for m in msgs) for name, msgs in data.items()}
    put_times: dict[str, list[float]] = {name: [] for name in data}
    decode_times: dict[str, list[float]] = {name: [] for name in data}
    for _ in range(repeat):
        for name, messages in data.items():
            decode_times[name].append(decode_only(spec, srcs[name], messages))
            put_times[name].append(
                timed_run(lambda w, s=srcs[name], m=messages: decode_and_put(w, dim, s, m))
            )
    lines = [f"## {label}: {len(data['debezium'])} messages, medians of {repeat}", ""]
    lines.append(
        f"{'':24}{'MB':>8}{'decode msg/s':>15}{'decode+put msg/s':>19}{'cost vs plain':>15}"
    )
    plain = statistics.median(put_times["plain upserts"])
    for name, messages in data.items():
        put = statistics.median(put_times[name])
        dec = statistics.median(decode_times[name])
        lines.append(
            f"{name:24}{sizes[name] / 1e6:8.1f}{len(messages) / dec:15,.0f}"
            f"{len(messages) / put:19,.0f}{put / plain - 1:+15.0%}"
        )
    lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=100_000, help="messages, 0 = skip")
    parser.add_argument("--vectors", type=int, default=20_000, help="messages, 0 = skip")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = [f"lance-sink CDC benchmark, {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC", ""]
    runs: list[tuple[str, int, int | None]] = [
        ("small rows", args.small, None),
        ("384-dim vectors", args.vectors, 384),
    ]
    for label, n, dim in runs:
        if n:
            lines += run(label, n, dim, args.repeat)
            print("\n".join(lines), flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
