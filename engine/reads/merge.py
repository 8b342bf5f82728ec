"""Merging ranked parts: memtable candidates and the top k across tiers.

A ranked query (vector, text) collects `Candidates` from every memtable batch (row
indices and their distance or score, nothing materialised), takes the rows of the k best
only (`materialise`), and merges them with the base's rows by value (`top`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.reads.tiers import MemtableTier

DISTANCE = "_distance"
SCORE = "_score"


@dataclass(frozen=True, slots=True)
class Candidates:
    """Rows of one memtable batch that may make a query's top k, with their distance or
    score (`values`); materialised only if they do (`materialise`)."""

    tier: MemtableTier
    batch: int
    rows: np.ndarray
    values: np.ndarray


def select(
    candidates: list[Candidates], k: int, *, ascending: bool
) -> list[tuple[Candidates, np.ndarray]]:
    """The k best of `candidates` (by value): each candidate holding some, with the
    positions (into its `rows`) of its winners."""
    if not candidates:
        return []
    values = np.concatenate([c.values for c in candidates])
    owner = np.repeat(np.arange(len(candidates)), [len(c.rows) for c in candidates])
    positions = np.concatenate([np.arange(len(c.rows)) for c in candidates])
    key = values if ascending else -values.astype(np.float64)
    best = np.argpartition(key, k - 1)[:k] if len(key) > k else np.arange(len(key))
    return [(candidates[int(c)], positions[best[owner[best] == c]]) for c in np.unique(owner[best])]


def materialise(
    candidates: list[Candidates],
    k: int,
    fetch: list[str],
    column: str,
    *,
    ascending: bool,
) -> list[pa.Table]:
    """The rows of the k best memtable candidates (by `column` value), one table per
    batch they come from. Only winners are taken from their batches: with hundreds of
    small batches in a memtable, building a table per batch dominated a query."""
    out = []
    for cand, mine in select(candidates, k, ascending=ascending):
        table = cand.tier.take(cand.batch, cand.rows[mine], fetch)
        out.append(table.append_column(column, pa.array(cand.values[mine], pa.float32())))
    return out


def top(parts: list[pa.Table], column: str, k: int, *, ascending: bool) -> pa.Table:
    """The k best rows of `parts` by `column` (smallest first with `ascending`)."""
    tables = [p for p in parts if p.num_rows]
    if not tables:
        return parts[0] if parts else pa.table({})
    merged = pa.concat_tables(tables, promote_options="permissive")
    order = "ascending" if ascending else "descending"
    idx = pc.sort_indices(merged, sort_keys=[(column, order)])
    return merged.take(idx.slice(0, k))
