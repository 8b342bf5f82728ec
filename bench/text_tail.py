"""Text queries over the unindexed tail of the base, as another pod (or `lance-sink serve`)
sees it: the fragments the text index lacks searched flat by Lance, against the same
fragments read back and tokenised once by the reader (`engine.unindexed.FlushedText`).

    python -m bench.text_tail [--indexed N] [--tail N] [--fragments F] [--queries Q]

One table: `--indexed` rows flushed and covered by the INVERTED index, then `--tail` rows
appended by another writer in `--fragments` fragments (no handover: this process flushed
none of them). Two readers over it, one process, the same queries:

- ``flat``: `query.unindexed_cache_bytes = 0` (no holder): Lance searches the tail flat,
  re-tokenising it on every query (the yardstick: what every pod did before);
- ``read back``: the default bound; the background loader reads the tail back and
  tokenises it once (the time it takes is printed), then queries score it in memory.

Prints each reader's median and slowest query and the ratio of the medians. The machine is
shared and noisy: read the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import lance
import pyarrow as pa

from engine.reader import Reader, ReaderSettings
from tests.reads.conftest import ReadHarness, rows_batch

WORDS = ["alpha", "bravo delta", "row12345", "golf", "echo charlie"]


def build(root: Path, indexed: int, tail: int, fragments: int) -> ReadHarness:
    h = ReadHarness(root, dim=16)
    w = h.open()
    step = 10_000
    for start in range(0, indexed, step):
        h.put(w, range(start, min(start + step, indexed)))
        h.flush(w)
    h.index_text()
    per = max(1, tail // fragments)
    for start in range(indexed, indexed + tail, per):
        rows = pa.Table.from_batches(
            [rows_batch(h.spec, list(range(start, min(start + per, indexed + tail))))]
        )
        table = rows.select(h.spec.table_schema.names).cast(h.spec.table_schema)
        lance.write_dataset(table, h.spec.uri, mode="append")
    return h


def timed(reader: Reader, queries: int) -> list[float]:
    out = []
    for i in range(queries):
        started = time.perf_counter()
        reader.search_text(WORDS[i % len(WORDS)], k=10)
        out.append((time.perf_counter() - started) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--indexed", type=int, default=50_000)
    parser.add_argument("--tail", type=int, default=100_000)
    parser.add_argument("--fragments", type=int, default=5)
    parser.add_argument("--queries", type=int, default=25)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lance-sink-text-tail-") as folder:
        h = build(Path(folder), args.indexed, args.tail, args.fragments)
        medians = {}
        try:
            for name, settings in [
                ("flat", ReaderSettings(unindexed_cache_bytes=0)),
                ("read back", None),
            ]:
                reader = Reader(h.spec, h.table, list, settings)
                started = time.perf_counter()
                first = timed(reader, 1)[0]
                holder = reader.flushed_text
                if holder is not None:
                    while holder.loads < args.fragments and time.perf_counter() - started < 300:
                        time.sleep(0.02)
                    took = time.perf_counter() - started
                    print(
                        f"{name}: {holder.loads} fragments read back and tokenised in "
                        f"{took:.2f} s, {holder.nbytes / 2**20:.0f} MiB held"
                    )
                times = timed(reader, args.queries)
                medians[name] = statistics.median(times)
                print(
                    f"{name}: first query {first:.0f} ms, then median {medians[name]:.1f} ms, "
                    f"slowest {max(times):.1f} ms ({args.queries} queries)"
                )
                reader.close()
        finally:
            h.close()
        print(
            f"{args.tail:,} tail rows in {args.fragments} fragments over {args.indexed:,} "
            f"indexed: read back / flat median {medians['read back'] / medians['flat']:.2f}x"
        )


if __name__ == "__main__":
    main()
