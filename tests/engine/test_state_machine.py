"""A Hypothesis state machine over put / seal / flush / crash / reopen.

The source is a sequence of offsets of one topic-partition. After a crash or reopen the
producer resumes after the last durable offset, exactly as the sink does. After every step:
no offset appears twice across the Lance table and the memtables, every acknowledged offset
is present, and nothing visible is beyond the durable offset (I2). At the end every offset up
to the durable one is in the table exactly once (I3).
"""

from __future__ import annotations

import shutil
import tempfile
from concurrent.futures import Future
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.errors import Poisoned
from engine.shard import PutResult, ShardWriter
from tests.support.engine import Harness, make_batch, source, visible_rows, writer_config

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


class WriterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="lance-sink-sm-"))
        self.h = Harness(
            str(self.dir / "table.lance"),
            str(self.dir / "wal"),
            config=writer_config(max_rows=60, interval_s=0.002),
        )
        self.writer: ShardWriter = self.h.open()
        self.next_offset = 0
        self.acked: set[int] = set()
        self.in_flight: list[tuple[Future[PutResult], range]] = []

    # --- rules ---------------------------------------------------------------------

    @rule(n=st.integers(1, 40), wait=st.booleans())
    def put(self, n: int, wait: bool) -> None:
        first = self.next_offset
        future = self.writer.put(make_batch(self.h.spec, first, n), source(first, n))
        self.next_offset += n
        self.in_flight.append((future, range(first, first + n)))
        if wait:
            self.settle()

    @rule()
    def settle(self) -> None:
        for future, offsets in self.in_flight:
            try:
                future.result(30)
            except Poisoned:
                continue
            self.acked.update(offsets)
        self.in_flight.clear()

    @rule()
    def seal(self) -> None:
        self.writer.seal()

    @rule()
    def flush(self) -> None:
        self.settle()
        self.writer.seal()
        assert self.writer.wait_flushed(30)

    @rule()
    def crash(self) -> None:
        """Die at this instant: nothing buffered is written, nothing frozen is flushed."""
        self.writer.poison(Poisoned("simulated crash", shard=self.writer.shard))
        self.settle()
        self.writer.close(flush=False, timeout=30)
        self.reopen()

    @rule(flush=st.booleans())
    def restart(self, flush: bool) -> None:
        self.settle()
        self.writer.close(flush=flush, timeout=30)
        self.reopen()

    def reopen(self) -> None:
        self.writer = self.h.open()
        durable = self.writer.durable_offsets.get(("t", 0), -1)
        assert self.acked <= set(range(durable + 1))
        self.next_offset = durable + 1  # resume after the last durable offset

    # --- invariants ------------------------------------------------------------------

    def present(self) -> list[int]:
        # The reader's order: the memtables, then the base (see ShardView.fresh).
        view = self.writer.view()
        ds = self.h.table.dataset()
        base = ds.to_table(columns=["_offset"]).column("_offset").to_pylist()
        fresh = visible_rows(view, base=ds)
        return sorted(base + [int(r["_offset"]) for r in fresh])

    @precondition(lambda self: self.writer.poisoned is None)
    @invariant()
    def exactly_once_and_visible_only_if_durable(self) -> None:
        present = self.present()
        assert len(present) == len(set(present)), "an offset appears twice"
        assert self.acked <= set(present), "an acknowledged offset is missing"
        durable = self.writer.durable_offsets.get(("t", 0), -1)
        assert not present or present[-1] <= durable, "a visible row is not durable"

    def teardown(self) -> None:
        try:
            self.settle()
            self.writer.close(flush=True, timeout=30)
            final = self.h.open()
            durable = final.durable_offsets.get(("t", 0), -1)
            final.close(flush=True, timeout=30)
            base = sorted(self.h.base_rows().column("_offset").to_pylist())
            assert base == list(range(durable + 1))
            assert self.acked <= set(base)
        finally:
            self.h.flusher.shutdown()
            shutil.rmtree(self.dir, ignore_errors=True)


WriterMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
test_writer_state_machine = WriterMachine.TestCase
