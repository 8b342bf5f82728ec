"""`sink.query_share.QueryShare`: how long the consumer loop pauses while queries run, and
the query pools that count their running work into it."""

from __future__ import annotations

import asyncio
import threading

import pyarrow as pa
import pytest

from sink.http.errors import HttpError
from sink.http.pool import QueryPool
from sink.query_share import MAX_PAUSE_S, QueryShare


def test_nothing_pauses_while_no_query_runs() -> None:
    share = QueryShare(0.5)
    assert share.pause_after(0.1) == 0.0


def test_a_running_query_bounds_ingestion_to_its_share_of_the_loop() -> None:
    share = QueryShare(0.25)
    share.enter()
    # Busy 30 ms at a 25% share: 90 ms of pause, so ingestion had 30 of 120 ms.
    assert share.pause_after(0.03) == pytest.approx(0.09)
    assert share.pause_after(0.0) == 0.0  # an idle iteration owes nothing
    assert share.pause_after(10.0) == MAX_PAUSE_S  # the loop still ticks between pauses
    share.leave()
    assert share.pause_after(0.03) == 0.0


def test_a_whole_share_never_pauses() -> None:
    share = QueryShare(1.0)
    share.enter()
    assert share.pause_after(1.0) == 0.0


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_a_share_outside_zero_to_one_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="share"):
        QueryShare(bad)


def test_the_pools_count_running_work_abandoned_work_included() -> None:
    share = QueryShare(0.5)
    pool = QueryPool(1, share)
    release = threading.Event()

    def slow() -> pa.Table:
        release.wait(10)
        return pa.table({"x": [1]})

    async def scenario() -> None:
        future, task = pool.submit(slow)
        assert share.running == 1
        pool.abandon(task)  # its request timed out: the work still runs, and still counts
        assert share.running == 1
        second, _ = pool.submit(lambda: pa.table({"x": [2]}))  # the freed slot
        await second
        assert share.running == 1
        release.set()
        await future
        assert share.running == 0
        refused = QueryPool(1, share)
        hold = threading.Event()
        first, _ = refused.submit(lambda: pa.table({"x": [hold.wait(10)]}))
        with pytest.raises(HttpError):
            refused.submit(slow)  # a 503 never counts in
        assert share.running == 1
        hold.set()
        await first
        refused.shutdown()
        assert share.running == 0

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        pool.shutdown()
