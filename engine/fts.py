"""BM25 over memtables, tokenised exactly like Lance's INVERTED index.

The base table's full-text search is Lance's own (an INVERTED index, or Lance's flat search
when there is none). Memtables have no text index on the write path; this module scores
their rows with the same BM25 Lance uses (k1 = 1.2, b = 0.75,
``idf = ln(1 + (N - df + 0.5) / (df + 0.5))``; checked against Lance's ``_score`` on this
machine) and the same tokenizer (`lance.tokenize`: lower-casing, ASCII folding, English
stemming, stop words), so a query term matches the same documents in both tiers.

Tokenising is the expensive part, so it happens once per memtable batch (batches are
immutable once in a memtable) and is cached per memtable in a `WeakKeyDictionary`: the
cache disappears with the memtable after its flush. A batch's ASCII documents are split
into words outside the interpreter lock (a byte table, then Arrow) and only its distinct
words are tokenised by Lance (cached across batches); the others take one `lance.tokenize`
call over them joined by a separator token (`batch_terms`). The tokens become three numpy
arrays (term id, document, position), so scoring a query is a few vectorised passes with
no per-row Python.

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
import string
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

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


def tokenize_batch(texts: Sequence[str | None]) -> tuple[list[list[str]], list[list[int]]]:
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
                terms = batch_terms(batch.column(column), entry.vocab)
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


def batch_terms(
    texts: pa.Array | pa.ChunkedArray | list[str | None], vocab: dict[str, int]
) -> BatchTerms:
    """The tokens of one batch as term ids of `vocab` (extended with the batch's new words),
    each document's exactly as `tokenize` gives them alone (terms and positions).

    Lance's tokenizer (tantivy's simple tokenizer, then per-token filters: length limit,
    lower-casing, stop words, stemming, ASCII folding) makes each maximal run of
    alphanumeric characters into at most one token, whatever surrounds it. On ASCII text
    those runs are ``[A-Za-z0-9]+``, so the ASCII documents are split into words over the
    whole column outside the interpreter lock (`_ascii_words`), and only the
    batch's distinct words go through `lance.tokenize` (`word_tokens`, cached across
    batches). The other documents take one tokenizer call over them joined by a separator
    (`_joined_terms`). Measured on 20k rows of 30 words: 25 us a row before (all of it
    under the interpreter lock, a third `lance.tokenize`'s token objects), ~6 us with a
    regex kernel splitting the words (~5 us of it, without the lock), ~2 us since."""
    column = _text_array(texts)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    filled = pc.fill_null(column, "")
    ascii_rows = pc.string_is_ascii(filled).to_numpy(zero_copy_only=False)
    try:
        if ascii_rows.all():
            return _finish(*_ascii_terms(filled, vocab), len(column), valid)
    except _NotWordwise:
        ascii_rows = np.zeros_like(ascii_rows)  # every document by the joined call
    other = np.flatnonzero(~ascii_rows)
    rest_term, rest_doc, rest_pos = _joined_terms(filled.take(pa.array(other)).to_pylist(), vocab)
    if not ascii_rows.any():
        return _finish(rest_term, other[rest_doc], rest_pos, len(column), valid)
    rows = np.flatnonzero(ascii_rows)
    try:
        term, doc, pos = _ascii_terms(filled.take(pa.array(rows)), vocab)
    except _NotWordwise:
        term, doc, pos = _joined_terms(filled.take(pa.array(rows)).to_pylist(), vocab)
    doc = np.concatenate([rows[doc], other[rest_doc]])
    order = np.argsort(doc, kind="stable")  # by document, each one's tokens in order
    term = np.concatenate([term, rest_term])[order]
    pos = np.concatenate([pos, rest_pos])[order]
    return _finish(term, doc[order], pos, len(column), valid)


#: Each ASCII byte as `_ascii_words` splits on it: letters and digits stay (Rust's
#: `char::is_alphanumeric` on ASCII, what Lance's simple tokenizer keeps), every other
#: byte becomes a space.
_WORD_BYTES = np.full(256, ord(" "), np.uint8)
_ALNUM = np.frombuffer((string.ascii_letters + string.digits).encode(), np.uint8)
_WORD_BYTES[_ALNUM] = _ALNUM
#: Distinct words whose token `word_tokens` remembers (~150 bytes each), across batches
#: and threads; over this many it starts again empty.
WORD_CACHE_MAX = 200_000
_WORD_TOKENS: dict[str, str | None] = {}
#: Term ids, documents and positions of a batch's tokens (int64, one entry per token).
_Tokens = tuple[np.ndarray, np.ndarray, np.ndarray]


def _text_array(texts: pa.Array | pa.ChunkedArray | list[str | None]) -> pa.Array:
    if isinstance(texts, list):
        return pa.array(texts, pa.string())
    if isinstance(texts, pa.ChunkedArray):
        return texts.combine_chunks() if texts.num_chunks != 1 else texts.chunk(0)
    return texts


def _ascii_terms(column: pa.Array, vocab: dict[str, int]) -> _Tokens:
    """Term ids, documents and positions (the word's index in its document) of ASCII
    documents with no nulls, in document order."""
    split = _ascii_words(column)
    lengths = pc.list_value_length(split).to_numpy(zero_copy_only=False).astype(np.int64)
    encoded = pc.dictionary_encode(pc.list_flatten(split))
    tokens = word_tokens(encoded.dictionary.to_pylist())
    ids = np.fromiter(
        (-1 if t is None else vocab.setdefault(t, len(vocab)) for t in tokens),
        dtype=np.int64,
        count=len(tokens),
    )
    term = ids[encoded.indices.to_numpy(zero_copy_only=False)]
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    starts = np.cumsum(lengths) - lengths
    pos = np.arange(len(term), dtype=np.int64) - starts[doc]
    kept = term >= 0
    return term[kept], doc[kept], pos[kept]


def _ascii_words(column: pa.Array) -> pa.ListArray:
    """Each ASCII document (no nulls) as its runs of ``[A-Za-z0-9]`` (and "" before a leading
    and after a trailing separator), as `pc.split_pattern_regex(column, "[^A-Za-z0-9]+")`
    gives them, 4x faster: the other bytes become spaces through one table lookup (numpy,
    outside the interpreter lock), then Arrow splits on whitespace runs (3.6 us a row of
    30 words by the regex kernel, 0.8 us so)."""
    _, offsets, data = column.buffers()
    if data is None or len(column) == 0:
        return pc.ascii_split_whitespace(column)
    width = np.int64 if pa.types.is_large_string(column.type) else np.int32
    bounds = np.frombuffer(offsets, width)[column.offset : column.offset + len(column) + 1]
    first, last = int(bounds[0]), int(bounds[-1])
    spaced = np.take(_WORD_BYTES, np.frombuffer(data, np.uint8)[first:last])
    words = pa.Array.from_buffers(
        column.type,
        len(column),
        [None, pa.py_buffer(bounds - first), pa.py_buffer(spaced)],
        null_count=0,
    )
    return pc.ascii_split_whitespace(words)


def word_tokens(words: list[str]) -> list[str | None]:
    """The token of each word (a run of ASCII letters and digits, or ""), or None where
    Lance's filters drop it (a stop word, too long, empty). The words not cached yet are
    tokenised by one `lance.tokenize` call after an anchor word that always stays (the
    separator), so the token at position i + 1 is the i-th word's.

    Raises:
        _NotWordwise: a word made more than one token (then `batch_terms` takes the joined
            call for the batch).
    """
    found = [_WORD_TOKENS.get(w, _UNSEEN) if w else None for w in words]
    unseen = list(dict.fromkeys(w for w, t in zip(words, found, strict=True) if t is _UNSEEN))
    if not unseen:
        return found  # type: ignore[return-value]
    tokens = lance.tokenize(f"{_SEPARATOR} {' '.join(unseen)}")
    if not tokens or tokens[0].text != separator_token() or int(tokens[0].position) != 0:
        raise _NotWordwise
    at = {int(t.position): t.text for t in tokens[1:]}
    if len(at) != len(tokens) - 1 or not all(1 <= p <= len(unseen) for p in at):
        raise _NotWordwise  # a tokenizer that is not Lance's default: not word by word
    learned = {w: at.get(i + 1) for i, w in enumerate(unseen)}
    if len(_WORD_TOKENS) + len(learned) > WORD_CACHE_MAX:
        _WORD_TOKENS.clear()
    if len(learned) <= WORD_CACHE_MAX:
        _WORD_TOKENS.update(learned)
    return [learned[w] if t is _UNSEEN else t for w, t in zip(words, found, strict=True)]  # type: ignore[misc]


_UNSEEN = object()


class _NotWordwise(Exception):
    """The tokenizer did not make each word into at most one token (`word_tokens`)."""


def _joined_terms(docs: list[str], vocab: dict[str, int]) -> _Tokens:
    """Term ids, documents and positions of `docs` (no nulls) by one `lance.tokenize` call
    over them joined by the separator (document by document when one holds it)."""
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
            kept = ~marks
            return ids[kept], doc[kept], positions[kept]
    terms, positions_of = tokenize_batch(docs)
    lengths = np.fromiter((len(t) for t in terms), dtype=np.int64, count=len(terms))
    flat = [vocab.setdefault(t, len(vocab)) for doc in terms for t in doc]
    return (
        np.asarray(flat, dtype=np.int64),
        np.repeat(np.arange(len(terms), dtype=np.int64), lengths),
        np.asarray([p for doc in positions_of for p in doc], dtype=np.int64),
    )


def _finish(
    term: np.ndarray, doc: np.ndarray, pos: np.ndarray, rows: int, valid: np.ndarray
) -> BatchTerms:
    """`BatchTerms` of tokens in document order, each document's positions counted from
    its first token (as `tokenize` counts them for the document alone)."""
    doc_len = np.bincount(doc, minlength=rows)
    first = np.cumsum(doc_len) - doc_len  # the index of each document's first token
    return BatchTerms(
        term=term.astype(np.int32),
        doc=doc.astype(np.int32),
        pos=(pos - pos[first[doc]]).astype(np.int32),
        doc_len=doc_len.astype(np.int32),
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
