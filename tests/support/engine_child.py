"""A shard writer in its own process, for crash tests: puts rows until it is SIGKILLed.

    python -m tests.support.engine_child TABLE_URI WAL_URI START MAX_ROWS [OPTIONS_JSON]

Opens the shard (replaying whatever the previous process left), prints `READY <durable>`,
then puts batches of source offsets START, START+1, ... and prints `ACK <last offset>` as
each put resolves (in order). It never closes: the parent kills it.
"""

from __future__ import annotations

import json
import random
import sys
from collections import deque

from sink.log import configure_logging
from tests.support.engine import Harness, make_batch, source, writer_config


def main() -> None:
    table_uri, wal_uri, start, max_rows = (
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
    options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    configure_logging("warning", "json")  # logs to stderr; stdout carries READY/ACK only
    h = Harness(
        table_uri,
        wal_uri,
        storage_options=options,
        config=writer_config(max_rows=max_rows, interval_s=0.003),
    )
    writer = h.open()
    print(f"READY {writer.durable_offsets.get(('t', 0), -1)}", flush=True)
    rng = random.Random(start)
    offset = start
    in_flight: deque = deque()
    while True:
        n = rng.randint(1, 60)
        in_flight.append(
            (writer.put(make_batch(h.spec, offset, n), source(offset, n)), offset + n - 1)
        )
        offset += n
        while in_flight and (len(in_flight) > 4 or in_flight[0][0].done()):
            future, last = in_flight.popleft()
            future.result(60)
            print(f"ACK {last}", flush=True)


if __name__ == "__main__":
    main()
