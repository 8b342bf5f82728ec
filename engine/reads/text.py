"""Full-text (BM25) search over a snapshot, with the base's corpus statistics.

Memtables are scored here with Lance's BM25 formula and tokenizer (`engine.fts`), with
*global* statistics: documents, document frequencies and average length over the base and
every fresh memtable together, so their scores compare with the base's. The base's
statistics are estimated from a sample and counted with Lance's FTS where a term is rare,
cached per base version (`engine.reads.stats`). Base fragments the text index does not
cover yet are scored from the memtables this process flushed into them, or read back
(`engine.unindexed.FlushedText`, `engine.reads.tiers.FlushedTier`), while Lance searches
the indexed fragments only; otherwise Lance searches the whole base (flat where
unindexed). Before a column's first index, those memtables stand for the whole base and
are scored with its own exact statistics (as `unindexed_base_bm25` scores it).

Across pods (fan-out) the statistics include the other pods' memtables, and the scores are
exactly those of one process holding every shard, in one round trip per owner pod:

1. the coordinator sends each owner an estimate of the statistics (`TextSearch.hint`:
   the base's, plus the memtables' totals as its last fan-out text query found them);
2. the owner answers with its memtables' statistics and its `REMOTE_CANDIDATES` * k best
   rows ranked by the estimate, each with its term frequencies and length, and the
   `frontier` of the rows it did not return (`TextSearch.owner_part`);
3. the coordinator adds up the exact statistics, scores every returned row with them (the
   same sums as a local memtable row: `rescore`) and merges. A BM25 score grows with each
   term frequency and shrinks with the length, so the frontier's best score under the
   exact statistics bounds every row not returned (`frontier_best`); an owner whose bound
   beats the k-th score is asked again with the exact statistics (a second round trip,
   for that owner only, when the estimate was far off). `frontier`, `rescore` and
   `frontier_best` are pure math over term frequencies (`engine.reads.bm25`).

Lifecycle: one `TextSearch` per reader. The first query starts the background tokenizer
(a daemon thread that tokenises new memtable batches every `TOKENIZE_INTERVAL_S`); `close`
stops it (idempotent; queries then tokenise inline).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import structlog
from lance.query import MatchQuery, PhraseQuery

from engine import fts
from engine.errors import LanceSinkError
from engine.filters import Predicate, QueryError, UnknownColumn
from engine.periodic import PeriodicThread
from engine.reads import bm25
from engine.reads.context import ReadContext
from engine.reads.merge import SCORE, Candidates, materialise, select, top
from engine.reads.remote import Asked, FanoutReport, RemoteAnswer, RemoteTier, Started
from engine.reads.snapshot import SCAN_BATCH_READAHEAD, SCAN_IO_BUFFER_BYTES, Snapshot
from engine.reads.tiers import FLUSHED_TIER, FlushedTier, MemtableTier
from engine.reads.trace import stage
from engine.schema import TableSpec
from engine.unindexed import FlushedText, covered_fragments

log = structlog.get_logger("lance_sink.reader")

#: avgdl of the base for BM25 is estimated from this many of its documents (per version).
AVGDL_SAMPLE_ROWS = 2_000
#: A term found in at least this many sampled base documents has its document frequency
#: estimated from the sample (relative error ~1/sqrt(20) ~ 22%, a few percent of IDF).
DF_SAMPLE_MIN_HITS = 20
#: A rare term's base document frequency is counted on the text-indexed fragments and
#: scaled to the whole base while the index covers at least this share of its rows (a flush
#: or two behind); below it, or with no index, Lance counts every row.
MIN_TEXT_INDEX_COVERAGE = 0.5
#: A query waits this long for a rare term's first count (Lance's FTS count: a few ms idle,
#: ~0.5 s while maintenance and flushes keep the CPUs busy: the text p99 under ingestion);
#: past it the query uses the sample's estimate, and the count, which goes on on the stats
#: thread, serves the next queries.
DF_WAIT_S = 0.05
#: The background tokenizer looks for new memtable batches this often. Under ingestion at
#: ~30k rows/s a query then finds at most ~750 rows (~6 ms of tokenising) not tokenised
#: yet; a look costs one view per shard, microseconds for an append table.
TOKENIZE_INTERVAL_S = 0.025
#: Bounds of a text query. Each distinct term is counted in the base and the memtables and
#: searched in Lance's index, so the terms bound a query's time and memory: 20,000 terms in
#: one query took 1-6 GB and every query slot. Queries past them get 400, as filters past
#: theirs (`engine.filters`).
MAX_TEXT_CHARS = 16_384
MAX_TEXT_TERMS = 128
#: Lance's tokenizer leaves out longer words (its INVERTED index's `max_token_length`).
MAX_TOKEN_CHARS = 40
#: An owner pod answers a fan-out text query with this many times k rows, ranked by the
#: coordinator's estimate of the corpus statistics (`TextSearch.hint`): the coordinator
#: scores them with the exact statistics and asks again only when a row not returned
#: might beat its k-th (`bm25.frontier_best`). The estimate is off by the memtables' change
#: since the last query, so the exact top k is almost always among the first 2k.
REMOTE_CANDIDATES = 2
#: Terms whose memtable document frequency `hint` remembers per column (then it starts
#: over): a few hundred KiB at most.
HINT_TERMS = 10_000


@dataclass
class MemtableTerms:
    """The query terms in a set of memtable tiers: their statistics (`documents`, `length`
    = tokens, `df` per term: live rows with a token, as Lance's index counts the base) and,
    per batch with a query term, the term frequencies to score it with."""

    documents: int
    length: int
    df: dict[str, int]
    batches: list[
        tuple[MemtableTier, int, np.ndarray, fts.BatchTerms, dict[str, int], dict[str, np.ndarray]]
    ]


class TextSearch:
    """The text query kind: `search` over one snapshot per call.

    `room(n)` says whether n more bytes of flushed memtables may be held for text search
    (the bound shared with the unindexed-fragment cache); None turns holding them off.
    """

    def __init__(
        self,
        ctx: ReadContext,
        terms: fts.MemtableTermCache,
        room: Callable[[int], bool] | None,
    ) -> None:
        self.ctx = ctx
        self.terms = terms
        self.tokenizer = PeriodicThread(
            "reader-tokenizer", TOKENIZE_INTERVAL_S, self._tokenize_once, "reader_tokenize_failed"
        )
        #: Memtable totals (documents, tokens, df per term) per column, as the last
        #: fan-out text query found them: its estimate for the next (`hint`).
        self._mem_totals: dict[str, tuple[int, int, dict[str, int]]] = {}
        self.flushed_text: FlushedText | None = None
        if self.spec.fts_columns and room is not None:
            self.flushed_text = FlushedText(
                self.spec.fts_columns,
                lambda: self.tokenizer.thread is not None and not ctx.closed.is_set(),
                room,
                terms,
                None if self.spec.vector is None else self.spec.vector.name,
                read_back=(self.spec, ctx.open_base),
            )

    @property
    def spec(self) -> TableSpec:
        """The context's spec, as widened to follow the table (`ReadContext`)."""
        return self.ctx.spec

    def close(self, timeout: float) -> None:
        """Stop the background tokenizer (waiting up to `timeout` seconds)."""
        self.tokenizer.close(timeout)

    def _tokenize_once(self) -> None:
        """Tokenise the new batches of every memtable of every shard (durable, visible rows
        only: a view holds nothing else); run every `TOKENIZE_INTERVAL_S` by the background
        tokenizer. Queries tokenise what it has not reached yet themselves."""
        for writer in self.ctx.shards():
            try:
                view = writer.view()
            except LanceSinkError:
                continue  # poisoned or fenced: queries skip it too
            for m in view.memtables:
                for column in self.spec.fts_columns:
                    self.terms.terms(m.memtable, column, m.batches)

    def search(
        self,
        text: str,
        *,
        k: int = 10,
        column: str | None = None,
        phrase: bool = False,
        filter: str | Predicate | None = None,  # noqa: A002 - the query language's word
        columns: Sequence[str] | None = None,
        report: FanoutReport | None = None,
    ) -> pa.Table:
        """See `engine.reader.Reader.search_text`."""
        started = time.monotonic()
        begin, out_cols = self.prepare(
            text, k=k, column=column, phrase=phrase, filter=filter, columns=columns
        )
        merged = self.ctx.run(lambda snap: begin(snap).alone(snap.remote), report)
        return self.ctx.finish("text", started, [merged], out_cols, SCORE)

    def prepare(
        self,
        text: str,
        *,
        k: int,
        column: str | None,
        phrase: bool,
        filter: str | Predicate | None,  # noqa: A002 - the query language's word
        columns: Sequence[str] | None,
    ) -> tuple[Callable[[Snapshot], Started], list[str]]:
        """The request validated: how to begin it on a snapshot (its first-round owner
        request, ranked by an estimate of the statistics, and the rest: `Started`), and
        its output columns (the merged top k holds `fetch` columns and `_score`).

        Raises:
            QueryError: see `engine.reader.Reader.search_text`.
        """
        ctx = self.ctx
        if not self.spec.fts_columns:
            raise QueryError("the table has no full-text (fts_columns) column")
        column = column or self.spec.fts_columns[0]
        if column not in self.spec.fts_columns:
            raise UnknownColumn(
                f"{column!r} is not a full-text column (fts_columns: "
                f"{', '.join(self.spec.fts_columns)})",
                column=column,
            )
        ctx.check_k(k)
        if len(text) > MAX_TEXT_CHARS:
            raise QueryError(
                f"the text query is {len(text)} characters long; at most {MAX_TEXT_CHARS}"
            )
        self.tokenizer.start()
        words = fts.tokenize(text)
        if not words:
            raise QueryError(
                "the text query has no searchable terms: only stop words, or words of "
                f"{MAX_TOKEN_CHARS} characters or more, which the index leaves out"
            )
        terms = list(dict.fromkeys(t for t, _ in words))
        if len(terms) > MAX_TEXT_TERMS:
            raise QueryError(
                f"the text query has {len(terms)} distinct terms; at most {MAX_TEXT_TERMS}"
            )
        predicate = ctx.predicate(filter)
        out_cols = ctx.columns(columns)
        fetch = ctx.fetch_columns(out_cols)
        name = column

        def begin(snap: Snapshot) -> Started:
            column = name
            with stage("text_stats"):
                n_base, avgdl_base, _, _ = self.base_text_stats(snap.base, column)
            remote = snap.remote
            request: dict[str, Any] = {
                "kind": "text",
                "column": column,
                "terms": terms,
                "words": words,
                "phrase": phrase,
                "filter": None if predicate is None else predicate.text,
                "fetch": fetch,
            }
            first = None
            if remote is not None:  # one round trip, ranked by an estimate (module docstring)
                estimate = {t: self.base_df_estimate(snap.base, column, t) for t in terms}
                hint_idf, hint_avgdl = self.hint(column, terms, n_base, avgdl_base, estimate)
                hint_idf = weighted(hint_idf, words)
                first = {
                    **request,
                    "idf": hint_idf,
                    "avgdl": hint_avgdl,
                    "k": min(k * REMOTE_CANDIDATES, self.ctx.settings.max_k),
                }

            def finish(pending: Asked | None) -> pa.Table:
                # While the owners answer (their requests went out first): the flushed
                # memtables standing for base fragments the text index lacks (one just
                # flushed by another pod may have to be read back first), scored here and
                # counted in the base's statistics already, while Lance searches only
                # indexed rows.
                with stage("text_unindexed_load"):
                    held = (
                        None
                        if self.flushed_text is None
                        else self.flushed_text.views(snap.base, column)
                    )
                flushed = [FlushedTier(h, snap.base, self.spec) for h in held or ()]
                # Before the column's first index they stand for the whole base, and are
                # scored as `unindexed_base_bm25` scores it (the base's own statistics,
                # exact) without tokenising it again for every query.
                whole = held is not None and self.text_index_coverage(snap.base, column) is None
                base = ctx.meanwhile(
                    self._text_base,
                    snap,
                    text,
                    words,
                    column,
                    phrase,
                    predicate,
                    k,
                    fetch,
                    held is not None,
                )
                # Then this process's memtables, and the base's document frequencies (a
                # rare term's first count may take up to DF_WAIT_S).
                with stage("memtables"):
                    mem = self.memtable_terms(
                        [*snap.tiers, *([] if whole else flushed)], column, terms
                    )
                documents, length, df = mem.documents, mem.length, dict(mem.df)
                if whole:
                    of_base = self.memtable_terms(flushed, column, terms, count_flushed=True)
                    base_n, base_avgdl, base_df = of_base.documents, 1.0, dict(of_base.df)
                    if base_n:
                        base_avgdl = of_base.length / base_n
                else:
                    base_n, base_avgdl = n_base, avgdl_base
                    with stage("text_stats"):
                        base_df = {t: self.base_df(snap.base, column, t) for t in terms}
                answers = [] if pending is None else pending.result()
                for answer in answers:  # their memtables count in the corpus statistics too
                    documents += int(answer.meta["documents"])
                    length += int(answer.meta["length"])
                    for t in terms:
                        df[t] += int(answer.meta["df"].get(t, 0))
                if pending is not None:
                    self._remember(column, documents, length, df)

                n_total = base_n + documents
                avgdl = (base_avgdl * base_n + length) / n_total if n_total else 1.0
                term_idf = weighted({t: fts.idf(n_total, base_df[t] + df[t]) for t in terms}, words)
                parts = self.memtable_part(mem, words, phrase, term_idf, avgdl, predicate, k, fetch)
                if whole:
                    base_idf = weighted({t: fts.idf(base_n, base_df[t]) for t in terms}, words)
                    parts.extend(
                        self.memtable_part(
                            of_base, words, phrase, base_idf, base_avgdl, predicate, k, fetch
                        )
                    )
                with stage("base_wait"):
                    parts.append(base.result())
                if remote is None or pending is None:
                    return top(parts, SCORE, k, ascending=False)
                exact = {"idf": term_idf, "avgdl": avgdl, "k": k}
                return self._merge_remote(snap, remote, parts, answers, {**request, **exact}, k)

            return Started(first, finish)

        return begin, out_cols

    def memtable_terms(
        self,
        tiers: Sequence[MemtableTier],
        column: str,
        terms: list[str],
        count_flushed: bool = False,
    ) -> MemtableTerms:
        """Statistics and term frequencies of `terms` in the tiers' live rows. Flushed tiers
        (`FLUSHED_TIER`) are scored but not counted (the base's statistics hold them) unless
        `count_flushed` (they are the base's statistics)."""
        # Term frequencies are computed once per batch and term, for the document frequency
        # and the scores; a batch without any query term is only counted, never scored.
        out = MemtableTerms(0, 0, dict.fromkeys(terms, 0), [])
        for tier in tiers:
            counted = count_flushed or tier.shard != FLUSHED_TIER
            vocab, batches = self.terms.terms(tier.view.memtable, column, tier.view.batches)
            for i, bt in enumerate(batches):
                eligible = tier.view.live[i]
                live = bt.valid if eligible is None else eligible & bt.valid
                if counted:  # a document counts if it has a token (`fts.BatchTerms.counted`)
                    out.documents += int((live & bt.counted).sum())
                    out.length += int(bt.doc_len[live].sum())
                tfs: dict[str, np.ndarray] = {}
                for t in terms:
                    tid = vocab.get(t)
                    if tid is None:
                        continue
                    tf = fts.term_frequencies(bt, tid)
                    df = int((tf[live] > 0).sum())
                    if df:
                        out.df[t] += df if counted else 0
                        tfs[t] = tf
                if tfs:
                    out.batches.append((tier, i, live, bt, vocab, tfs))
        return out

    def memtable_part(
        self,
        mem: MemtableTerms,
        words: list[tuple[str, int]],
        phrase: bool,
        term_idf: dict[str, float],
        avgdl: float,
        predicate: Predicate | None,
        k: int,
        fetch: list[str],
    ) -> list[pa.Table]:
        """The k best visible rows of the tiers (`fetch` columns and `_score`) by BM25 with
        the given corpus statistics."""
        candidates: list[Candidates] = []
        for tier, i, live, bt, vocab, tfs in mem.batches:
            scored = self._scored(tier, i, live, bt, vocab, tfs, words, phrase, term_idf, avgdl)
            if scored is None:
                continue
            found = self._best_visible(tier, i, *scored, predicate, k)
            if found is not None:
                candidates.append(found)
        return materialise(candidates, k, fetch, SCORE, ascending=False)

    def owner_part(
        self,
        mem: MemtableTerms,
        terms: list[str],
        words: list[tuple[str, int]],
        phrase: bool,
        term_idf: dict[str, float],
        avgdl: float,
        predicate: Predicate | None,
        k: int,
        fetch: list[str],
    ) -> tuple[pa.Table, list[list[int]]]:
        """An owner pod's answer to a fan-out text query (`engine.reads.fresh`): its k best
        visible rows by BM25 with the given statistics (the coordinator's estimate or its
        exact statistics), each with its term frequencies (`bm25.TERM_FREQUENCIES`, in `terms`
        order) and length (`bm25.DOC_LENGTH`), so the coordinator scores them with the exact
        statistics; and the frontier of the rows not returned (`bm25.frontier`), so it knows the
        best score any of them can have."""
        candidates: list[Candidates] = []
        qualifying: list[tuple[Candidates | None, np.ndarray, fts.BatchTerms, dict[str, Any]]] = []
        for tier, i, live, bt, vocab, tfs in mem.batches:
            scored = self._scored(tier, i, live, bt, vocab, tfs, words, phrase, term_idf, avgdl)
            if scored is None:
                continue
            score, mask = scored
            if predicate is not None and mask.any():
                mask = mask & tier.matched(predicate, i)
            found = self._best_visible(tier, i, score, mask, None, k)
            if found is not None:
                candidates.append(found)
            qualifying.append((found, mask, bt, tfs))
        fields = [self.spec.table_schema.field(c) for c in fetch]
        schema = pa.schema(
            [
                *fields,
                pa.field(SCORE, pa.float32()),
                pa.field(bm25.TERM_FREQUENCIES, pa.list_(pa.int32(), len(terms))),
                pa.field(bm25.DOC_LENGTH, pa.int32()),
            ]
        )
        tables = []
        returned: dict[int, np.ndarray] = {}
        terms_of = {id(q[0]): (q[2], q[3]) for q in qualifying if q[0] is not None}
        for cand, mine in select(candidates, k, ascending=False):
            rows = cand.rows[mine]
            returned[id(cand)] = rows
            bt, tfs = terms_of[id(cand)]
            tf = bm25.tf_matrix(tfs, terms, rows, len(bt.doc_len))
            table = cand.tier.take(cand.batch, rows, fetch)
            table = table.append_column(SCORE, pa.array(cand.values[mine], pa.float32()))
            flat = pa.array(tf.reshape(-1), pa.int32())
            table = table.append_column(
                bm25.TERM_FREQUENCIES, pa.FixedSizeListArray.from_arrays(flat, len(terms))
            )
            table = table.append_column(bm25.DOC_LENGTH, pa.array(bt.doc_len[rows], pa.int32()))
            tables.append(table)  # `take` gives the table schema's fields: `schema` already
        signatures = []
        for found, mask, bt, tfs in qualifying:
            if found is not None and id(found) in returned:
                mask[returned[id(found)]] = False
            rows = np.flatnonzero(mask)
            if len(rows):
                tf = bm25.tf_matrix(tfs, terms, rows, len(bt.doc_len))
                signatures.append(np.column_stack([tf, bt.doc_len[rows]]))
        table = pa.concat_tables(tables) if tables else schema.empty_table()
        best = bm25.frontier(np.concatenate(signatures)) if signatures else np.empty((0, 0))
        return table, best.astype(np.int64).tolist()

    def _merge_remote(
        self,
        snap: Snapshot,
        remote: RemoteTier,
        parts: list[pa.Table],
        answers: list[RemoteAnswer],
        exact: dict[str, Any],
        k: int,
    ) -> pa.Table:
        """The top k of this process's `parts` and the owner pods' `answers` (ranked by an
        estimate of the statistics), scored with the exact statistics (`exact`); an owner
        whose rows not returned might beat the k-th (its frontier's best score is above
        it) is asked again with the exact statistics. See `REMOTE_CANDIDATES`."""
        terms: list[str] = exact["terms"]
        idf: dict[str, float] = exact["idf"]
        avgdl: float = exact["avgdl"]

        def merged(by_owner: dict[str, RemoteAnswer]) -> pa.Table:
            rescored = [
                replace(a, table=bm25.rescore(a.table, terms, idf, avgdl))
                for a in by_owner.values()
            ]
            return top([*parts, *snap.remote_rows(rescored)], SCORE, k, ascending=False)

        by_owner = {a.owner: a for a in answers}
        result = merged(by_owner)
        kth = result.column(SCORE)[k - 1].as_py() if result.num_rows >= k else -np.inf
        again = {
            a.owner
            for a in answers
            if bm25.frontier_best(a.meta.get("frontier", []), terms, idf, avgdl) > kth
        }
        if not again:
            return result
        log.debug("fanout_text_second_round", owners=sorted(again))
        for answer in remote.start(exact, only=again).result():
            by_owner[answer.owner] = answer
        return merged(by_owner)

    def hint(
        self,
        column: str,
        terms: list[str],
        n_base: int,
        avgdl_base: float,
        base_df: dict[str, int],
    ) -> tuple[dict[str, float], float]:
        """An estimate of the corpus statistics before the owner pods answer with theirs:
        the base's, plus the memtables' totals as the last fan-out text query on `column`
        found them (a term it did not count: as common in the memtables as in the base)."""
        documents, length, mem_df = self._mem_totals.get(column, (0, 0, {}))
        n = n_base + documents
        avgdl = (avgdl_base * n_base + length) / n if n else 1.0
        share = documents / n_base if n_base else 0.0
        idf = {t: fts.idf(n, base_df[t] + mem_df.get(t, base_df[t] * share)) for t in terms}
        return idf, avgdl

    def _remember(self, column: str, documents: int, length: int, df: dict[str, int]) -> None:
        """Keep a fan-out text query's memtable totals for the next query's `hint`."""
        _, _, known = self._mem_totals.get(column, (0, 0, {}))
        known = {} if len(known) >= HINT_TERMS else dict(known)
        known.update(df)
        self._mem_totals[column] = (documents, length, known)

    def _scored(
        self,
        tier: MemtableTier,
        i: int,
        live: np.ndarray,
        bt: fts.BatchTerms,
        vocab: dict[str, int],
        tfs: dict[str, np.ndarray],
        words: list[tuple[str, int]],
        phrase: bool,
        term_idf: dict[str, float],
        avgdl: float,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """BM25 scores of a batch's rows, and which rows qualify (live, scored, the phrase
        when asked for); None when none can."""
        ids = [vocab.get(t) for t, _ in words]
        if phrase and any(t is None for t in ids):
            return None
        score = np.zeros(len(bt.doc_len), dtype=np.float64)
        for term, tf in tfs.items():  # the query terms some live row of the batch holds
            score += fts.bm25(tf, bt.doc_len, term_idf[term], avgdl)
        mask = live & (score > 0)
        if phrase and mask.any():
            known = [t for t in ids if t is not None]
            mask &= fts.phrase_rows(bt, known, [p - words[0][1] for _, p in words])
        return score, mask

    def _best_visible(
        self,
        tier: MemtableTier,
        i: int,
        score: np.ndarray,
        mask: np.ndarray,
        predicate: Predicate | None,
        k: int,
    ) -> Candidates | None:
        """The k best rows of `mask` that match `predicate` and no newer tier decides."""
        if predicate is not None and mask.any():
            mask = mask & tier.matched(predicate, i)
        rows = np.flatnonzero(mask)
        if not len(rows):
            return None
        want = k
        while True:
            best = rows[np.argsort(-score[rows], kind="stable")[:want]]
            visible = tier.visible(i, best)
            if len(visible) >= min(k, len(best)) or len(best) == len(rows):
                break
            want *= 4
        if not len(visible):
            return None
        return Candidates(tier, i, visible, score[visible].astype(np.float32))

    def _text_base(
        self,
        snap: Snapshot,
        text: str,
        words: list[tuple[str, int]],
        column: str,
        phrase: bool,
        predicate: Predicate | None,
        k: int,
        fetch: list[str],
        indexed_only: bool,
    ) -> pa.Table:
        if snap.base.count_rows() == 0:
            return pa.table({})
        if self.text_index_coverage(snap.base, column) is None:
            if indexed_only:  # the held memtables stand for every row of the base
                return pa.table({})
            scored = unindexed_base_bm25(snap.base, column, words, phrase, predicate, fetch)
            return snap.base_overfetch(k, lambda limit: scored.slice(0, limit))
        query = PhraseQuery(text, column) if phrase else MatchQuery(text, column)

        def fetch_rows(limit: int) -> pa.Table:
            return snap.base.to_table(
                full_text_query=query,
                filter=None if predicate is None else predicate.sql,
                prefilter=True,
                columns=[*fetch, SCORE],
                limit=limit,
                fast_search=indexed_only,
                io_buffer_size=SCAN_IO_BUFFER_BYTES,
                batch_readahead=SCAN_BATCH_READAHEAD,
            )

        return snap.base_overfetch(k, fetch_rows)

    def base_text_stats(
        self, base: lance.LanceDataset, column: str
    ) -> tuple[int, float, int, dict[str, int]]:
        """(documents, average tokens per document, sample size, documents per term in the
        sample) of the base. The sample is its first `AVGDL_SAMPLE_ROWS` documents."""

        def compute() -> tuple[int, float, int, dict[str, int]]:
            # Lance's index counts the documents with at least one token (an empty text, or
            # one of stop words only, is none; checked on this machine): counted in the
            # sample, scaled to the base's non-null texts when the sample is not all of them.
            has_text = pc.field(column).is_valid()
            texts = base.count_rows(filter=has_text)
            if not texts:
                return 0, 0.0, 0, {}
            sample = base.to_table(columns=[column], filter=has_text, limit=AVGDL_SAMPLE_ROWS)
            vocab: dict[str, int] = {}
            batch = fts.batch_terms(sample.column(column), vocab)
            counted = int(batch.counted.sum())
            # Documents per term: each (document, term) pair once, as document * width + term.
            width = max(len(vocab), 1)
            pairs = np.unique(batch.doc.astype(np.int64) * width + batch.term)
            per_id = np.bincount(pairs % width, minlength=len(vocab))
            per_term = {w: int(per_id[i]) for w, i in vocab.items() if per_id[i]}
            avgdl = float(batch.doc_len.sum()) / max(counted, 1)
            exact = sample.num_rows >= texts
            n = counted if exact else round(texts * counted / sample.num_rows)
            return n, avgdl, counted, per_term

        result: tuple[int, float, int, dict[str, int]] = self.ctx.stats.cached(
            base, ("text", column), compute
        )
        return result

    def base_df(self, base: lance.LanceDataset, column: str, term: str) -> int:
        """Base documents containing `term`: exact from the sample when it covers the whole
        base; estimated from the sample for a common term (>= `DF_SAMPLE_MIN_HITS` sample
        documents, so within ~25%); otherwise counted with Lance's FTS (cheap for a rare
        term, whose posting list is short). Cached, see `StatsCache.cached`."""
        n, _, sample_n, sample_df = self.base_text_stats(base, column)
        if not n:
            return 0
        hits = sample_df.get(term, 0)
        if sample_n >= n:
            return hits
        if hits >= DF_SAMPLE_MIN_HITS:
            return round(hits / sample_n * n)
        # While a first count takes longer than DF_WAIT_S: the sample's estimate (half a
        # document for a term the sample lacks).
        estimate = round(max(hits, 0.5) / sample_n * n)

        def compute() -> int:
            query = MatchQuery(term, column)
            covered = self.text_index_coverage(base, column)
            if covered is None:  # Lance's flat count tokenises otherwise: see below
                return unindexed_base_df(base, column, term)
            if covered >= 1.0 or covered < MIN_TEXT_INDEX_COVERAGE:
                return int(base.scanner(full_text_query=query).count_rows())
            # The index lags a flush or two: count on the indexed fragments only and scale
            # to the whole base (Lance's full count scans the unindexed rows flat, once per
            # new term: the text p99 under ingestion).
            indexed = int(base.scanner(full_text_query=query, fast_search=True).count_rows())
            return round(indexed / covered)

        result: int = self.ctx.stats.cached(
            base, ("df", column, term), compute, wait_s=DF_WAIT_S, estimate=estimate
        )
        return result

    def base_df_estimate(self, base: lance.LanceDataset, column: str, term: str) -> int:
        """`base_df` as last counted (at any base version), else estimated from the sample;
        never waits (the estimate a fan-out text query sends the owner pods)."""
        counted = self.ctx.stats.peek(("df", column, term))
        if counted is not None:
            return int(counted)
        n, _, sample_n, sample_df = self.base_text_stats(base, column)
        if not n or not sample_n:
            return 0
        return round(max(sample_df.get(term, 0), 0.5) / sample_n * n)

    def text_index_coverage(self, base: lance.LanceDataset, column: str) -> float | None:
        """Share of the base's rows the INVERTED index on `column` covers (None: no index)."""

        def compute() -> float | None:
            covered = covered_fragments(base, column, text=True)
            if covered is None:
                return None
            rows = indexed = 0
            for fragment in base.get_fragments():
                n = int(fragment.count_rows())
                rows += n
                if int(fragment.fragment_id) in covered:
                    indexed += n
            return indexed / rows if rows else 1.0

        result: float | None = self.ctx.stats.cached(
            base, ("text_index_coverage", column), compute, reuse=False
        )
        return result


def weighted(term_idf: dict[str, float], words: list[tuple[str, int]]) -> dict[str, float]:
    """Each term's IDF times its occurrences among the query's tokens: Lance's index scores
    every query token, so a term the query holds twice (`runs runs`, or `run running`,
    one stem) adds its BM25 twice (checked on this machine). A BM25 term is linear in its
    IDF, so every scorer given these weights (memtable batches, an owner pod's rows, the
    frontier bound, an unindexed base) scores as Lance's index does; the query's terms
    stay distinct."""
    counts = Counter(t for t, _ in words)
    return {t: v * counts[t] for t, v in term_idf.items()}


# -- a base without a text index ----------------------------------------------------------
#
# Lance's full-text search of a dataset with no INVERTED index on the column (before
# maintenance first builds it, or with `maintenance.fts_index = false`) does not tokenise
# as the index does: no lower case, no ASCII folding, no stemming (`run` did not find
# "Running", `cafe` not "café"), and its scores use other lengths. Memtables and an indexed
# base tokenise as the index (`engine.fts`), so the same rows matched differently in the
# two tiers (the score oracle, `tests/reads/test_score_oracle.py`). Such a base is scored
# here instead: its rows tokenised with the index's tokenizer and scored by BM25 over the
# base's own statistics, which is what Lance's index scores with; the same rows and scores
# as once the index is built. Like Lance's flat search it reads the whole base per query;
# the reader does that only when the base is not held (`FlushedText`: tokenised once).
# (Once an index exists, Lance searches the fragments it lacks with the index's tokenizer.)


def _unindexed_batches(base: lance.LanceDataset, columns: list[str]) -> Iterator[pa.RecordBatch]:
    scanner = base.scanner(
        columns=columns,
        io_buffer_size=SCAN_IO_BUFFER_BYTES,
        batch_readahead=SCAN_BATCH_READAHEAD,
    )
    yield from scanner.to_batches()


def unindexed_base_bm25(
    base: lance.LanceDataset,
    column: str,
    words: list[tuple[str, int]],
    phrase: bool,
    predicate: Predicate | None,
    fetch: list[str],
) -> pa.Table:
    """Every row of `base` (no text index on `column`) that matches the query `words` (the
    phrase, with `phrase`) and `predicate`: `fetch` columns and `_score`, best first. BM25
    with the statistics of the base's documents (texts with a token), as `engine.fts` scores
    a memtable batch."""
    terms = list(dict.fromkeys(t for t, _ in words))
    wanted = [*fetch, column, *(sorted(predicate.columns) if predicate is not None else ())]
    vocab: dict[str, int] = {}
    documents = length = 0
    df = dict.fromkeys(terms, 0)
    found: list[tuple[pa.Table, np.ndarray, np.ndarray]] = []
    for batch in _unindexed_batches(base, list(dict.fromkeys(wanted))):
        bt = fts.batch_terms(batch.column(column), vocab)
        documents += int(bt.counted.sum())
        length += int(bt.doc_len.sum())
        tfs = {t: fts.term_frequencies(bt, vocab[t]) for t in terms if t in vocab}
        mask = np.zeros(batch.num_rows, dtype=bool)
        for t, tf in tfs.items():
            df[t] += int((tf > 0).sum())  # a null text has no tokens
            mask |= tf > 0
        if phrase and mask.any():
            ids = [vocab.get(t) for t, _ in words]
            if any(i is None for i in ids):
                mask[:] = False
            else:
                offsets = [p - words[0][1] for _, p in words]
                mask &= fts.phrase_rows(bt, [i for i in ids if i is not None], offsets)
        if predicate is not None and mask.any():
            mask &= predicate.mask(batch)
        rows = np.flatnonzero(mask)
        if len(rows):
            rows_table = pa.Table.from_batches([batch.take(pa.array(rows))]).select(fetch)
            tf = bm25.tf_matrix(tfs, terms, rows, len(bt.doc_len))
            found.append((rows_table, tf, bt.doc_len[rows]))
    schema = pa.schema([*(base.schema.field(c) for c in fetch), pa.field(SCORE, pa.float32())])
    if not found:
        return schema.empty_table()
    avgdl = length / documents
    term_idf = weighted({t: fts.idf(documents, df[t]) for t in terms}, words)
    tables = [
        rows.append_column(SCORE, pa.array(bm25.bm25_rows(tf, dl, terms, term_idf, avgdl)))
        for rows, tf, dl in found
    ]
    merged = pa.concat_tables(tables)
    return merged.take(pc.sort_indices(merged, sort_keys=[(SCORE, "descending")]))


def unindexed_base_df(base: lance.LanceDataset, column: str, term: str) -> int:
    """Documents of `base` (no text index on `column`) holding `term`, tokenised as the
    index tokenises (not by Lance's flat count: see above)."""
    vocab: dict[str, int] = {}
    count = 0
    for batch in _unindexed_batches(base, [column]):
        bt = fts.batch_terms(batch.column(column), vocab)
        if term in vocab:
            count += int((fts.term_frequencies(bt, vocab[term]) > 0).sum())
    return count
