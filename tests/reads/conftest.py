"""Fixtures for read-path tests: real shard writers on real Lance tables in tmp_path.

`ReadHarness` owns one table, one WAL folder, one writer and a `Reader` over them. Rows are
built by `rows_batch` from source offsets, so each row's content is a function of its
offset (and a `version` for upserts) and tests can compute what every tier must return.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from config.settings import TableSettings
from engine.backpressure import BlockingValve
from engine.flusher import Flusher
from engine.reader import Reader, ReaderSettings
from engine.reads import text as text_module
from engine.schema import OP_DELETE, OP_UPSERT, TableSpec
from engine.shard import ShardWriter
from engine.storage import open_storage
from engine.table import BaseTable
from tests.support.engine import source, writer_config


@pytest.fixture(autouse=True)
def exact_text_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Queries wait for every base document-frequency count (`DF_WAIT_S`), so BM25 scores
    are exact however slow the machine: tests compare them across tiers. The bound itself is
    tested on its own."""
    monkeypatch.setattr(text_module, "DF_WAIT_S", 60.0)


def wait_for(condition: Callable[[], bool], what: object, timeout: float = 10) -> None:
    """Poll `condition` until it holds; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def read_spec(
    uri: str,
    mode: str = "append",
    dim: int = 16,
    metric: str = "l2",
    fts_columns: tuple[str, ...] = ("text",),
) -> TableSpec:
    raw: dict[str, Any] = {
        "uri": uri,
        "mode": mode,
        "columns": [
            {"name": "id", "type": "string", "nullable": False},
            {"name": "n", "type": "int64"},
            {"name": "f", "type": "float64"},
            {"name": "flag", "type": "bool"},
            {"name": "ts", "type": "timestamp"},
            {"name": "text", "type": "string"},
        ],
        "vector": {"column": "vec", "dim": dim, "metric": metric},
        "fts_columns": list(fts_columns),
    }
    if mode == "upsert":
        raw["primary_key"] = ["id"]
    return TableSpec.from_settings(TableSettings.model_validate(raw))


def vectors(offsets: np.ndarray, dim: int, version: int = 0) -> np.ndarray:
    """Deterministic pseudo-random vectors per (offset, version)."""
    out = np.empty((len(offsets), dim), dtype=np.float32)
    for i, o in enumerate(offsets):
        out[i] = np.random.default_rng(int(o) * 7919 + version).standard_normal(dim)
    return out


def text_of(offset: int, version: int = 0) -> str:
    words = [WORDS[(offset + j * 3) % len(WORDS)] for j in range(1 + offset % 4)]
    return " ".join(words) + f" row{offset} v{version}"


def rows_batch(
    spec: TableSpec,
    offsets: list[int] | np.ndarray,
    *,
    key_of: Callable[[int], str] | None = None,
    version: int = 0,
    deletes: set[int] | None = None,
    topic: str = "t",
    partition: int = 0,
) -> pa.RecordBatch:
    """Rows for the given source offsets. Nulls: n is null for offsets % 7 == 3, flag and
    text for offsets % 11 == 5 (so IS NULL and three-valued logic are exercised)."""
    offs = np.asarray(offsets, dtype=np.int64)
    keyf = key_of or (lambda o: f"k{o}")
    dim = spec.vector.dim if spec.vector else 16
    vec = vectors(offs, dim, version)
    cols: dict[str, pa.Array] = {
        "id": pa.array([keyf(int(o)) for o in offs], pa.string()),
        "n": pa.array([None if o % 7 == 3 else int(o) for o in offs], pa.int64()),
        "f": pa.array(offs.astype(np.float64) / 4 + version, pa.float64()),
        "flag": pa.array([None if o % 11 == 5 else bool(o % 2) for o in offs], pa.bool_()),
        "ts": pa.array(
            [EPOCH + dt.timedelta(minutes=int(o)) for o in offs], pa.timestamp("ms", tz="UTC")
        ),
        "text": pa.array(
            [None if o % 11 == 5 else text_of(int(o), version) for o in offs], pa.string()
        ),
        "vec": pa.FixedSizeListArray.from_arrays(pa.array(vec.reshape(-1), pa.float32()), dim),
        "_topic": pa.array([topic] * len(offs), pa.string()),
        "_partition": pa.array([partition] * len(offs), pa.int32()),
        "_offset": pa.array(offs, pa.int64()),
    }
    if spec.upsert:
        dels = deletes or set()
        cols["_op"] = pa.array(
            [OP_DELETE if int(o) in dels else OP_UPSERT for o in offs], pa.int8()
        )
    schema = spec.batch_schema
    return pa.RecordBatch.from_arrays([cols[f.name] for f in schema], schema=schema)


class ReadHarness:
    """A table, a WAL folder and writers on it, with a Reader over the open writers."""

    def __init__(
        self,
        root: Path,
        mode: str = "append",
        dim: int = 16,
        metric: str = "l2",
        max_rows: int = 10_000,
        settings: ReaderSettings | None = None,
        fts_columns: tuple[str, ...] = ("text",),
    ) -> None:
        self.spec = read_spec(str(root / "table.lance"), mode, dim, metric, fts_columns)
        self.table = BaseTable(self.spec)
        self.table.open()
        self.storage = open_storage(str(root / "wal"))
        self.config = writer_config(max_rows=max_rows, interval_s=0.002)
        self.controller = BlockingValve(1 << 40)
        self.flusher = Flusher(1)
        self.writers: list[ShardWriter] = []
        self._held: list[threading.Event] = []
        self.reader = Reader(self.spec, self.table, lambda: list(self.writers), settings)

    def open(self, partition: int = 0) -> ShardWriter:
        writer = ShardWriter.open(
            f"t-{partition}-reads",
            self.spec,
            self.table,
            self.storage,
            self.config,
            self.controller,
            self.flusher,
        )
        self.writers.append(writer)
        return writer

    def put(
        self,
        writer: ShardWriter,
        offsets: list[int] | np.ndarray,
        partition: int = 0,
        **kw: Any,
    ) -> None:
        """Put rows for these offsets (contiguous, increasing) and wait until durable."""
        offs = list(offsets)
        batch = rows_batch(self.spec, offs, partition=partition, **kw)
        writer.put(batch, source(offs[0], len(offs), partition=partition)).result(30)

    def flush(self, writer: ShardWriter) -> None:
        """Seal the active memtable and wait until every frozen one is in the base."""
        writer.seal()
        assert writer.wait_flushed(60)

    def index_text(self, column: str = "text") -> None:
        """Build the base's INVERTED index on `column` as maintenance does (with positions)."""
        self.table.dataset().create_scalar_index(column, "INVERTED", with_position=True)

    def hold_flushes(self) -> threading.Event:
        """Keep sealed memtables frozen: occupy the single flush worker until the returned
        event is set (flushes queue behind it)."""
        release = threading.Event()
        self.flusher.submit(lambda: release.wait(120) and None)
        self._held.append(release)
        return release

    def close(self) -> None:
        self.reader.close()
        for event in self._held:
            event.set()
        for w in self.writers:
            w.close(flush=False, timeout=30)
        self.flusher.shutdown()


@pytest.fixture
def make_harness(tmp_path: Path) -> Iterator[Callable[..., ReadHarness]]:
    made: list[ReadHarness] = []

    def make(name: str = "h", **kwargs: Any) -> ReadHarness:
        root = tmp_path / name
        root.mkdir()
        h = ReadHarness(root, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
