"""BM25 over term frequencies alone, and the frontier that bounds the rows not returned.

An owner pod's text answer (`engine.reads.text.TextSearch.owner_part`) carries each row's
frequency of every query term and its length (`TERM_FREQUENCIES`, `DOC_LENGTH`), so the
coordinator scores the rows with the exact corpus statistics (`rescore`: the same sums, in
the same order, as a memtable row's, `bm25_rows`); and the `frontier` of the rows it did
not return, whose best score under those statistics (`frontier_best`) bounds every one of
them. Pure numpy over the rows given: no state, no I/O.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from engine import fts
from engine.reads.merge import SCORE

__all__ = [
    "DOC_LENGTH",
    "FRONTIER_PAIRWISE_MAX",
    "TERM_FREQUENCIES",
    "bm25_rows",
    "frontier",
    "frontier_best",
    "rescore",
    "tf_matrix",
]

#: Columns of an owner pod's text answer besides `_score`: each row's frequency of every
#: query term (in the request's `terms` order) and its length in tokens.
TERM_FREQUENCIES = "_bm25_tf"
DOC_LENGTH = "_bm25_dl"
#: `frontier` compares its points pairwise only up to this many (a few MB of booleans);
#: past it, the points are sent as they are (still a valid bound, only longer).
FRONTIER_PAIRWISE_MAX = 1_024


def tf_matrix(tfs: dict[str, np.ndarray], terms: list[str], rows: np.ndarray, n: int) -> np.ndarray:
    """Frequencies of `terms` (columns, 0 for a term the batch lacks) for `rows`."""
    zeros = np.zeros(n, dtype=np.int32)
    return np.column_stack([tfs.get(t, zeros)[rows] for t in terms]).astype(np.int32)


def frontier(signatures: np.ndarray) -> np.ndarray:
    """The rows of `signatures` (term frequencies..., length) no other row dominates.

    A BM25 score grows with every term frequency and shrinks with the length, whatever the
    corpus statistics; so the best score any of the rows can have, under any statistics,
    is the best of these (`frontier_best`). Rows of the same frequencies keep the shortest
    only (one sort), then dominated rows are dropped pairwise (up to
    `FRONTIER_PAIRWISE_MAX`; a query's terms make few distinct frequency vectors)."""
    if not len(signatures):
        return signatures
    freqs, lengths = signatures[:, :-1], signatures[:, -1]
    order = np.lexsort((lengths, *freqs.T[::-1]))  # by frequencies, then shortest first
    ordered = signatures[order]
    first = np.ones(len(ordered), dtype=bool)
    first[1:] = (ordered[1:, :-1] != ordered[:-1, :-1]).any(axis=1)
    unique = ordered[first]
    if len(unique) > FRONTIER_PAIRWISE_MAX:
        return unique
    dominates = (unique[:, None, :-1] >= unique[None, :, :-1]).all(axis=2) & (
        unique[:, None, -1] <= unique[None, :, -1]
    )
    np.fill_diagonal(dominates, False)
    kept: np.ndarray = unique[~dominates.any(axis=0)]
    return kept


def bm25_rows(
    tf: np.ndarray, doc_len: np.ndarray, terms: list[str], term_idf: dict[str, float], avgdl: float
) -> np.ndarray:
    """BM25 of rows given their term frequencies (one column per term of `terms`), float32:
    the same sums in the same order as a memtable batch's, so the same values."""
    score = np.zeros(len(doc_len), dtype=np.float64)
    for j, term in enumerate(terms):  # a term a row lacks adds exactly 0.0
        score += fts.bm25(tf[:, j], doc_len, term_idf[term], avgdl)
    out: np.ndarray = score.astype(np.float32)
    return out


def rescore(
    table: pa.Table, terms: list[str], term_idf: dict[str, float], avgdl: float
) -> pa.Table:
    """An owner pod's text answer (`TextSearch.owner_part`) scored with `term_idf` and
    `avgdl`, without the frequency and length columns."""
    rows = table.num_rows
    tf = (
        table.column(TERM_FREQUENCIES).combine_chunks().flatten().to_numpy(zero_copy_only=False)
        if rows
        else np.zeros(0, dtype=np.int32)
    ).reshape(rows, len(terms))
    doc_len = table.column(DOC_LENGTH).to_numpy(zero_copy_only=False)
    score = bm25_rows(tf, doc_len, terms, term_idf, avgdl)
    table = table.drop_columns([TERM_FREQUENCIES, DOC_LENGTH])
    return table.set_column(
        table.schema.get_field_index(SCORE), SCORE, pa.array(score, pa.float32())
    )


def frontier_best(
    points: list[list[int]], terms: list[str], term_idf: dict[str, float], avgdl: float
) -> float:
    """The best score any row of a `frontier` can have with these statistics (-inf: none)."""
    if not points:
        return float("-inf")
    signatures = np.asarray(points, dtype=np.int64)
    return float(bm25_rows(signatures[:, :-1], signatures[:, -1], terms, term_idf, avgdl).max())
