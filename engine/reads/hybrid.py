"""The hybrid query kind: a vector search and a text search on ONE snapshot.

Both halves begin on the same snapshot (one base version, one set of memtable views), so
a hybrid query is one query for I18: with fan-out, each owner pod gets ONE request that
carries both halves' first-round requests (`RemoteTier.start_parts`), answered from one
snapshot on the owner; each half then merges its own answers exactly as when it runs
alone (`engine.reads.vector`, `engine.reads.text`, including the text second round when
an owner's frontier bound beats the k-th). An owner that flushed past the base version
(`StaleBase`, from either half) runs the whole hybrid query again on a newer snapshot.

The text half finishes on `beside` (a thread of the caller's) while the calling thread
finishes the vector half: the query takes the longer of the two, not their sum. The two
result lists are fused by the caller (`sink.http`: reciprocal rank fusion).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future

import numpy as np
import pyarrow as pa

from engine.filters import Predicate
from engine.reads.context import ReadContext
from engine.reads.merge import DISTANCE, SCORE
from engine.reads.remote import Asked, FanoutReport
from engine.reads.snapshot import Snapshot
from engine.reads.text import TextSearch
from engine.reads.vector import VectorSearch


class HybridSearch:
    """The hybrid query kind: `search` over one snapshot per call."""

    def __init__(self, ctx: ReadContext, vector: VectorSearch, text: TextSearch) -> None:
        self.ctx = ctx
        self.vector = vector
        self.text = text

    def search(
        self,
        vector: Sequence[float] | np.ndarray,
        text: str,
        *,
        k: int = 10,
        column: str | None = None,
        phrase: bool = False,
        filter: str | Predicate | None = None,  # noqa: A002 - the query language's word
        columns: Sequence[str] | None = None,
        nprobes: int | None = None,
        refine_factor: int | None = None,
        report: FanoutReport | None = None,
        beside: Executor | None = None,
    ) -> tuple[pa.Table, pa.Table]:
        """See `engine.reader.Reader.search_hybrid`."""
        started = time.monotonic()
        predicate = self.ctx.predicate(filter)
        begin_vector, vector_cols = self.vector.prepare(
            vector,
            k=k,
            filter=predicate,
            columns=columns,
            nprobes=nprobes,
            refine_factor=refine_factor,
        )
        begin_text, text_cols = self.text.prepare(
            text, k=k, column=column, phrase=phrase, filter=predicate, columns=columns
        )

        def run(snap: Snapshot) -> tuple[pa.Table, pa.Table]:
            near, best = begin_vector(snap), begin_text(snap)
            asks: list[Asked | None] = [None, None]
            if snap.remote is not None and near.request is not None and best.request is not None:
                asks = [*snap.remote.start_parts([near.request, best.request])]
            text_half: Future[pa.Table] | None = None
            if beside is not None:
                text_half = _submit(beside, best.finish, asks[1])
            try:
                nearest = near.finish(asks[0])
                scored = best.finish(asks[1]) if text_half is None else text_half.result()
            finally:
                if text_half is not None:
                    text_half.cancel()  # the vector half failed: not needed (if queued)
            return nearest, scored

        nearest, scored = self.ctx.run(run, report)
        return (
            self.ctx.finish("vector", started, [nearest], vector_cols, DISTANCE),
            self.ctx.finish("text", started, [scored], text_cols, SCORE),
        )


def _submit(
    pool: Executor, fn: Callable[[Asked | None], pa.Table], ask: Asked | None
) -> Future[pa.Table] | None:
    """`fn(ask)` on `pool`; None when the pool is shut down (the caller runs it inline)."""
    try:
        return pool.submit(fn, ask)
    except RuntimeError:
        return None
