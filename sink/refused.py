"""Rows the table refuses: the messages behind them become dead letters, the rest is put.

The decoder checks every row as the table does (`engine.schema.TableSpec.validate`), so
`ShardWriter.put` refusing a decoded batch (`InvalidRecord`) means the two disagree on a
value: a bug, but one message's, not the partition's. The consumer loop's pipeline
(`sink.consumer.pipeline.Pipeline._put`) calls `split_refused` with the refusal: the refused
rows are found by validating what is left again, row by row as the table names them (one
validation per refused row, none per good one), and each becomes a ``rejected_by_table``
dead letter of the message it was decoded from; the other rows are put as they were, once
the dead letters are acknowledged. A refusal that names no row (the batch's schema) refuses
every row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa

from engine.errors import InvalidRecord
from sink.decoded import DeadLetter, Decoded, MessageLike, dead_letter

__all__ = ["split_refused"]


def split_refused(
    decoded: Decoded,
    messages: Sequence[MessageLike],
    refusal: InvalidRecord,
    validate: Callable[[pa.RecordBatch], object],
) -> tuple[Decoded, list[DeadLetter]]:
    """`decoded` without the rows the table refuses, and their dead letters.

    Args:
        decoded: the batch `messages` decoded to, which `ShardWriter.put` refused.
        messages: the messages it was decoded from, in offset order.
        refusal: what `put` raised.
        validate: the table's check of a batch (`TableSpec.validate`), raising
            `InvalidRecord` as `put` does.

    Returns:
        The decoded batch of the rows left (its dead letters now including the new ones,
        in offset order) and the new dead letters alone (to be sent).
    """
    batch = decoded.batch
    assert batch is not None
    rowless = {d.offset for d in decoded.dead_letters} | set(decoded.skipped_offsets)
    sources = [m for m in messages if int(m.offset() or 0) not in rowless]
    letters: list[DeadLetter] = []
    keep = np.ones(batch.num_rows, bool)
    error: InvalidRecord | None = refusal
    if len(sources) != batch.num_rows:  # not expected: then no row can be told apart
        error = InvalidRecord(f"{refusal} (rows and messages do not match up)")
    while error is not None:
        rows = np.flatnonzero(keep)
        if error.row is None or not 0 <= error.row < len(rows):
            letters += [_refused(sources[i], str(error)) for i in rows.tolist()]
            keep[:] = False
            break
        row = int(rows[error.row])
        keep[row] = False
        letters.append(_refused(sources[row], str(error)))
        left = np.flatnonzero(keep)
        if not len(left):
            break
        try:
            validate(batch.take(pa.array(left)))
        except InvalidRecord as again:
            error = again
        else:
            error = None
    left = np.flatnonzero(keep)
    rest = batch.take(pa.array(left)) if len(left) else None
    dead = sorted([*decoded.dead_letters, *letters], key=lambda d: d.offset)
    kept = dataclasses.replace(decoded, batch=rest, dead_letters=dead)
    return kept, sorted(letters, key=lambda d: d.offset)


def _refused(message: MessageLike, detail: str) -> DeadLetter:
    return dead_letter(message, "rejected_by_table", f"the table refused the row: {detail}")
