"""Which pod of the consumer group maintains the base table: the one that holds the
maintenance partition, partition 0 of the first topic in `kafka.topics` (the first named
one: with subscription patterns only, every pod maintains, as before).

Every pod of a group runs the same configuration (the Helm chart renders one for all), and
maintenance (`engine.maintenance`: index builds and optimisation, compaction, cleanup of
old versions) run by every pod on one table does the same work several times and loses
commit races: in a trial with 3 pods, 168 conflicts and 9 failed tasks in 20 minutes, and a
cleanup that failed on a version another pod's cleanup had just removed. Kafka's group
protocol already gives each partition one holder at a time, so no election of our own is
needed: the pod that holds the maintenance partition runs maintenance, every other pod
stands by (its maintenance runner started, starting no task; with `maintenance.process` no
child process runs until the role is gained, see `MaintenanceProcess`). When the partition
moves (a rebalance, a pod stopped or gone), the role moves with it: the pod that lost it
finishes the task it is in and starts no other, the pod that gained it starts its next run.
A single pod holds every partition, so it maintains the table as soon as its first assignment
arrives.

Two pods can run a task at the same time only briefly: the task the previous holder is
finishing (each is one or a few atomic Lance commits, and commit races are retried), or
while a pod whose session expired has not yet learned it lost its partitions (it stands by
once the new holder's claim fences its writer of the maintenance partition: at its next
write, or its next manifest check when idle: `wal.fence_check_interval_ms`, or shards /
`wal.fence_probes_per_s` with many idle shards). No pod
maintains while the first topic does not exist (nothing has been assigned from it).

Lifecycle: `SinkService` builds it with the maintenance runner (created standing by) and
calls `update(held)` from its consumer loop on every iteration, with the partitions it holds
now (`SinkService.partitions`, a `sink.consumer.partition.PartitionTable`: assigned,
whether or not the shard is open yet; a fenced partition is the newer writer's); `update`
tells the runner to run or to stand by when that changes, logs it (``maintenance_role``)
and sets the gauge. `status()` may be called from any thread. With `maintenance.enabled`
off nothing runs anywhere and the role stays ``off``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol

import structlog

log = structlog.get_logger("lance_sink.sink")

#: The maintenance partition's number in the first topic: every topic has a partition 0.
MAINTENANCE_PARTITION = 0

Role = Literal["active", "standby", "off"]


class MaintenanceRunner(Protocol):
    """What the role switches (`engine.maintenance.Maintenance` and `MaintenanceProcess`)."""

    def set_active(self, active: bool) -> None: ...


class Held(Protocol):
    """What the role reads of a held partition (`sink.consumer.partition.PartitionState`)."""

    @property
    def fenced(self) -> bool: ...


class RoleEvents(Protocol):
    """The metrics facade's part: whether this pod runs maintenance now."""

    def maintenance_active(self, active: bool) -> None: ...


class MaintenanceRole:
    """This pod's maintenance role in its group (see the module docstring)."""

    def __init__(
        self, topics: list[str], runner: MaintenanceRunner, events: RoleEvents, *, enabled: bool
    ) -> None:
        # The first topic named as such: a name starting with "^" is a subscription
        # pattern, whose topics a pod does not all know. With patterns only there is no
        # maintenance partition, and every pod maintains (as before the role existed).
        named = [t for t in topics if not t.startswith("^")]
        self.partition = (named[0], MAINTENANCE_PARTITION) if named else None
        self.runner = runner
        self.events = events
        self.enabled = enabled
        self.role: Role = "standby" if enabled else "off"
        events.maintenance_active(False)

    def update(self, held: Mapping[tuple[str, int], Held]) -> None:
        """The consumer loop holds `held` now: run maintenance if the maintenance partition
        is among them (and not fenced by a newer writer), stand by otherwise; with no
        maintenance partition (patterns only), always run."""
        if not self.enabled:
            return
        if self.partition is None:
            active = True
            fields: dict[str, Any] = {"reason": "topics are patterns only"}
        else:
            state = held.get(self.partition)
            active = state is not None and not state.fenced
            topic, partition = self.partition
            fields = {"topic": topic, "partition": partition}
        role: Role = "active" if active else "standby"
        if role == self.role:
            return
        # Runner and gauge first, the role last: status (read from another thread) never
        # says a role that the runner and metrics do not show yet.
        self.runner.set_active(active)
        self.events.maintenance_active(active)
        self.role = role
        log.info("maintenance_role", role=role, **fields)

    def status(self) -> dict[str, Any]:
        """The role for `/v1/status`: ``active`` (this pod maintains the table),
        ``standby`` (the holder of the maintenance partition does) or ``off``; the
        maintenance partition, None with patterns only (every pod maintains)."""
        if self.partition is None:
            return {"role": self.role, "partition": None}
        topic, partition = self.partition
        return {"role": self.role, "partition": {"topic": topic, "partition": partition}}
