"""`engine.reads.trace`: a query thread's stages, timed only inside `traced`."""

from __future__ import annotations

import contextlib
import threading
import time

from engine.reads.trace import stage, traced


def test_stages_add_up_nest_and_stay_on_their_thread() -> None:
    elsewhere: list[bool] = []

    def other_thread() -> None:
        with stage("other"):  # not traced: another thread
            elsewhere.append(True)

    with traced() as spent:
        for _ in range(2):
            with stage("outer"):
                time.sleep(0.02)
                with stage("inner"):
                    time.sleep(0.01)
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert elsewhere == [True]
    assert set(spent.stages) == {"outer", "inner"}
    assert spent.stages["inner"] >= 0.02  # entered twice: added up
    assert spent.stages["outer"] >= 0.06  # includes its inner stage
    assert spent.seconds >= spent.stages["outer"]
    assert list(spent.summary()) == ["outer", "inner"]  # the largest first, in ms
    assert spent.summary()["outer"] == round(spent.stages["outer"] * 1000, 1)


def test_a_stage_outside_a_trace_records_nothing_and_a_trace_ends_with_its_block() -> None:
    with stage("alone"):
        pass
    with traced() as first:
        pass
    with stage("after"):
        pass
    assert first.stages == {}


def test_a_stage_that_raises_is_still_counted() -> None:
    def fail() -> None:
        with stage("failing"):
            raise ValueError("x")

    with traced() as spent, contextlib.suppress(ValueError):
        fail()
    assert "failing" in spent.stages
