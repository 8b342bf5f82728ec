"""Filter-only scans over a snapshot: up to `limit` visible rows matching a filter.

Order: this process's memtable rows (newest tier first), then other pods' memtable rows
(fan-out), then base rows; base rows whose key a fresh memtable (here or on another pod)
decides are skipped (`Snapshot.base_overfetch`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from engine.filters import Predicate
from engine.reads.context import ReadContext
from engine.reads.remote import FanoutReport, RemoteAnswer
from engine.reads.snapshot import SCAN_BATCH_READAHEAD, SCAN_IO_BUFFER_BYTES, Snapshot


def scan(
    ctx: ReadContext,
    *,
    filter: str | Predicate | None = None,  # noqa: A002 - the query language's word
    columns: Sequence[str] | None = None,
    limit: int | None = None,
    report: FanoutReport | None = None,
) -> pa.Table:
    """See `engine.reader.Reader.scan`."""
    started = time.monotonic()
    limit = ctx.settings.max_k if limit is None else limit
    ctx.check_k(limit)
    predicate = ctx.predicate(filter)
    out_cols = ctx.columns(columns)
    fetch = ctx.fetch_columns(out_cols)

    def run(snap: Snapshot) -> list[pa.Table]:
        parts = tier_rows(snap, predicate, limit, fetch)
        remaining = limit - sum(p.num_rows for p in parts)
        # Any `limit` matching rows answer a scan: when this process's memtables hold them,
        # the owners are not asked (nor the base read). Asked only then, as a request sent
        # and not waited for would hold a fan-out thread for its timeout if its owner is
        # silent, and delay other queries' requests behind it.
        answers: list[RemoteAnswer] = []
        if snap.remote is not None and remaining > 0:
            request = {
                "kind": "scan",
                "filter": None if predicate is None else predicate.text,
                "limit": limit,
                "fetch": fetch,
            }
            answers = snap.remote.start(request).result()
        for table in snap.remote_rows(answers):
            if remaining > 0 and table.num_rows:
                parts.append(table.slice(0, remaining))
                remaining -= min(remaining, table.num_rows)
        if remaining > 0 and snap.base.count_rows():

            def fetch_rows(n: int) -> pa.Table:
                return snap.base.to_table(
                    filter=None if predicate is None else predicate.sql,
                    columns=fetch,
                    limit=n,
                    io_buffer_size=SCAN_IO_BUFFER_BYTES,
                    batch_readahead=SCAN_BATCH_READAHEAD,
                )

            parts.append(snap.base_overfetch(remaining, fetch_rows).slice(0, remaining))
        return parts

    parts = ctx.run(run, report)
    tables = [p.select(out_cols) for p in parts if p.num_rows]
    schema = pa.schema([ctx.spec.table_schema.field(c) for c in out_cols])
    out = pa.concat_tables([t.cast(schema) for t in tables]) if tables else schema.empty_table()
    ctx.events.query("scan", time.monotonic() - started, out.num_rows)
    return out


def tier_rows(
    snap: Snapshot, predicate: Predicate | None, limit: int, fetch: list[str]
) -> list[pa.Table]:
    """Up to `limit` visible rows of the snapshot's memtable tiers matching `predicate`,
    newest tier first. The owner pod of a fan-out read answers with this too
    (`engine.reads.fresh`)."""
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
    return parts
