"""Exact kNN over a large float32 matrix, pruned by an int8 copy of it.

Why: under ingestion the reader's exact search over the cached unindexed base fragments
(`engine.unindexed`) was the largest part of a vector query: up to 300k x 384 rows scanned
per query, ~50 ms median on 2 busy cores. faiss scans int8 codes about 3x faster than
float32 vectors, and the codes are a quarter of the memory traffic.

How the result stays exact: every row's target vector ``t`` (the vector; for cosine the
unit vector) is stored as ``c = rint(t * scale)``, integers in [-127, 127], one scale per
matrix (127 over its largest absolute value). The query is rounded the same way. faiss's
int8 kernels (`ScalarQuantizer.QT_8bit_direct_signed`) compute distances between such
integer vectors exactly (checked in the tests). The rounding moves every row by at most
``slack`` (the largest ``|t - c / scale|`` over the rows, measured when the codes are built)
and the query by its own ``|q - q~ / scale|``. So the triangle inequality bounds the true
distance of every row the int8 search ranked after its first ``fetch`` candidates
(`Pruner.search` returns that bound as ``floor``, in Lance's distance terms). The caller
re-ranks the candidates exactly; if its k-th exact distance is below ``floor``, no other
row can be nearer and the answer is the exact top k. Otherwise it asks for more candidates,
and in the end it falls back to the full exact scan. On random 384-dim vectors (the worst
case: distances crowd together) 256 candidates of 100k rows were enough.

Metrics, in Lance's terms: l2 = squared distance (bound from the L2 distance of the codes);
cosine = 1 - cos, from the L2 distance of the unit vectors (``|u - v|^2 = 2 - 2 cos``; a
zero vector's cosine counts as 0, and its code 0 lies at distance 1 < sqrt(2) from every
unit query, so the bound holds for it too, if loosely: many zero rows make the search fall
back to the exact scan more often); dot = 1 - inner product, bounded through
``|<q, t> - <q~, c> / scale^2| <= |q - q~ / scale| * max|t| + |q~ / scale| * slack``.

Matrices with non-finite values, rows whose squared norm overflows float32, or fewer than
`PRUNE_MIN_ROWS` rows, get no pruner.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import faiss
import numpy as np

#: Smaller matrices are scanned exactly (the int8 pass would save well under a millisecond).
PRUNE_MIN_ROWS = 4096
#: Rows encoded per step while building (bounds the float32 temporaries).
BUILD_CHUNK_ROWS = 16_384
#: Largest code magnitude.
CODE_MAX = 127.0
#: Relative slack for float32 rounding in the exact re-ranking and in measuring `slack`.
ROUNDING = 1e-4


@dataclass(frozen=True, slots=True)
class Pruner:
    """The int8 codes of a float32 matrix's rows (see the module docstring)."""

    index: faiss.IndexScalarQuantizer
    metric: str
    scale: float
    #: Largest distance between a row's target vector and its code / scale.
    slack: float
    #: Largest norm of a target vector.
    max_norm: float

    @property
    def num_rows(self) -> int:
        return int(self.index.ntotal)

    @property
    def nbytes(self) -> int:
        return int(self.index.ntotal * self.index.code_size)

    def search(
        self, query: np.ndarray, fetch: int, eligible: np.ndarray | None = None
    ) -> tuple[np.ndarray, float]:
        """The `fetch` rows (among the `eligible` ones) nearest to `query` by their codes,
        and ``floor``: every other eligible row's distance (Lance's terms) is at least that
        (``inf`` when no other eligible row exists)."""
        target = np.asarray(query, dtype=np.float64).reshape(-1)
        if self.metric == "cosine":
            norm = float(np.linalg.norm(target))
            target = target / norm if norm > 0 else target
        code = np.clip(np.rint(target * self.scale), -CODE_MAX, CODE_MAX)
        query_slack = float(np.linalg.norm(target - code / self.scale))
        params = None
        if eligible is not None:
            bits = np.packbits(eligible, bitorder="little")  # kept alive across the search
            selector = faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits))
            params = faiss.SearchParameters()
            params.sel = selector
        codes = code.astype(np.float32).reshape(1, -1)
        found, rows = self.index.search(codes, fetch, params=params)
        rows = rows[0]
        valid = rows >= 0
        if not valid.all() or not len(rows):
            return rows[valid].astype(np.int64), math.inf
        last = float(found[0][-1])
        if self.metric == "dot":
            above = last / self.scale**2
            code_norm = float(np.linalg.norm(code)) / self.scale
            bound = above + query_slack * self.max_norm + code_norm * self.slack
            bound += ROUNDING * (abs(above) + code_norm * self.max_norm)
            return rows.astype(np.int64), 1.0 - bound
        near = max(math.sqrt(max(last, 0.0)) / self.scale - query_slack - self.slack, 0.0)
        floor = near * near * (1 - ROUNDING)
        return rows.astype(np.int64), floor / 2 if self.metric == "cosine" else floor


def build_pruner(
    matrix: np.ndarray,
    metric: str,
    min_rows: int = PRUNE_MIN_ROWS,
    norms: np.ndarray | None = None,
    stop: Callable[[], bool] | None = None,
) -> Pruner | None:
    """The `Pruner` of a (rows, dim) float32 matrix under `metric` ("l2", "cosine", "dot"),
    or None: fewer than `min_rows` rows, or non-finite or all-zero values (or, for cosine,
    a row whose norm overflows float32), or `stop` said so before a chunk. `norms`: the
    rows' norms, as float32 ``sqrt(sum(row * row))`` computes them, if the caller has them
    (cosine).

    Two passes over the matrix, `BUILD_CHUNK_ROWS` rows at a time: the largest target
    component (the scale), then the codes. The targets are made once per chunk, in the
    second pass: a query-only process builds the pruners of a catch-up's fragments as they
    come, on the CPU its queries need (a quarter of its time in bench/catchup.py)."""
    n, dim = matrix.shape
    if n < min_rows:
        return None
    cosine = metric == "cosine"
    if cosine and norms is None:
        norms = np.sqrt(np.einsum("ij,ij->i", matrix, matrix))
    largest = 0.0
    max_norm = 0.0
    for start in range(0, n, BUILD_CHUNK_ROWS):
        if stop is not None and stop():
            return None
        rows = matrix[start : start + BUILD_CHUNK_ROWS]
        if cosine:
            assert norms is not None
            norm = norms[start : start + BUILD_CHUNK_ROWS]
            if not np.isfinite(norm).all():
                return None  # a non-finite value, or a row too long for float32
            # A unit row's largest component is the row's largest over its norm.
            peak = np.maximum(rows.max(axis=1), -rows.min(axis=1))
            nonzero = norm > 0
            if nonzero.any():
                largest = max(largest, float((peak[nonzero] / norm[nonzero]).max()))
        else:
            squares = np.einsum("ij,ij->i", rows, rows)
            if not np.isfinite(squares).all():
                return None
            largest = max(largest, float(rows.max()), -float(rows.min()))
            max_norm = max(max_norm, float(np.sqrt(squares.max())))
    if largest == 0.0:
        return None
    scale = CODE_MAX / largest
    index = faiss.IndexScalarQuantizer(
        dim,
        faiss.ScalarQuantizer.QT_8bit_direct_signed,
        faiss.METRIC_INNER_PRODUCT if metric == "dot" else faiss.METRIC_L2,
    )
    slack = 0.0
    for start in range(0, n, BUILD_CHUNK_ROWS):
        if stop is not None and stop():
            return None
        rows = matrix[start : start + BUILD_CHUNK_ROWS]
        if cosine:
            assert norms is not None
            norm = norms[start : start + BUILD_CHUNK_ROWS, None]
            # The unit rows times the scale, in one division (a zero row stays zero).
            scaled = rows / (np.where(norm > 0, norm, np.float32(1)) / np.float32(scale))
            longest = float(np.sqrt(np.einsum("ij,ij->i", scaled, scaled).max())) / scale
            max_norm = max(max_norm, longest)
        else:
            scaled = rows * np.float32(scale)
        codes = np.rint(scaled)
        np.clip(codes, -CODE_MAX, CODE_MAX, out=codes)
        scaled -= codes
        slack = max(slack, float(np.sqrt(np.einsum("ij,ij->i", scaled, scaled).max())))
        index.add(codes)
    slack = slack / scale * (1 + ROUNDING) + ROUNDING * max_norm
    return Pruner(index, metric, scale, slack, max_norm)


__all__ = ["PRUNE_MIN_ROWS", "Pruner", "build_pruner"]
