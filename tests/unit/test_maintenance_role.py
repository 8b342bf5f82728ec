"""`sink.maintenance_role`: which pod of the group runs maintenance."""

from __future__ import annotations

from dataclasses import dataclass, field

from sink.maintenance_role import MaintenanceRole


@dataclass
class Runner:
    states: list[bool] = field(default_factory=list)

    def set_active(self, active: bool) -> None:
        self.states.append(active)


@dataclass
class Events:
    gauge: list[bool] = field(default_factory=list)

    def maintenance_active(self, active: bool) -> None:
        self.gauge.append(active)


@dataclass
class Held:
    fenced: bool = False


def test_the_holder_of_the_first_named_topics_partition_0_runs_it() -> None:
    runner, events = Runner(), Events()
    role = MaintenanceRole(["^logs-.*", "events", "other"], runner, events, enabled=True)
    role.update({("other", 0): Held(), ("events", 1): Held()})
    assert role.status() == {"role": "standby", "partition": {"topic": "events", "partition": 0}}
    role.update({("events", 0): Held()})
    assert role.status()["role"] == "active"
    role.update({("events", 0): Held(fenced=True)})  # a newer writer holds it now
    assert role.status()["role"] == "standby"
    assert runner.states == [True, False]
    assert events.gauge == [False, True, False]


def test_with_patterns_only_every_pod_runs_it() -> None:
    """A pattern names no partition a pod can know to be the group's one: the role waited
    for ('^logs-.*', 0), which no assignment holds, so no pod ever maintained the table."""
    runner, events = Runner(), Events()
    role = MaintenanceRole(["^logs-.*"], runner, events, enabled=True)
    role.update({("logs-a", 0): Held()})
    assert role.status() == {"role": "active", "partition": None}
    role.update({})
    assert role.status()["role"] == "active"
    assert runner.states == [True]
    assert events.gauge == [False, True]


def test_off_runs_nothing() -> None:
    runner, events = Runner(), Events()
    role = MaintenanceRole(["events"], runner, events, enabled=False)
    role.update({("events", 0): Held()})
    assert role.status()["role"] == "off"
    assert runner.states == []


def test_status_shows_a_role_only_after_the_runner_and_gauge_do() -> None:
    """Status is read from the HTTP thread: once it says "active", the runner must be
    running and the gauge must read 1 (an e2e test read the gauge as 0 right after status
    said "active", when the role was published first)."""
    seen: list[tuple[bool, str]] = []
    roles: list[MaintenanceRole] = []

    class Watching(Events):
        def maintenance_active(self, active: bool) -> None:
            seen.extend((active, r.status()["role"]) for r in roles)
            super().maintenance_active(active)

    role = MaintenanceRole(["events"], Runner(), Watching(), enabled=True)
    roles.append(role)
    role.update({("events", 0): Held()})
    role.update({})
    # When the gauge changes, status still says the role before the change.
    assert seen == [(True, "standby"), (False, "active")]
