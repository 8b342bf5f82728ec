"""Tokenising memtable text: `engine.fts.batch_terms` against Lance's tokenizer per document.

    python -m bench.tokenize [--rows 20000] [--words 30] [--repeat 5] [--out FILE]

Every text query meets memtable batches (and, before a column's first text index, read-back
base fragments) that must be tokenised exactly as Lance's INVERTED index tokenises each
document (`engine.fts`). One process, the same batch of ASCII documents (words of
bench.engine, punctuation between some), best of `--repeat`, microseconds per row:

- ``lance.tokenize``: Lance's tokenizer called per document (the yardstick);
- ``batch_terms``: the sink's tokenising of the whole batch (term ids, documents,
  positions), the word cache cleared before each run (the first batch's cost);
- ``split: regex`` / ``split: _ascii_words``: the word split alone, by Arrow's regex kernel
  on ``[^A-Za-z0-9]+`` and by the byte table plus whitespace split that replaced it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench.engine import WORDS
from engine import fts


def documents(rows: int, words: int, seed: int = 0) -> pa.Array:
    rng = np.random.default_rng(seed)
    glue = np.array([" ", " ", " ", ", ", ". ", " - "])
    out = []
    for _ in range(rows):
        picked = rng.choice(WORDS, words)
        seps = rng.choice(glue, words)
        out.append("".join(f"{w}{s}" for w, s in zip(picked, seps, strict=True)).strip())
    return pa.array(out, pa.string())


def best_us(fn: Callable[[], object], rows: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1e6 / rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--words", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    column = documents(args.rows, args.words)
    texts = column.to_pylist()

    def batch_terms() -> None:
        fts._WORD_TOKENS.clear()
        fts.batch_terms(column, {})

    runs = {
        "lance.tokenize": lambda: [lance.tokenize(t) for t in texts],
        "batch_terms": batch_terms,
        "split: regex": lambda: pc.split_pattern_regex(column, "[^A-Za-z0-9]+"),
        "split: _ascii_words": lambda: fts._ascii_words(column),
    }
    lines = [
        f"python -m bench.tokenize --rows {args.rows} --words {args.words} --repeat {args.repeat}"
    ]
    us = {name: best_us(fn, args.rows, args.repeat) for name, fn in runs.items()}
    for name, value in us.items():
        lines.append(f"  {name:<22} {value:7.2f} us a row")
    lines.append(
        f"  batch_terms / lance.tokenize: {us['batch_terms'] / us['lance.tokenize']:.2f}x; "
        f"split _ascii_words / regex: {us['split: _ascii_words'] / us['split: regex']:.2f}x"
    )
    print("\n".join(lines))
    if args.out is not None:
        with args.out.open("a") as out:
            out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
