"""Helpers to build tables, batches and writers for engine tests (real Lance, real files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from config.settings import TableSettings
from engine.backpressure import BackpressureController, BlockingValve
from engine.coalesce import CoalesceLimits
from engine.flusher import Flusher
from engine.memtable import SealLimits
from engine.schema import OP_DELETE, OP_UPSERT, TableSpec
from engine.shard import ShardWriter, WriterConfig
from engine.shard_memtables import ShardView
from engine.storage import Storage, open_storage
from engine.table import BaseTable
from engine.wal import SourceRange

DIM = 8


def table_settings(uri: str, mode: str = "append", dim: int = DIM, **extra: Any) -> TableSettings:
    raw: dict[str, Any] = {
        "uri": uri,
        "mode": mode,
        "columns": [
            {"name": "id", "type": "string", "nullable": False},
            {"name": "n", "type": "int64"},
            {"name": "text", "type": "string"},
        ],
        "vector": {"column": "vec", "dim": dim, "metric": "l2"},
        "fts_columns": ["text"],
    }
    if mode == "upsert":
        raw["primary_key"] = ["id"]
    raw.update(extra)
    return TableSettings.model_validate(raw)


def make_spec(uri: str | Path, mode: str = "append", dim: int = DIM, **extra: Any) -> TableSpec:
    return TableSpec.from_settings(table_settings(str(uri), mode, dim, **extra))


def vectors_for(ids: np.ndarray, dim: int = DIM) -> np.ndarray:
    """Deterministic vectors: row i is a function of its id number."""
    base = ids.astype(np.float32)[:, None]
    return np.sin(base * (np.arange(dim, dtype=np.float32) + 1)[None, :] * 0.01).astype(np.float32)


def make_batch(
    spec: TableSpec,
    first_offset: int,
    count: int,
    *,
    topic: str = "t",
    partition: int = 0,
    key_of: Any = None,
    deletes: set[int] | None = None,
) -> pa.RecordBatch:
    """Rows for source offsets first_offset .. first_offset+count-1 of topic-partition.

    The id is `key_of(offset)` (default: f"{topic}-{partition}-{offset}").
    """
    offsets = np.arange(first_offset, first_offset + count, dtype=np.int64)
    keyf = key_of or (lambda o: f"{topic}-{partition}-{o}")
    ids = [str(keyf(int(o))) for o in offsets]
    dim = spec.vector.dim if spec.vector else DIM
    vec = vectors_for(offsets, dim)
    cols: dict[str, pa.Array] = {
        "id": pa.array(ids, pa.string()),
        "n": pa.array(offsets, pa.int64()),
        "text": pa.array([f"row {o} of {topic}" for o in offsets], pa.string()),
        "vec": pa.FixedSizeListArray.from_arrays(pa.array(vec.reshape(-1), pa.float32()), dim),
    }
    if "_topic" in spec.table_schema.names:
        cols["_topic"] = pa.array([topic] * count, pa.string())
        cols["_partition"] = pa.array([partition] * count, pa.int32())
        cols["_offset"] = pa.array(offsets, pa.int64())
    if spec.upsert:
        dels = deletes or set()
        cols["_op"] = pa.array(
            [OP_DELETE if int(o) in dels else OP_UPSERT for o in offsets], pa.int8()
        )
    schema = spec.batch_schema
    return pa.RecordBatch.from_arrays([cols[f.name] for f in schema], schema=schema)


def source(first: int, count: int, topic: str = "t", partition: int = 0) -> SourceRange:
    return SourceRange(topic, partition, first, first + count - 1)


def writer_config(
    max_rows: int = 1000,
    max_bytes: int = 64 << 20,
    max_batches: int = 1000,
    interval_s: float = 0.005,
    **extra: Any,
) -> WriterConfig:
    return WriterConfig(
        limits=SealLimits(max_rows, max_bytes, max_batches),
        max_wal_flush_interval_s=interval_s,
        flush_retry_initial_s=extra.pop("flush_retry_initial_s", 0.01),
        **extra,
    )


class Harness:
    """A table plus WAL storage in a folder (or S3), opening writers on one shard."""

    def __init__(
        self,
        table_uri: str,
        wal_uri: str,
        mode: str = "append",
        storage_options: dict[str, str] | None = None,
        config: WriterConfig | None = None,
        controller: BackpressureController | None = None,
        coalesce: CoalesceLimits | None = None,
    ) -> None:
        extra = {"storage_options": storage_options} if storage_options else {}
        self.spec = make_spec(table_uri, mode, **extra)
        self.table = BaseTable(self.spec)
        self.table.open()
        self.storage: Storage = open_storage(wal_uri, storage_options)
        self.config = config or writer_config()
        self.controller = controller or BlockingValve(1 << 40)
        self.flusher = Flusher(1, coalesce)
        self.shard = "t-0-test"

    def open(self, **overrides: Any) -> ShardWriter:
        return ShardWriter.open(
            overrides.get("shard", self.shard),
            self.spec,
            self.table,
            self.storage,
            overrides.get("config", self.config),
            overrides.get("controller", self.controller),
            self.flusher,
            overrides.get("events"),
            scheduler=overrides.get("scheduler"),
        )

    def base_rows(self) -> pa.Table:
        return self.table.dataset().to_table()


def visible_rows(source: ShardWriter | ShardView, base: Any = None) -> list[dict[str, Any]]:
    """Every visible row of a writer's memtables (upsert: newest per key, no deletes).

    With `base` (a Lance dataset opened after the view was taken), memtables whose rows
    that table version already holds are skipped (what a reader combining tiers does).
    """
    out: list[dict[str, Any]] = []
    shard_view = source.view() if isinstance(source, ShardWriter) else source
    views = shard_view.memtables if base is None else shard_view.fresh(base)
    for view in views:
        for batch, live in zip(view.batches, view.live, strict=True):
            b = batch if live is None else batch.filter(pa.array(live))
            out.extend(b.to_pylist())
    return out
