"""The first vector index's build: time and recall, the PQ training sample against Lance's.

    python -m bench.index_build [--rows 50000,200000] [--dim 384] [--repeat 3] [--out FILE]

Until a table's first vector index exists, every vector query scans the base flat in Lance
(a catch-up's queries took 0.5-1.5 s each that way: bench/catchup.py), so the build's
duration is the queries' too. For each row count, on the same clustered vectors (500
centres, cosine, in one table per build), maintenance's IVF_PQ build as it derives its
parameters (`engine.maintenance.runner`) twice, alternating:

- ``lance``: `sample_rate` at Lance's 256 per partition (within MAX_TRAINING_BYTES), which
  also trains the PQ codebooks on 256 x sample_rate rows;
- ``sink``: the same with the PQ rate bound (`PQ_SAMPLE_RATE`).

Reports the median build seconds (and the build's stages from Lance's progress callback)
and recall@10 of the sink's base query (nprobes 20, refine factor 10, as the reader asks)
against the exact top 10, over 100 queries near the data, plus the ratio sink / lance.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa

from engine.maintenance.runner import derived_partitions, derived_sub_vectors, training_sample_rate
from engine.reader import recall
from engine.reads.vector import DEFAULT_REFINE_FACTOR

NPROBES = 20
K = 10
QUERIES = 100
CENTRES = 500


def clustered(rows: int, dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((CENTRES, dim)).astype(np.float32)
    noise = 0.5 * rng.standard_normal((rows, dim)).astype(np.float32)
    return centres[rng.integers(0, CENTRES, rows)] + noise


def build(path: Path, vectors: np.ndarray, sample_rate: int) -> tuple[float, dict[str, float]]:
    """Write `vectors` as a new table at `path` and build the index; (seconds, by stage)."""
    rows, dim = vectors.shape
    values = pa.array(vectors.reshape(-1))
    lance.write_dataset(
        pa.table({"vec": pa.FixedSizeListArray.from_arrays(values, dim)}), str(path)
    )
    ds = lance.dataset(str(path))
    marks: dict[str, list[float]] = {}

    def progress(event: Any) -> None:
        if event.event in ("start", "complete"):
            marks.setdefault(event.stage, []).append(time.perf_counter())

    partitions = derived_partitions(rows)
    started = time.perf_counter()
    ds.create_index(
        "vec",
        "IVF_PQ",
        metric="cosine",
        num_partitions=partitions,
        num_sub_vectors=derived_sub_vectors(dim),
        sample_rate=sample_rate,
        progress_callback=progress,
    )
    seconds = time.perf_counter() - started
    return seconds, {stage: t[-1] - t[0] for stage, t in marks.items()}


def mean_recall(path: Path, vectors: np.ndarray, queries: np.ndarray) -> float:
    """Recall@K of the index's answers against the exact top K, averaged over `queries`."""
    units = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    ds = lance.dataset(str(path))
    recalls = []
    for q in queries:
        exact = np.argsort(-(units @ (q / np.linalg.norm(q))))[:K].tolist()
        found = ds.to_table(
            nearest={
                "column": "vec",
                "q": q,
                "k": K,
                "metric": "cosine",
                "minimum_nprobes": NPROBES,
                "refine_factor": DEFAULT_REFINE_FACTOR,
            },
            with_row_id=True,
        )
        recalls.append(recall(found["_rowid"].to_pylist(), exact))
    return statistics.fmean(recalls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="50000,200000")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    header = (
        f"{'rows':>8} {'parts':>6} {'variant':>8} {'rate':>5} {'build s':>8} "
        f"{'quantizer s':>11} {'recall@10':>9}"
    )
    command = f"python -m bench.index_build --rows {args.rows} --dim {args.dim}"
    lines = [f"{command} --repeat {args.repeat}", header]
    print(lines[-1], flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        vectors = clustered(rows, args.dim, seed=rows)
        rng = np.random.default_rng(1)
        picks = vectors[rng.integers(0, rows, QUERIES)]
        queries = picks + 0.1 * rng.standard_normal(picks.shape).astype(np.float32)
        partitions = derived_partitions(rows)
        rates = {
            "lance": training_sample_rate(partitions, args.dim),
            "sink": training_sample_rate(partitions, args.dim, pq=True),
        }
        times: dict[str, list[float]] = {name: [] for name in rates}
        stages: dict[str, list[float]] = {name: [] for name in rates}
        recalls: dict[str, float] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.repeat):
                for name, rate in rates.items():
                    path = Path(tmp) / f"{name}-{i}.lance"
                    seconds, by_stage = build(path, vectors, rate)
                    times[name].append(seconds)
                    stages[name].append(by_stage.get("train_quantizer", float("nan")))
                    if i == 0:
                        recalls[name] = mean_recall(path, vectors, queries)
        for name, rate in rates.items():
            line = (
                f"{rows:>8} {partitions:>6} {name:>8} {rate:>5} "
                f"{statistics.median(times[name]):>8.2f} "
                f"{statistics.median(stages[name]):>11.2f} {recalls[name]:>9.3f}"
            )
            lines.append(line)
            print(line, flush=True)
        ratio = statistics.median(times["sink"]) / statistics.median(times["lance"])
        lines.append(f"{'':>8} build time sink / lance: {ratio:.2f}x")
        print(lines[-1], flush=True)
    if args.out is not None:
        with args.out.open("a") as out:
            out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
