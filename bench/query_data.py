"""The query benchmarks' data: deterministic rows, the indexed base, and putting rows into a
shard writer (shared by `bench.query` and its 3-process mode, `bench.fanout`)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

from config.settings import TableSettings
from engine.schema import TableSpec
from engine.shard import ShardWriter
from engine.wal import SourceRange

DIM = 384
CENTRES = 1_000
LATENT = 16
#: Bumped whenever `Data` changes, so a cached base is rebuilt.
DATA_VERSION = 3
#: The filter column is indexed as a user filtering on it would configure it.
SCALAR_INDEXES = {"n": "BITMAP"}
VOCAB = 5_000
WORDS_PER_ROW = 10
CHUNK = 100_000


def spec_for(uri: str) -> TableSpec:
    return TableSpec.from_settings(
        TableSettings.model_validate(
            {
                "uri": uri,
                "mode": "append",
                "primary_key": ["id"],
                "columns": [
                    {"name": "id", "type": "string", "nullable": False},
                    {"name": "n", "type": "int64"},
                    {"name": "text", "type": "string"},
                ],
                "vector": {"column": "vec", "dim": DIM, "metric": "l2"},
                "fts_columns": ["text"],
            }
        )
    )


class Data:
    """Deterministic rows: row i's content depends only on i."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.centres = rng.standard_normal((CENTRES, DIM)).astype(np.float32) * 2
        self.bases = rng.standard_normal((64, DIM, LATENT)).astype(np.float32) / np.sqrt(LATENT)
        ranks = np.arange(1, VOCAB + 1, dtype=np.float64)
        self.word_p = (1 / ranks) / (1 / ranks).sum()
        self.words = np.array([f"w{i}" for i in range(VOCAB)])

    def vectors(self, first: int, count: int) -> np.ndarray:
        """Cluster centre + a point of the cluster's 16-dim subspace + a little isotropic
        noise: embeddings have low intrinsic dimension, unlike isotropic Gaussian noise in
        384 dims (where all neighbours are nearly equidistant and no ANN index has recall)."""
        rng = np.random.default_rng(first + 1)
        centre = rng.integers(0, CENTRES, count)
        latent = rng.standard_normal((count, LATENT)).astype(np.float32)
        vec = self.centres[centre]
        basis = centre % len(self.bases)
        for b in range(len(self.bases)):
            rows = basis == b
            vec[rows] += latent[rows] @ self.bases[b].T
        vec += 0.05 * rng.standard_normal((count, DIM)).astype(np.float32)
        return vec.astype(np.float32)

    def batch(self, spec: TableSpec, first: int, count: int) -> pa.RecordBatch:
        rng = np.random.default_rng(first + 7)
        idx = rng.choice(VOCAB, size=(count, WORDS_PER_ROW), p=self.word_p)
        text = [" ".join(r) for r in self.words[idx]]
        offsets = np.arange(first, first + count, dtype=np.int64)
        vec = self.vectors(first, count)
        cols = {
            "id": pa.array([f"id{o}" for o in offsets]),
            "n": pa.array(offsets % 1000),
            "text": pa.array(text),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(vec.reshape(-1)), DIM),
            "_topic": pa.array(["bench"] * count),
            "_partition": pa.array(np.zeros(count, np.int32)),
            "_offset": pa.array(offsets),
        }
        schema = spec.batch_schema
        return pa.RecordBatch.from_arrays([cols[f.name] for f in schema], schema=schema)


#: Rows per put when the memtables are filled (the recall oracle regenerates the same
#: chunks: a chunk's vectors depend on its first offset).
PUT_ROWS = 2_000


def chunks(first: int, total: int, size: int = PUT_ROWS) -> list[tuple[int, int]]:
    """(first offset, rows) of `total` rows from `first` in chunks of `size`, the last one
    shorter when `size` does not divide `total`."""
    return [(f, min(size, first + total - f)) for f in range(first, first + total, size)]


def build_base(path: Path, spec: TableSpec, data: Data, rows: int) -> dict[str, float]:
    """Write and index the base (skipped when a cached one with `rows` rows exists)."""
    marker = path / "bench-built.json"
    cached = json.loads(marker.read_text()) if marker.exists() else {}
    if cached.get("rows") == rows and cached.get("data") == DATA_VERSION and "version" in cached:
        try:
            built = lance.dataset(str(path), version=cached["version"])
        except ValueError:  # removed by an untagged cache's maintenance cleanup: rebuild
            pass
        else:
            # Undo what a previous run's ingestion flushed: the built version becomes latest.
            if int(lance.dataset(str(path)).version) != cached["version"]:
                built.restore()
            return dict(cached)
    shutil.rmtree(path, ignore_errors=True)
    started = time.monotonic()
    for first in range(0, rows, CHUNK):
        count = min(CHUNK, rows - first)
        table = pa.Table.from_batches([spec.to_table_batch(data.batch(spec, first, count))])
        lance.write_dataset(
            table, str(path), mode="append" if first else "create", max_rows_per_file=CHUNK
        )
    write_s = time.monotonic() - started
    ds = lance.dataset(str(path))
    started = time.monotonic()
    partitions = max(1, min(int(np.sqrt(rows)), rows // 256, 512))
    ds.create_index("vec", "IVF_PQ", metric="l2", num_partitions=partitions, num_sub_vectors=48)
    vector_s = time.monotonic() - started
    started = time.monotonic()
    ds.create_scalar_index("text", "INVERTED", with_position=True)
    fts_s = time.monotonic() - started
    started = time.monotonic()
    ds.create_scalar_index("id", "BTREE")
    for column, kind in SCALAR_INDEXES.items():  # as maintenance.scalar_indexes names them
        ds.create_scalar_index(column, kind, name=f"{column}_{kind.lower()}")
    btree_s = time.monotonic() - started
    info = {
        "data": DATA_VERSION,
        "rows": rows,
        "write_s": write_s,
        "ivf_pq_s": vector_s,
        "partitions": partitions,
        "fts_s": fts_s,
        "btree_s": btree_s,
    }
    info["version"] = int(lance.dataset(str(path)).version)
    # The ingestion phase runs maintenance, whose cleanup keeps tagged versions only.
    lance.dataset(str(path)).tags.create("bench-built", info["version"])
    marker.write_text(json.dumps(info))
    return info


def put_rows(writer: ShardWriter, spec: TableSpec, data: Data, first: int, count: int) -> None:
    batch = data.batch(spec, first, count)
    writer.put(batch, SourceRange("bench", 0, first, first + count - 1)).result(60)
