"""Maintenance on in e2e tests, as in production: the settings that make every task fire
within seconds (`MAINTENANCE_ON`, write_config's default, defined in tests.support.sink), the
off/on parametrization, and the check that it ran without ever making a flush or a
partition's open fail."""

from __future__ import annotations

import time

import pytest

# MAINTENANCE_ON and MAINTENANCE_OFF live in tests.support.sink (write_config's default, and
# this module imports SinkProcess from there); importable from here too.
from tests.support.sink import MAINTENANCE_OFF, MAINTENANCE_ON, SinkProcess

MAINTENANCE = pytest.mark.parametrize(
    "maintenance",
    [
        pytest.param(MAINTENANCE_OFF, id="maintenance-off"),
        pytest.param(MAINTENANCE_ON, id="maintenance-on"),
    ],
)


#: What maintenance does to any table that got a few flushes: builds the text and scalar
#: indexes and compacts (outcome ``done``: a task that had nothing to do is ``skipped``, and
#: not logged). The vector index and index optimisation need more rows (`MAINTENANCE_ON`).
MAINTAINED = frozenset({"fts_index", "scalar_indexes", "compact"})


def maintenance_done(procs: list[SinkProcess]) -> set[str]:
    """The maintenance tasks that completed (outcome ``done``) in any of the processes."""
    return {
        e["task"]
        for p in procs
        for e in p.events()
        if e.get("event") == "maintenance_ran" and e.get("outcome") == "done"
    }


def wait_maintained(
    procs: list[SinkProcess], tasks: frozenset[str] = MAINTAINED, timeout: float = 60
) -> set[str]:
    """Wait until maintenance completed every one of `tasks` in `procs` (see
    `maintenance_done`), every process still running; returns the tasks done."""
    deadline = time.monotonic() + timeout
    while not (done := maintenance_done(procs)) >= tasks:
        for p in procs:
            assert p.alive(), f"sink exited early: {p.log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"maintenance did only {done} of {set(tasks)}"
        time.sleep(0.3)
    return done


def assert_no_flush_failures(procs: list[SinkProcess]) -> None:
    """No flush and no partition open failed in any of the processes."""
    events = [e for p in procs for e in p.events()]
    flush_failures = [e for e in events if e.get("event") == "flush_failed"]
    assert not flush_failures, flush_failures[:3]
    open_failures = [e for e in events if e.get("event") == "partition_open_failed"]
    assert not open_failures, open_failures[:3]


def assert_maintained_without_flush_failures(procs: list[SinkProcess]) -> None:
    """With maintenance on: compaction ran with indexes present, and no flush or partition
    open ever failed."""
    assert_no_flush_failures(procs)
    done = maintenance_done(procs)
    assert done >= MAINTAINED, done
