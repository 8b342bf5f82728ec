"""A memtable batch is tokenised as Lance tokenises each of its documents alone.

`engine.fts.batch_terms` splits ASCII documents into words with Arrow and tokenises only
their distinct words; the others go through one joined `lance.tokenize` call. Whatever the
mix, every document's terms and positions must be those of `fts.tokenize(document)`, the
tokens Lance's INVERTED index makes of it (BM25 statistics and phrase matches rest on it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import fts

#: Words that test the filters: stop words, stems, digits, a word past the 40-character
#: limit and one at it, the batch separator itself, mixed case.
WORDS = [
    "the",
    "and",
    "of",
    "running",
    "Runs",
    "CATS",
    "row2100",
    "42",
    "x" * 39,
    "y" * 40,
    "z" * 41,
    fts._SEPARATOR,
    "a",
    "I",
]
#: Separators and characters outside ASCII: punctuation, accented and folded letters, a
#: combining mark, CJK, an emoji, an underscore (no letter to Lance), digits of other scripts.
GLUE = [
    " ",
    "  ",
    ", ",
    ".",
    "-",
    "_",
    "'",
    "\n",
    "\t",
    "!?",
    "é",
    "Ç",
    "ß",
    "\u0301",
    "日本",
    "🙂",
    "٣",
]


def _documents() -> st.SearchStrategy[str | None]:
    piece = st.one_of(st.sampled_from(WORDS), st.sampled_from(GLUE), st.text(max_size=6))
    return st.one_of(st.none(), st.lists(piece, max_size=12).map("".join))


def _as_tokenised_alone(
    batch: fts.BatchTerms, vocab: dict[str, int], texts: list[str | None]
) -> None:
    words = {i: w for w, i in vocab.items()}
    assert batch.valid.tolist() == [t is not None for t in texts]
    assert np.all(np.diff(batch.doc) >= 0), "tokens are in document order"
    for row, text in enumerate(texts):
        mine = batch.doc == row
        alone = fts.tokenize(text or "")
        assert [
            (words[int(t)], int(p)) for t, p in zip(batch.term[mine], batch.pos[mine], strict=True)
        ] == alone, text
        assert batch.doc_len[row] == len(alone)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(_documents(), max_size=8), min_size=1, max_size=3))
def test_every_document_is_tokenised_as_alone(batches: list[list[str | None]]) -> None:
    """Batches of generated documents (ASCII, not ASCII, null, empty, stop words only),
    one vocabulary across them as a memtable keeps it, words cached across batches."""
    vocab: dict[str, int] = {}
    for texts in batches:
        _as_tokenised_alone(fts.batch_terms(pa.array(texts, pa.string()), vocab), vocab, texts)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_mixed_batch_keeps_each_documents_positions(chunked: bool) -> None:
    """ASCII and other documents interleaved (two tokenizer paths merged back into row
    order), each document's positions counted from its own first token (a document that
    starts with a stop word too), in a chunked column as a Lance scan gives it."""
    texts: list[str | None] = [
        "The quick brown foxes were running",
        "Élan naïve CAFÉ café and the dogs",
        None,
        "the the cats, running dogs!",
        "",
        "日本 cats 🙂 dogs",
        "of and the",
        "row2100 jumped over row12",
    ]
    column = pa.chunked_array([texts[:3], texts[3:]], pa.string()) if chunked else pa.array(texts)
    vocab: dict[str, int] = {}
    _as_tokenised_alone(fts.batch_terms(column, vocab), vocab, texts)


def test_the_word_cache_starts_again_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """The distinct-word cache is bounded: past `WORD_CACHE_MAX` it empties and goes on,
    and words already seen come out the same."""
    monkeypatch.setattr(fts, "WORD_CACHE_MAX", 5)
    monkeypatch.setattr(fts, "_WORD_TOKENS", {})
    texts: list[str | None] = [f"alpha{i} running beta{i} the" for i in range(20)]
    vocab: dict[str, int] = {}
    first = fts.batch_terms(pa.array(texts), vocab)
    assert len(fts._WORD_TOKENS) <= 5
    again = fts.batch_terms(pa.array(texts), vocab)
    assert first.term.tolist() == again.term.tolist()
    _as_tokenised_alone(again, vocab, texts)


def test_a_tokenizer_that_is_not_word_by_word_takes_the_joined_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If a word ever made more than one token (a tokenizer other than Lance's default), the
    batch is tokenised by the joined call instead: the same tokens as each document alone."""
    monkeypatch.setattr(fts, "_WORD_TOKENS", {})
    real = fts.lance.tokenize

    def splitting(text: str) -> Any:
        tokens = real(text)
        if text.startswith(fts._SEPARATOR + " "):  # the distinct words' call
            return [*tokens, *tokens[1:]]  # positions repeat: a word made two tokens
        return tokens

    monkeypatch.setattr(fts.lance, "tokenize", splitting)
    texts: list[str | None] = ["The quick brown foxes", "Élan and the dogs", None, "cats, dogs!"]
    vocab: dict[str, int] = {}
    _as_tokenised_alone(fts.batch_terms(pa.array(texts), vocab), vocab, texts)
    ascii_only: list[str | None] = ["The quick brown foxes", "cats, dogs!"]
    _as_tokenised_alone(fts.batch_terms(pa.array(ascii_only), vocab), vocab, ascii_only)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.text(st.characters(max_codepoint=127), max_size=12), max_size=8),
    st.integers(0, 3),
    st.sampled_from([pa.string(), pa.large_string()]),
)
def test_ascii_words_are_the_runs_of_letters_and_digits(
    texts: list[str], cut: int, kind: pa.DataType
) -> None:
    """`_ascii_words` (a byte table, then Arrow's whitespace split) gives exactly the regex
    split on ``[^A-Za-z0-9]+`` it replaced, for any ASCII byte (control characters, DEL,
    whitespace other than spaces), in an array that is a slice of a larger one (an offset
    into its buffers) and in a large_string column."""
    padded = ["pad one", *texts, "pad-two"]
    column = pa.array(padded, kind).slice(1, len(texts))
    expected = pc.split_pattern_regex(column, "[^A-Za-z0-9]+").to_pylist()
    assert fts._ascii_words(column).to_pylist() == expected
    rows = column.slice(min(cut, len(texts)))
    vocab: dict[str, int] = {}
    _as_tokenised_alone(fts.batch_terms(rows, vocab), vocab, rows.to_pylist())
