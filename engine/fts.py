"""BM25 over memtables, tokenised exactly like Lance's INVERTED index.

The base table's full-text search is Lance's own (an INVERTED index, or Lance's flat search
when there is none). Memtables have no text index on the write path; this module scores
their rows with the same BM25 Lance uses (k1 = 1.2, b = 0.75,
``idf = ln(1 + (N - df + 0.5) / (df + 0.5))``; checked against Lance's ``_score`` on this
machine) and the same tokenizer (`lance.tokenize`: lower-casing, ASCII folding, English
stemming, stop words), so a query term matches the same documents in both tiers.

Tokenising is the expensive part, so it happens once per memtable batch (batches are
immutable once in a memtable) and is cached per memtable in a `WeakKeyDictionary`: the
cache disappears with the memtable after its flush. A batch is tokenised with one
`lance.tokenize` call over all its documents joined by a separator token, and the tokens
become three numpy arrays (term id, document, position), so scoring a query is a few
vectorised passes with no per-row Python.

Cached bytes (token arrays and vocabulary entries) are counted in the memtable's resident
bytes with `Memtable.account_cache` (I7), so they weigh on backpressure like the rows do;
`MemtableTermCache.nbytes` reports the token arrays.

Who tokenises: the reader runs a background tokenizer (`engine.reads.text.TextSearch`)
once it has served a text query, which calls `MemtableTermCache.terms` on every memtable
of its shards as new batches arrive, so a text query finds them tokenised already. A query still
tokenises, inline, whatever the background pass has not reached yet (both go through the
same per-memtable lock, so each batch is tokenised exactly once). Either way only batches of
a `MemtableView` are tokenised: rows that are durable and visible (I2), never more.
"""

from __future__ import annotations

import math
import operator
import threading
import weakref
from dataclasses import dataclass, field

import lance
import numpy as np
import pyarrow as pa

from engine.memtable import Memtable

#: BM25 parameters Lance uses (lance-index `scorer.rs`); the memtable scores must match.
K1 = 1.2
B = 0.75
#: Joins the documents of one batch for a single tokenizer call: a lower-case ASCII word
#: that is no stop word. Its token (after stemming) marks document boundaries; if a
#: document happens to contain it the batch is tokenised document by document instead.
_SEPARATOR = "zqxlancesinkdocsep"


@dataclass(frozen=True, slots=True)
class BatchTerms:
    """The tokens of one batch's text column: parallel arrays, one entry per token."""

    term: np.ndarray  # int32 term id (vocabulary of the memtable)
    doc: np.ndarray  # int32 row within the batch
    pos: np.ndarray  # int32 token position within the document (Lance's positions)
    doc_len: np.ndarray  # int32 tokens per row
    valid: np.ndarray  # bool: the row's text is not null

    @property
    def counted(self) -> np.ndarray:
        """The rows Lance's index counts as documents (its N and average length): those
        with at least one token. An empty text, or one of stop words only, is no document
        (checked on this machine), though it is not null."""
        counted: np.ndarray = self.doc_len > 0
        return counted

    @property
    def nbytes(self) -> int:
        arrays = (self.term, self.doc, self.pos, self.doc_len, self.valid)
        return int(sum(a.nbytes for a in arrays))

    @staticmethod
    def concat(parts: list[BatchTerms]) -> BatchTerms:
        """The tokens of consecutive batches as those of one batch (their rows in order)."""
        rows = np.cumsum([0, *(len(p.doc_len) for p in parts)])
        docs = [p.doc + np.int32(start) for p, start in zip(parts, rows[:-1], strict=True)]
        return BatchTerms(
            term=np.concatenate([p.term for p in parts]),
            doc=np.concatenate(docs),
            pos=np.concatenate([p.pos for p in parts]),
            doc_len=np.concatenate([p.doc_len for p in parts]),
            valid=np.concatenate([p.valid for p in parts]),
        )


@dataclass
class _MemtableTerms:
    vocab: dict[str, int] = field(default_factory=dict)
    batches: list[BatchTerms] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def tokenize(text: str) -> list[tuple[str, int]]:
    """Tokens and positions of `text`, exactly as Lance's default INVERTED index sees it."""
    return [(t.text, int(t.position)) for t in lance.tokenize(text)]


def tokenize_batch(texts: list[str | None]) -> tuple[list[list[str]], list[list[int]]]:
    """Tokens and positions of many documents with one tokenizer call (see module doc)."""
    docs = ["" if t is None else t for t in texts]
    if not docs:
        return [], []
    if not any(_SEPARATOR in d.lower() for d in docs):
        joined = f" {_SEPARATOR} ".join(docs)
        tokens = lance.tokenize(joined)
        marker = separator_token()
        terms: list[list[str]] = [[]]
        positions: list[list[int]] = [[]]
        start = 0
        for tok in tokens:
            if tok.text == marker:
                terms.append([])
                positions.append([])
                start = int(tok.position) + 1
                continue
            terms[-1].append(tok.text)
            positions[-1].append(int(tok.position) - start)
        if len(terms) == len(docs):
            return terms, positions
    pairs = [tokenize(d) for d in docs]
    return [[t for t, _ in p] for p in pairs], [[q for _, q in p] for p in pairs]


def separator_token() -> str:
    """The token Lance's tokenizer makes of the separator word (computed once): it marks
    where one document ends in a batch's joined text, and is no term of any document."""
    global _SEPARATOR_TOKEN  # noqa: PLW0603 - computed once, then read-only
    if _SEPARATOR_TOKEN is None:
        _SEPARATOR_TOKEN = lance.tokenize(_SEPARATOR)[0].text
    return _SEPARATOR_TOKEN


_SEPARATOR_TOKEN: str | None = None


#: CPython bytes per vocabulary entry: a short str (~56), an int (28) and a dict slot (~24).
_VOCAB_ENTRY_BYTES = 108


class MemtableTermCache:
    """Tokenised text columns of memtable batches, cached per memtable (see module doc).

    Thread-safe: concurrent queries may extend the cache of the same memtable; each batch is
    tokenised once.
    """

    def __init__(self) -> None:
        self._cache: weakref.WeakKeyDictionary[Memtable, dict[str, _MemtableTerms]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def terms(
        self, memtable: Memtable, column: str, batches: tuple[pa.RecordBatch, ...]
    ) -> tuple[dict[str, int], list[BatchTerms]]:
        """The vocabulary and the per-batch tokens of `batches` (a prefix of the memtable's
        batches, as a `MemtableView` holds them)."""
        with self._lock:
            per_column = self._cache.setdefault(memtable, {})
            entry = per_column.setdefault(column, _MemtableTerms())
        with entry.lock:
            for batch in batches[len(entry.batches) :]:
                words = len(entry.vocab)
                terms = batch_terms(batch.column(column).to_pylist(), entry.vocab)
                entry.batches.append(terms)
                # Token arrays plus the new vocabulary entries (str key, int value, slot).
                memtable.account_cache(
                    terms.nbytes + (len(entry.vocab) - words) * _VOCAB_ENTRY_BYTES
                )
            return entry.vocab, entry.batches[: len(batches)]

    def hand_over(self, old: Memtable, new: Memtable, columns: tuple[str, ...]) -> None:
        """Give `new`, `old`'s rows as one batch (`Memtable.without_column`), the tokens of
        `old`'s `columns` as that one batch's (tokenising what is left first), accounted to
        `new`: it outlives `old` (`engine.unindexed.FlushedText`)."""
        per_column: dict[str, _MemtableTerms] = {}
        nbytes = 0
        batches = tuple(old.batches)
        for column in columns:
            vocab, parts = self.terms(old, column, batches)
            merged = BatchTerms.concat(parts) if len(parts) != 1 else parts[0]
            per_column[column] = _MemtableTerms(vocab, [merged])
            nbytes += merged.nbytes + len(vocab) * _VOCAB_ENTRY_BYTES
        with self._lock:
            self._cache[new] = per_column
        new.account_cache(nbytes)

    def terms_ready(self, memtable: Memtable, column: str) -> int:
        """How many leading batches of `memtable` have their `column` tokenised."""
        with self._lock:
            entry = self._cache.get(memtable, {}).get(column)
        return 0 if entry is None else len(entry.batches)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached token arrays (vocabularies not included)."""
        with self._lock:
            entries = [e for per in self._cache.values() for e in per.values()]
        return sum(b.nbytes for e in entries for b in e.batches)


def batch_terms(texts: list[str | None], vocab: dict[str, int]) -> BatchTerms:
    """The tokens of one batch as term ids of `vocab` (extended with the batch's new words).

    One tokenizer call over the joined documents; the tokens' words and positions are read
    with `map` and the documents split by numpy, so the Python work per token is three
    C-level calls. `lance.tokenize` holds the GIL, and this runs on the reader's tokenizer
    thread next to the queries: at 15k rows/s of 200-character texts it held the GIL for
    over a third of the time, mostly in a per-token Python loop that is gone."""
    docs = ["" if t is None else t for t in texts]
    valid = np.fromiter((t is not None for t in texts), dtype=bool, count=len(texts))
    if docs and not any(_SEPARATOR in d.lower() for d in docs):
        tokens = lance.tokenize(f" {_SEPARATOR} ".join(docs))
        words = list(map(_TEXT, tokens))
        positions = np.fromiter(map(_POSITION, tokens), dtype=np.int64, count=len(tokens))
        marker = vocab.setdefault(separator_token(), len(vocab))
        ids = np.fromiter(
            (vocab.setdefault(w, len(vocab)) for w in words), dtype=np.int64, count=len(words)
        )
        marks = ids == marker
        if int(marks.sum()) == len(docs) - 1:
            doc = np.cumsum(marks)
            # A document's positions count from the token after its separator.
            starts = np.concatenate([[0], positions[marks] + 1])
            keep = ~marks
            doc = doc[keep]
            return BatchTerms(
                term=ids[keep].astype(np.int32),
                doc=doc.astype(np.int32),
                pos=(positions[keep] - starts[doc]).astype(np.int32),
                doc_len=np.bincount(doc, minlength=len(docs)).astype(np.int32),
                valid=valid,
            )
    terms, positions_of = tokenize_batch(texts)
    lengths = np.fromiter((len(t) for t in terms), dtype=np.int32, count=len(terms))
    total = int(lengths.sum())
    flat = [vocab.setdefault(t, len(vocab)) for doc in terms for t in doc]
    return BatchTerms(
        term=np.asarray(flat, dtype=np.int32).reshape(total),
        doc=np.repeat(np.arange(len(terms), dtype=np.int32), lengths),
        pos=np.asarray([p for doc in positions_of for p in doc], dtype=np.int32).reshape(total),
        doc_len=lengths,
        valid=valid,
    )


_TEXT = operator.attrgetter("text")
_POSITION = operator.attrgetter("position")


def idf(n_docs: float, df: float) -> float:
    """Lance's BM25 inverse document frequency."""
    return math.log(1.0 + (n_docs - df + 0.5) / (df + 0.5))


def term_frequencies(batch: BatchTerms, term_id: int) -> np.ndarray:
    """Occurrences of one term per row of the batch (int32, length = rows)."""
    docs = batch.doc[batch.term == term_id]
    return np.bincount(docs, minlength=len(batch.doc_len)).astype(np.int32)


def phrase_rows(batch: BatchTerms, term_ids: list[int], offsets: list[int]) -> np.ndarray:
    """Rows containing the terms at the given relative positions (a phrase), as a bool mask."""
    rows = len(batch.doc_len)
    first = batch.term == term_ids[0]
    keys = batch.doc[first].astype(np.int64) << 32 | batch.pos[first].astype(np.int64)
    for term_id, offset in zip(term_ids[1:], offsets[1:], strict=True):
        sel = batch.term == term_id
        have = batch.doc[sel].astype(np.int64) << 32 | batch.pos[sel].astype(np.int64)
        keys = keys[np.isin(keys + offset, have)]
        if not len(keys):
            break
    mask = np.zeros(rows, dtype=bool)
    mask[(keys >> 32).astype(np.int64)] = True
    return mask


def bm25(tf: np.ndarray, doc_len: np.ndarray, term_idf: float, avgdl: float) -> np.ndarray:
    """BM25 contribution of one term for every row (0 where tf = 0)."""
    tf = tf.astype(np.float64)
    norm = K1 * (1.0 - B + B * doc_len.astype(np.float64) / max(avgdl, 1e-9))
    with np.errstate(invalid="ignore", divide="ignore"):
        score = term_idf * tf * (K1 + 1.0) / (tf + norm)
    return np.where(tf > 0, score, 0.0)
