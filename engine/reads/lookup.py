"""Primary-key lookups over a snapshot: the visible rows of many keys in one call.

Upsert tables: tiers are asked newest first, and the first tier that holds a key decides
it (its newest row, or nothing for a delete); keys no memtable decides are looked up in
the base. Append tables: every tier's rows with the key, then the base's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.filters import QueryError
from engine.reads.context import ReadContext
from engine.reads.remote import FanoutReport, key_table
from engine.reads.snapshot import Snapshot
from engine.reads.tiers import MemtableTier
from engine.schema import TableSpec


class Lookup:
    """The lookup query kind: `lookup` over one snapshot per call."""

    def __init__(self, ctx: ReadContext) -> None:
        self.ctx = ctx
        self._key_types = [ctx.spec.table_schema.field(k).type for k in ctx.spec.primary_key]

    @property
    def spec(self) -> TableSpec:
        """The context's spec, as widened to follow the table (`ReadContext`)."""
        return self.ctx.spec

    def lookup(
        self,
        keys: Sequence[Any],
        *,
        columns: Sequence[str] | None = None,
        report: FanoutReport | None = None,
    ) -> pa.Table:
        """See `engine.reader.Reader.lookup`."""
        ctx = self.ctx
        started = time.monotonic()
        wanted = self.normalise_keys(keys)
        out_cols = ctx.columns(columns)
        fetch = list(dict.fromkeys([*out_cols, *self.spec.primary_key]))

        def run(snap: Snapshot) -> list[pa.Table]:
            remote = None
            if snap.remote is not None and not self.spec.upsert:
                remote = snap.remote.start({"kind": "lookup", "fetch": fetch}, self.keys(wanted))
            parts = self.memtable_part(snap, wanted, fetch)
            if self.spec.upsert:
                pending = dict.fromkeys(wanted)
                for part in parts:
                    for key in ctx.keys_of(part):
                        pending.pop(key, None)
                # Keys a local tier decides as deletes return no row: not pending either.
                decided = snap.local_hidden(list(pending))
                remaining = [k for k, hidden in zip(pending, decided, strict=True) if not hidden]
                if remaining and snap.remote is not None:
                    answers = snap.remote.ask(
                        {"kind": "lookup", "fetch": fetch}, self.keys(remaining)
                    )
                    for table in snap.remote_rows(answers):
                        parts.append(table)
                        found = set(ctx.keys_of(table))
                        remaining = [k for k in remaining if k not in found]
            else:
                if remote is not None:
                    parts.extend(snap.remote_rows(remote.result()))
                remaining = wanted
            if remaining and snap.base.count_rows():
                base = snap.base.to_table(filter=self._key_expression(remaining), columns=fetch)
                base = base.filter(pa.array(self._key_match(base, set(remaining))))
                if self.spec.upsert and base.num_rows and snap.remote is not None:
                    # A key deleted in another pod's memtable: its base row is not shown.
                    base = base.filter(pa.array(~snap.base_hidden(ctx.keys_of(base))))
                parts.append(base)
            return parts

        parts = ctx.run(run, report)
        tables = [p.select(out_cols) for p in parts if p.num_rows]
        schema = pa.schema([self.spec.table_schema.field(c) for c in out_cols])
        out = pa.concat_tables([t.cast(schema) for t in tables]) if tables else schema.empty_table()
        ctx.events.query("lookup", time.monotonic() - started, out.num_rows)
        return out

    def memtable_part(self, snap: Snapshot, wanted: list[Any], fetch: list[str]) -> list[pa.Table]:
        """The visible rows of `wanted` keys in the snapshot's memtable tiers (upsert: the
        newest tier holding a key decides it; a delete returns no row). The owner pod of a
        fan-out read answers with this too (`engine.reads.fresh`)."""
        parts: list[pa.Table] = []
        if self.spec.upsert:
            pending = dict.fromkeys(wanted)
            for tier in snap.tiers:
                if not pending:
                    break
                parts.extend(self._lookup_upsert_tier(tier, pending, fetch))
        else:
            for tier in snap.tiers:
                parts.extend(self._lookup_append_tier(tier, wanted, fetch))
        return parts

    def keys(self, keys: list[Any]) -> pa.Table:
        """`keys` as a table of the key columns (for a fan-out request)."""
        return key_table(self.spec, keys)

    def normalise_keys(self, keys: Sequence[Any]) -> list[Any]:
        """The distinct keys, each cast to the key columns' types (a tuple per composite key).

        Raises:
            QueryError: a key has the wrong number of values, a value does not fit its
                column's type, or a value is null.
        """
        names = self.spec.primary_key
        columns: list[list[Any]] = [[] for _ in names]
        for key in keys:
            parts = list(key) if len(names) > 1 and isinstance(key, list | tuple) else [key]
            if len(parts) != len(names):
                raise QueryError(
                    f"a key needs {len(names)} values ({', '.join(names)}), got {key!r}"
                )
            for col, part in zip(columns, parts, strict=True):
                col.append(part)
        arrays = []
        for name, values, ktype in zip(names, columns, self._key_types, strict=True):
            for value in values:
                if not _fits_key_type(value, ktype):
                    raise QueryError(
                        f"key value {value!r} ({type(value).__name__}) is not a {ktype} value "
                        f"of key column {name!r}"
                    )
            try:
                arrays.append(pa.array(values, type=ktype))
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
                raise QueryError(f"key values do not fit column {name!r} ({ktype}): {exc}") from exc
            if arrays[-1].null_count:
                raise QueryError(f"null in key column {name!r}")
        if len(names) == 1:
            return list(dict.fromkeys(arrays[0].to_pylist()))
        return list(dict.fromkeys(zip(*(a.to_pylist() for a in arrays), strict=True)))

    def _lookup_upsert_tier(
        self, tier: MemtableTier, pending: dict[Any, None], fetch: list[str]
    ) -> list[pa.Table]:
        keys = tier.view.keys
        assert keys is not None
        found: list[int] = []
        for key in list(pending):
            rid = keys.get(key)
            if rid is None:
                continue
            if rid >= tier.rows:  # updated after the snapshot: find its row in the view
                rid = tier.find_in_view(key)
                if rid is None:
                    continue
            del pending[key]  # this tier decides the key (upsert or delete)
            found.append(rid)
        if not found:
            return []
        rids = np.asarray(sorted(found), dtype=np.int64)
        batch_of = np.searchsorted(tier.starts, rids, side="right") - 1
        out = []
        for b in np.unique(batch_of):
            rows = rids[batch_of == b] - tier.starts[b]
            live = tier.view.live[b]
            if live is not None:
                rows = rows[live[rows]]
            if len(rows):
                out.append(tier.take(int(b), rows, fetch))
        return out

    def _lookup_append_tier(
        self, tier: MemtableTier, wanted: list[Any], fetch: list[str]
    ) -> list[pa.Table]:
        wanted_set = set(wanted)
        value_sets = self._key_value_sets(wanted)
        out = []
        for i, batch in enumerate(tier.view.batches):
            if not batch.num_rows:
                continue
            mask = self._key_match(batch, wanted_set, value_sets)
            live = tier.view.live[i]
            if live is not None:
                mask &= live
            rows = np.flatnonzero(mask)
            if len(rows):
                out.append(tier.take(i, rows, fetch))
        return out

    def _key_value_sets(self, keys: list[Any]) -> list[pa.Array]:
        """The distinct values of each key column among `keys` (Arrow arrays for `is_in`)."""
        names = self.spec.primary_key
        return [
            pa.array(list({k[j] if len(names) > 1 else k for k in keys}), type=ktype)
            for j, ktype in enumerate(self._key_types)
        ]

    def _key_match(
        self,
        table: pa.Table | pa.RecordBatch,
        wanted: set[Any],
        value_sets: list[pa.Array] | None = None,
    ) -> np.ndarray:
        """Rows whose key is in `wanted` (vectorised `is_in` per key column, then an exact
        tuple check of the few candidates for composite keys)."""
        names = self.spec.primary_key
        sets = value_sets if value_sets is not None else self._key_value_sets(list(wanted))
        mask = np.ones(table.num_rows, dtype=bool)
        for name, values in zip(names, sets, strict=True):
            hit = pc.fill_null(pc.is_in(table.column(name), value_set=values), False)
            mask &= hit.to_numpy(zero_copy_only=False)
        if len(names) > 1 and mask.any():
            rows = np.flatnonzero(mask)
            sub = table.take(pa.array(rows))
            exact = np.fromiter(
                (k in wanted for k in self.ctx.keys_of(sub)), dtype=bool, count=len(rows)
            )
            mask[rows[~exact]] = False
        return mask

    def _key_expression(self, keys: list[Any]) -> pc.Expression:
        expr: pc.Expression | None = None
        for name, values in zip(self.spec.primary_key, self._key_value_sets(keys), strict=True):
            part = pc.field(name).isin(values)
            expr = part if expr is None else expr & part
        assert expr is not None
        return expr


def _fits_key_type(value: Any, ktype: pa.DataType) -> bool:
    """Whether a lookup key value is of its column's type as it is, with no conversion:
    Arrow would truncate 1.5 to 1 for an int64 key, or read True as 1, and return the row
    of another key. (A null is refused on its own, after the conversion.)"""
    if value is None:
        return True
    if pa.types.is_integer(ktype):
        return isinstance(value, int) and not isinstance(value, bool)
    if pa.types.is_floating(ktype):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if pa.types.is_string(ktype) or pa.types.is_large_string(ktype):
        return isinstance(value, str)
    if pa.types.is_boolean(ktype):
        return isinstance(value, bool)
    return True  # other types: Arrow's own conversion decides
