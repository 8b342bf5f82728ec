"""Backpressure contracts: injection, refused seals, visible waits, the budget, truthful stats."""

from __future__ import annotations

import threading
import time

import pytest

from engine.backpressure import (
    BlockingValve,
    BudgetController,
    ControllerBase,
    ShardMemory,
    build_controller,
)
from engine.errors import Backpressure, is_backpressure
from tests.engine.conftest import MakeHarness
from tests.support.engine import make_batch, source, visible_rows, writer_config

pytestmark = pytest.mark.timeout(120)


class Recording(ControllerBase):
    """A custom controller: records every call, refuses admission or seals on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []
        self.refuse = False
        self.seal_allowed = True
        self.seen: ShardMemory | None = None

    def maybe_apply_backpressure(self, incoming_bytes: int, shard: ShardMemory) -> None:
        self.calls.append(("admit", incoming_bytes))
        self.seen = shard
        if self.refuse:
            raise Backpressure("refused by test", shard=shard.shard)

    def may_seal(self, shard: ShardMemory) -> bool:
        self.calls.append(("may_seal", 0))
        return self.seal_allowed


def test_injected_controller_replaces_the_default(local_harness: MakeHarness) -> None:
    controller = Recording()
    h = local_harness(controller=controller)
    writer = h.open()
    batch = make_batch(h.spec, 0, 10)
    writer.put(batch, source(0, 10)).result(10)
    assert controller.calls[0] == ("admit", batch.nbytes)
    controller.refuse = True
    with pytest.raises(Backpressure) as info:
        writer.put(make_batch(h.spec, 10, 10), source(10, 10))
    assert is_backpressure(info.value)
    assert len(visible_rows(writer)) == 10  # nothing of the refused put was accepted
    # ShardMemory is live: it follows the writer without being handed out again.
    assert controller.seen is writer.memory
    assert controller.seen.active_bytes == writer.stats().bytes
    writer.close(flush=False)


def test_build_controller_by_name_or_import_path() -> None:
    budget = build_controller("budget", process_budget_bytes=10, max_unflushed_memtable_bytes=5)
    assert isinstance(budget, BudgetController)
    valve = build_controller("valve", process_budget_bytes=10, max_unflushed_memtable_bytes=5)
    assert isinstance(valve, BlockingValve)
    custom = build_controller(
        "tests.engine.test_backpressure:make_recording",
        process_budget_bytes=10,
        max_unflushed_memtable_bytes=5,
    )
    assert isinstance(custom, Recording)


def make_recording(**_limits: int) -> Recording:
    return Recording()


def test_refused_seal_refuses_the_put_until_allowed(local_harness: MakeHarness) -> None:
    controller = Recording()
    controller.seal_allowed = False
    h = local_harness(controller=controller, config=writer_config(max_rows=20))
    writer = h.open()
    writer.put(make_batch(h.spec, 0, 15), source(0, 15)).result(10)
    with pytest.raises(Backpressure, match="seal refused"):
        writer.put(make_batch(h.spec, 15, 10), source(15, 10))  # would need a seal
    assert writer.stats().generation == 1
    assert len(visible_rows(writer)) == 15  # landed rows are never rolled back
    controller.seal_allowed = True
    writer.put(make_batch(h.spec, 15, 10), source(15, 10)).result(10)
    assert writer.stats().generation == 2
    assert sorted(r["_offset"] for r in visible_rows(writer)) == list(range(25))
    writer.close(flush=False)


def test_close_forces_the_seal_even_when_refused(local_harness: MakeHarness) -> None:
    controller = Recording()
    controller.seal_allowed = False
    h = local_harness(controller=controller)
    writer = h.open()
    writer.put(make_batch(h.spec, 0, 15), source(0, 15)).result(10)
    writer.close(flush=True)
    assert h.base_rows().num_rows == 15


def test_active_waits_are_visible_during_a_wait(local_harness: MakeHarness) -> None:
    valve = BlockingValve(limit=1)  # any unflushed byte makes the next put wait
    h = local_harness(controller=valve)
    gate = threading.Event()
    h.flusher.submit(lambda: gate.wait(60))  # hold flushes: memory cannot be freed
    writer = h.open()
    writer.put(make_batch(h.spec, 0, 10), source(0, 10)).result(10)
    done = threading.Event()

    def blocked_put() -> None:
        writer.put(make_batch(h.spec, 10, 10), source(10, 10)).result(30)
        done.set()

    thread = threading.Thread(target=blocked_put, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while valve.stats.snapshot().active_waits == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        during = valve.stats.snapshot()
        assert during.active_waits == 1
        assert during.waits_total == 0  # completed waits are counted separately
        assert not done.is_set()
        # The valve asked for a seal (nothing was frozen): a memtable waits for the pool.
        deadline = time.monotonic() + 10
        while writer.stats().frozen_count == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writer.stats().frozen_count == 1
        time.sleep(0.2)
    finally:
        gate.set()  # flushes run, memory is freed, the waiter is admitted
    assert done.wait(30)
    thread.join(10)
    after = valve.stats.snapshot()
    assert after.active_waits == 0
    assert after.waits_total == 1
    assert after.wait_seconds_total >= 0.2
    writer.close(flush=True)
    assert h.base_rows().num_rows == 20


def test_waits_are_counted_when_the_waiter_is_interrupted() -> None:
    valve = BlockingValve(limit=1)
    shard = ShardMemory("s")
    shard.active_bytes = 10
    shard.frozen_bytes = 10

    class Stop(Exception):
        pass

    def interrupt(predicate: object, timeout: float) -> bool:
        raise Stop

    shard.wait = interrupt  # type: ignore[method-assign]
    with pytest.raises(Stop):
        valve.maybe_apply_backpressure(5, shard)
    snap = valve.stats.snapshot()
    assert (snap.active_waits, snap.waits_total) == (0, 1)


def test_budget_controller_rejects_and_asks_for_a_seal() -> None:
    budget = BudgetController(100)
    a, b = ShardMemory("a"), ShardMemory("b")
    budget.register(a)
    budget.register(b)
    budget.maybe_apply_backpressure(1000, a)  # nothing buffered: always admitted
    a.active_bytes = 60
    b.active_bytes = 30
    budget.maybe_apply_backpressure(10, b)  # 100 <= 100
    with pytest.raises(Backpressure) as info:
        budget.maybe_apply_backpressure(11, b)
    assert info.value.context["used_bytes"] == 90
    assert a.seal_required  # the largest active memtable
    assert not b.seal_required
    assert budget.stats.snapshot().rejections_total == 1
    a.active_bytes, a.frozen_bytes = 0, 60  # sealed; frozen now
    b.seal_required = a.seal_required = False
    with pytest.raises(Backpressure):
        budget.maybe_apply_backpressure(20, b)
    assert not a.seal_required  # enough is already frozen and on its way out
    a.frozen_bytes = 0  # flushed
    budget.maybe_apply_backpressure(20, b)
    budget.unregister(a)
    assert budget.used_bytes() == 30


def test_budget_seal_request_frees_memory(local_harness: MakeHarness) -> None:
    budget = BudgetController(1)
    h = local_harness(controller=budget)
    writer = h.open()
    writer.put(make_batch(h.spec, 0, 10), source(0, 10)).result(10)
    with pytest.raises(Backpressure):
        writer.put(make_batch(h.spec, 10, 10), source(10, 10))
    # The writer honours seal_required on its own; the flush frees the budget.
    deadline = time.monotonic() + 20
    while writer.memory.unflushed_bytes and time.monotonic() < deadline:
        time.sleep(0.02)
    writer.put(make_batch(h.spec, 10, 10), source(10, 10)).result(10)
    writer.close(flush=True)
    assert sorted(h.base_rows().column("_offset").to_pylist()) == list(range(20))
