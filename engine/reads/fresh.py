"""The owner side of fan-out reads: a pod's memtable tier, answered for another pod's query.

`FreshServer.answer` takes a request of `engine.reads.remote` (the coordinator's base
version V, the shards it believes this process holds with their epochs, the query kind and
its parameters) and answers with the same code the local query runs on its memtables:

- `vector`: the k nearest visible rows (`VectorSearch.memtable_part`);
- `text`: the corpus statistics of the query terms in its memtables, and its k best rows
  ranked with the statistics the coordinator sends (an estimate, or the exact ones when
  it asks again), with their term frequencies and lengths and the frontier of the rows
  not returned (`TextSearch.owner_part`; see `engine.reads.text`);
- `scan`: up to `limit` visible rows matching the filter (`scan.tier_rows`);
- `lookup`: the visible rows of the keys (`Lookup.memtable_part`);
- `decides`: for each key, whether a memtable holds it (an upsert or a delete), so the
  coordinator hides its base row (newest wins across pods);
- `parts`: several of the above at once (a hybrid query's vector and text requests), one
  packed sub-request per row, answered from ONE snapshot with one packed sub-answer per
  row, in order (`engine.reads.remote.RemoteTier.start_parts`).

The snapshot is taken as the single-process rule says, with the coordinator's base: views
first, then the base at version V, then `ShardView.fresh(V)`. If a view dropped a memtable
flushed above V, the answer is `stale_base` (see `engine.reads.remote`, I18). A shard this
process does not hold, holds at an older epoch than the request names (fenced), or cannot
read (poisoned) is answered as `refused`, with the reason.

Errors: a bad request raises `QueryError` (the HTTP layer answers 400).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pyarrow as pa

from engine.filters import QueryError
from engine.memtable import key_values
from engine.reads import snapshot as snapshots
from engine.reads.context import ReadContext
from engine.reads.lookup import Lookup
from engine.reads.merge import DISTANCE, top
from engine.reads.remote import PART, PARTS, pack, unpack
from engine.reads.scan import tier_rows
from engine.reads.snapshot import Snapshot
from engine.reads.text import TextSearch
from engine.reads.trace import stage
from engine.reads.vector import VectorSearch
from engine.schema import TableSpec
from engine.shard import ShardWriter


class FreshServer:
    """Answers other pods' fan-out requests from this process's shard writers."""

    def __init__(
        self, ctx: ReadContext, vector: VectorSearch, text: TextSearch, lookups: Lookup
    ) -> None:
        self.ctx = ctx
        self.vector = vector
        self.text = text
        self.lookups = lookups

    @property
    def spec(self) -> TableSpec:
        """The context's spec, as widened to follow the table (`ReadContext`)."""
        return self.ctx.spec

    def answer(self, body: bytes) -> bytes:
        """The packed answer to a packed request (see the module docstring).

        Raises:
            QueryError: the request is malformed.
        """
        started = time.monotonic()
        answer = self._answer(body)
        self.ctx.events.query("fresh", time.monotonic() - started, 0)
        return answer

    def _answer(self, body: bytes) -> bytes:
        try:
            keys, meta = unpack(body)
            version = int(meta["base_version"])
            asked = {str(s): int(e) for s, e in meta["shards"].items()}
            kind = str(meta["kind"])
            parts = [unpack(b) for b in keys.column(PART).to_pylist()] if kind == PARTS else []
        except (KeyError, TypeError, ValueError, pa.ArrowInvalid) as exc:
            raise QueryError(f"malformed fan-out request: {exc}") from exc
        if any(str(m.get("kind")) == PARTS for _, m in parts):
            raise QueryError("malformed fan-out request: a part is itself a parts request")
        held = {w.shard: w for w in self.ctx.shards()}
        refused: dict[str, str] = {}
        served: dict[str, int] = {}
        writers: list[ShardWriter] = []
        for shard, epoch in asked.items():
            writer = held.get(shard)
            if writer is None:
                refused[shard] = "the listed owner does not hold the shard (rebalance)"
            elif writer.epoch < epoch:
                refused[shard] = f"the listed owner is fenced (epoch {writer.epoch} < {epoch})"
            else:
                writers.append(writer)
                served[shard] = writer.epoch

        def skipped(shard: str, error: BaseException) -> None:
            served.pop(shard, None)
            refused[shard] = f"the shard cannot be read: {error}"

        def open_base() -> Any:
            try:
                return self.ctx.open_base(version)
            except ValueError as exc:  # Lance: no such version
                raise QueryError(f"base version {version} cannot be opened: {exc}") from exc

        with stage("snapshot"):
            snap = snapshots.take(self.spec, writers, open_base, skipped)
        if snap.dropped_through > version:
            return pack(pa.table({}), {"stale_base": snap.dropped_through})
        with stage("memtables"):
            if kind == PARTS:  # every part from this one snapshot
                answers = [pack(*self._run(str(m["kind"]), m, k, snap)) for k, m in parts]
                table, extra = pa.table({PART: pa.array(answers, pa.binary())}), dict[str, Any]()
            else:
                table, extra = self._run(kind, meta, keys, snap)
        return pack(table, {"served": served, "refused": refused, **extra})

    def _run(
        self, kind: str, meta: dict[str, Any], keys: pa.Table, snap: Snapshot
    ) -> tuple[pa.Table, dict[str, Any]]:
        ctx = self.ctx
        if kind == "decides":
            hidden = snap.local_hidden(key_values(keys, self.spec.primary_key))
            return pa.table({"decided": pa.array(hidden, pa.bool_())}), {}
        fetch = ctx.columns(_strings(meta, "fetch"))
        if kind == "lookup":
            wanted = key_values(keys, self.spec.primary_key)
            return self._one(self.lookups.memtable_part(snap, wanted, fetch), fetch, None), {}
        where = meta.get("filter")
        if where is not None and not isinstance(where, str):
            raise QueryError(f"malformed fan-out request: 'filter' is not a string: {where!r:.80}")
        predicate = ctx.parse_filter(where)
        if kind == "scan":
            limit = _field(meta, "limit", int)
            ctx.check_k(limit)
            return self._one(tier_rows(snap, predicate, limit, fetch), fetch, None), {}
        k = _field(meta, "k", int)
        ctx.check_k(k)
        if kind == "vector":
            query = self._vector(meta)
            parts = self.vector.memtable_part(snap, query, k, predicate, fetch)
            return self._one([top(parts, DISTANCE, k, ascending=True)], fetch, DISTANCE), {}
        if kind == "text":
            column = _field(meta, "column", str)
            if column not in self.spec.fts_columns:
                raise QueryError(f"malformed fan-out request: {column!r} is not a text column")
            terms = _strings(meta, "terms")
            words = [_pair(w) for w in _field(meta, "words", list)]
            idf_in = _field(meta, "idf", dict)
            if not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                for v in idf_in.values()
            ):
                raise QueryError("malformed fan-out request: 'idf' holds a value not a number")
            idf = {str(t): float(v) for t, v in idf_in.items()}
            if set(terms) != set(idf) or {t for t, _ in words} - set(terms):
                raise QueryError("malformed fan-out request: terms, words and idf disagree")
            # This pod's background tokenizer keeps its memtables tokenised for the next
            # request (a pod that only answers other pods' text queries never starts it
            # in `search`, and tokenised every new batch inline, under ingestion).
            self.text.tokenizer.start()
            mem = self.text.memtable_terms(snap.tiers, column, terms)
            table, best = self.text.owner_part(
                mem,
                terms,
                words,
                _field(meta, "phrase", bool),
                idf,
                _field(meta, "avgdl", float),
                predicate,
                k,
                fetch,
            )
            stats = {"documents": mem.documents, "length": mem.length, "df": mem.df}
            return table, {**stats, "frontier": best}
        raise QueryError(f"unknown fan-out request kind {kind!r}")

    def _vector(self, meta: dict[str, Any]) -> np.ndarray:
        """The request's query vector, as the coordinator validated it.

        Raises:
            QueryError: not a list of finite numbers of the table's dimension.
        """
        assert self.spec.vector is not None
        values = _field(meta, "vector", list)
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            raise QueryError("malformed fan-out request: 'vector' holds a value not a number")
        query = np.asarray(values, dtype=np.float32)
        if query.shape != (self.spec.vector.dim,) or not np.isfinite(query).all():
            raise QueryError(
                f"malformed fan-out request: 'vector' is not {self.spec.vector.dim} finite numbers"
            )
        return query

    def _one(self, parts: list[pa.Table], fetch: list[str], extra: str | None) -> pa.Table:
        """One table of `fetch` (and `extra`, float32) columns from `parts`."""
        fields = [self.spec.table_schema.field(c) for c in fetch]
        if extra is not None:
            fields.append(pa.field(extra, pa.float32()))
        schema = pa.schema(fields)
        tables = [p.select(schema.names).cast(schema) for p in parts if p.num_rows]
        return pa.concat_tables(tables) if tables else schema.empty_table()


def _field(meta: dict[str, Any], name: str, kind: type) -> Any:
    """`meta[name]`, of JSON type `kind` (an int is a float; a bool is neither).

    Raises:
        QueryError: absent, or of another type.
    """
    if name not in meta:
        raise QueryError(f"malformed fan-out request: no {name!r}")
    value = meta[name]
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise QueryError(
            f"malformed fan-out request: {name!r} is not a {kind.__name__}: {value!r:.80}"
        )
    return float(value) if kind is float else value


def _strings(meta: dict[str, Any], name: str) -> list[str]:
    values: list[Any] = _field(meta, name, list)
    if not all(isinstance(v, str) for v in values):
        raise QueryError(f"malformed fan-out request: {name!r} holds a value not a string")
    return [str(v) for v in values]


def _pair(word: Any) -> tuple[str, int]:
    """A (term, position) pair of a text request's `words`."""
    if (
        isinstance(word, list | tuple)
        and len(word) == 2
        and isinstance(word[0], str)
        and isinstance(word[1], int)
        and not isinstance(word[1], bool)
    ):
        return word[0], word[1]
    raise QueryError(f"malformed fan-out request: a word is not [term, position]: {word!r:.80}")
