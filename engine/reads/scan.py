"""Filter-only scans over a snapshot: up to `limit` visible rows matching a filter.

Order: memtable rows (newest tier first), then base rows; base rows whose key a fresh
memtable decides are skipped (`Snapshot.base_overfetch`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from engine.filters import Predicate
from engine.reads.context import ReadContext


def scan(
    ctx: ReadContext,
    *,
    filter: str | Predicate | None = None,  # noqa: A002 - the query language's word
    columns: Sequence[str] | None = None,
    limit: int | None = None,
) -> pa.Table:
    """See `engine.reader.Reader.scan`."""
    started = time.monotonic()
    limit = ctx.settings.max_k if limit is None else limit
    ctx.check_k(limit)
    predicate = ctx.predicate(filter)
    out_cols = ctx.columns(columns)
    fetch = ctx.fetch_columns(out_cols)
    snap = ctx.snapshot()
    parts: list[pa.Table] = []
    remaining = limit
    for tier in snap.tiers:
        for i, batch in enumerate(tier.view.batches):
            if remaining <= 0:
                break
            if not batch.num_rows:
                continue
            eligible = tier.eligible(i, predicate)
            rows = np.arange(batch.num_rows) if eligible is None else np.flatnonzero(eligible)
            rows = tier.visible(i, rows)[:remaining]
            if len(rows):
                parts.append(tier.take(i, rows, fetch))
                remaining -= len(rows)
    if remaining > 0 and snap.base.count_rows():

        def fetch_rows(n: int) -> pa.Table:
            return snap.base.to_table(
                filter=None if predicate is None else predicate.sql,
                columns=fetch,
                limit=n,
            )

        parts.append(snap.base_overfetch(remaining, fetch_rows).slice(0, remaining))
    tables = [p.select(out_cols) for p in parts if p.num_rows]
    schema = pa.schema([ctx.spec.table_schema.field(c) for c in out_cols])
    out = pa.concat_tables([t.cast(schema) for t in tables]) if tables else schema.empty_table()
    ctx.events.query("scan", time.monotonic() - started, out.num_rows)
    return out
