"""One assigned topic-partition's state, its phases, and the one function per transition.

A partition's life in this process, from the assignment to the release (`Phase`; the
diagram and what holds in each phase are in DESIGN.md, "The partition state machine"):

- OPENING: assigned by the group; its shard is being claimed and replayed on the open pool
  (`sink.consumer.lifecycle`). Not handed to the consumer yet: nothing is fetched.
- ACTIVE: the shard writer is open and the partition is fetched from `position`. One
  sub-state rides on it: a fetch offset the broker refused (`out_of_range`,
  `out_of_range_retry`, `out_of_range_since`: `sink.consumer.out_of_range`), which
  librdkafka stops fetching by itself; every transition out of ACTIVE forgets it.
- HELD: a decoded batch waits (`held`) for its dead letters to be acknowledged, or for
  backpressure to let it in. Paused.
- REGISTRY_WAIT: the schema registry could not answer while decoding; paused, decoded
  again from `position` at `registry_retry_at`.
- EVOLVING: a batch needs the derived table evolved; paused until the drain that restarts
  the process (`run()` returns EXIT_RESTART_TO_EVOLVE).
- RECOVERING: no shard writer: its open failed, or the writer was poisoned and dropped.
  Taken out of the consumer's assignment; reopened after a backoff (`recover_at`).
- FENCED: a newer writer owns the shard: paused, waiting for the group to take the
  partition away (a fenced process is a zombie).
- STOPPED: stopped for good until it is assigned again (a bad message without a
  dead-letter destination, a batch the table refuses without one, an offset past the log
  end); `stopped` says why. Paused. Its writer, while it keeps one, still makes what is in
  flight durable; a writer it loses is not reopened.
- RELEASED: revoked, lost or drained: the writer closed, the state forgotten.

The transition functions below change a state's phase and the fields that go with the
transition, and nothing else: the consumer calls (pause, resume, assign) are made by the
caller through `sink.consumer.flow.Flow`, the only code that talks to the consumer about a
partition's fetching. A transition the table (`TRANSITIONS`) does not allow raises
`IllegalTransition`: a bug, never a message's fault.

Threads: a `PartitionState` is read and written by the consumer loop alone (rebalance
callbacks run inside `consume()` on the loop thread). Other threads read the
`PartitionView` snapshots the loop publishes (`sink.consumer.status`) and the open writers
(`PartitionTable.writers`, under its lock).
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import confluent_kafka
import structlog
from confluent_kafka import TopicPartition

from engine.errors import LanceSinkError
from engine.shard import PutResult, ShardWriter
from sink.decoded import Decoded
from sink.dlq import DeadLetterBatch

_log = structlog.get_logger("lance_sink.sink")


@dataclass(frozen=True, slots=True)
class Opened:
    """What an open on the open pool gave (`sink.consumer.lifecycle.Lifecycle`): the
    claimed and replayed writer, the committed offset it looked up (None: not asked), and
    the seconds the open waited for a pool thread and then took (the rebalance timeline's
    figures, `bench/rebalance.py`)."""

    writer: ShardWriter
    committed: int | None
    queued_s: float
    open_s: float


class Phase(enum.Enum):
    """Where a partition is in its life (see the module docstring)."""

    OPENING = "opening"
    ACTIVE = "active"
    HELD = "held"
    REGISTRY_WAIT = "registry_wait"
    EVOLVING = "evolving"
    RECOVERING = "recovering"
    FENCED = "fenced"
    STOPPED = "stopped"
    RELEASED = "released"


class Event(enum.Enum):
    """What moves a partition from one phase to another: one transition function each."""

    OPENED = "opened"
    OPEN_FAILED = "open_failed"
    WRITER_POISONED = "writer_poisoned"
    WRITER_FENCED = "writer_fenced"
    HOLD = "hold"
    PUT_HELD = "put_held"
    REGISTRY_WAIT = "registry_wait"
    REGISTRY_RETRY = "registry_retry"
    EVOLVE = "evolve"
    STOP = "stop"
    RELEASE = "release"


_WRITING = (Phase.ACTIVE, Phase.HELD, Phase.REGISTRY_WAIT, Phase.EVOLVING)

#: Every allowed transition: for each event, the phases it may happen in and where it
#: leads. Anything else raises `IllegalTransition`.
TRANSITIONS: Mapping[Event, Mapping[Phase, Phase]] = {
    Event.OPENED: {Phase.OPENING: Phase.ACTIVE, Phase.RECOVERING: Phase.ACTIVE},
    Event.OPEN_FAILED: {Phase.OPENING: Phase.RECOVERING, Phase.RECOVERING: Phase.RECOVERING},
    # A STOPPED partition's writer is closed when it fails, not reopened.
    Event.WRITER_POISONED: {
        **dict.fromkeys(_WRITING, Phase.RECOVERING),
        Phase.STOPPED: Phase.STOPPED,
    },
    Event.WRITER_FENCED: {**dict.fromkeys(_WRITING, Phase.FENCED), Phase.STOPPED: Phase.STOPPED},
    Event.HOLD: {Phase.ACTIVE: Phase.HELD},
    Event.PUT_HELD: {Phase.HELD: Phase.ACTIVE},
    Event.REGISTRY_WAIT: {Phase.ACTIVE: Phase.REGISTRY_WAIT},
    Event.REGISTRY_RETRY: {Phase.REGISTRY_WAIT: Phase.ACTIVE},
    Event.EVOLVE: {Phase.ACTIVE: Phase.EVOLVING},
    Event.STOP: dict.fromkeys(_WRITING, Phase.STOPPED),
    Event.RELEASE: dict.fromkeys((p for p in Phase if p is not Phase.RELEASED), Phase.RELEASED),
}


class IllegalTransition(LanceSinkError):
    """A transition `TRANSITIONS` does not allow was asked for: a bug in the loop."""


@dataclass
class InFlight:
    """A put on its way to durability, covering source offsets up to `last`."""

    last: int
    future: Future[PutResult] | None
    rows: int
    nbytes: int
    first_timestamp_ms: int | None
    stages: Stages | None = None  # when its oldest message was fetched and decoded


@dataclass(frozen=True, slots=True)
class Stages:
    """When a batch's oldest message passed the stages before its put (monotonic): fetched
    (consume() returned it) and decoded (the loop collected its decoded batch). With the
    put's `durable_at` and the commit's acknowledgement, the freshness breakdown
    (`sink.metrics.Metrics.stage_reached`)."""

    fetched_at: float
    decoded_at: float


@dataclass
class Decoding:
    """Consumed messages of one partition on their way through a decode worker."""

    messages: list[Any]
    future: Future[Decoded]
    fetched_at: float = 0.0  # when the oldest of them was fetched (monotonic)


@dataclass
class Held:
    """A decoded batch that could not be put yet (dead letters unacknowledged, or
    backpressure). While a batch is held its partition is paused; messages fetched
    meanwhile are dropped and fetched again from `position` on resume."""

    decoded: Decoded
    messages: list[Any]
    dead_letters: DeadLetterBatch | None = None
    stages: Stages | None = None


@dataclass
class PartitionCounts:
    """Counts over every partition that shares it, read every loop iteration.

    `parked` and `decoding` are the messages queued: the pipeline's bound on what the loop
    takes from librdkafka, kept by `PartitionState`'s queue methods alone (`park`,
    `take_parked`, `add_decoding`, `pop_decoded`, `drop_queued`), so they always equal the
    sums of the queues. `transitions` counts the phase transitions taken (`_move`): the
    status board publishes its views after a tick that took any."""

    parked: int = 0
    decoding: int = 0
    transitions: int = 0


@dataclass
class PartitionState:
    """One assigned topic-partition and its shard writer (see the module docstring).

    Offsets follow Kafka's convention: `position`, `done` and `committed` are each the next
    offset to read. `done` only advances over offsets whose rows are durable (or whose
    dead letters were acknowledged, or that carry no rows: tombstones, and the control
    records and aborted messages the consumer skips, see
    `sink.consumer.commits.Commits.skip_records_without_data`), so committing `done` keeps
    I1. `position` is where fetching resumes: it moves forward as messages are parked or
    offsets skipped (`sink.consumer.pipeline`) and as records without data are passed
    (`sink.consumer.commits`), and only the transitions below set it anywhere else.
    """

    topic: str
    partition: int
    committed: int
    phase: Phase = Phase.OPENING
    writer: ShardWriter | None = None
    position: int | None = None
    done: int | None = None
    # Consumed messages on their way to decoding, in offset order: handed to a decode
    # worker, and parked while the decoders were full. Changed only through the queue
    # methods below, which keep `counts` (shared by the pipeline's partitions).
    decoding: deque[Decoding] = field(default_factory=deque)
    parked: list[Any] = field(default_factory=list)
    parked_at: float = 0.0  # when the oldest parked message was fetched (monotonic)
    counts: PartitionCounts = field(default_factory=PartitionCounts, repr=False)
    inflight: deque[InFlight] = field(default_factory=deque)
    # (done, when it became durable, the batch's oldest message timestamp in ms or None)
    durable_at: deque[tuple[int, float, int | None]] = field(default_factory=deque)
    held: Held | None = None
    # What the consumer was last told (`sink.consumer.flow.Flow` alone writes these):
    # handed to it by incremental_assign, and paused.
    assigned: bool = False
    paused: bool = False
    fenced_at: float | None = None  # FENCED since (monotonic)
    stopped: str | None = None  # STOPPED: why
    # ACTIVE's out-of-range sub-state: the broker refused to fetch from this offset; the
    # partition's log range being looked up on the open pool; the offset and when to fetch
    # it again; since when the broker has refused it (reset by any message).
    out_of_range: tuple[int, Future[tuple[int, int]]] | None = None
    out_of_range_retry: tuple[int, float] | None = None
    out_of_range_since: float | None = None
    # OPENING / RECOVERING: the open (claim and replay) on the open pool; while it fails,
    # `open_error` says why and `open_failures` counts the attempts in a row; the next
    # attempt is made at `recover_at`.
    opening: Future[Opened] | None = None
    open_error: str | None = None
    open_failures: int = 0
    recover_at: float = 0.0
    committed_known: bool = True  # False: the committed-offset look-up failed; retried
    # REGISTRY_WAIT: decoded again from `position` at `registry_retry_at`; failures in a
    # row and the last error (kept until a batch decodes).
    registry_retry_at: float | None = None
    registry_failures: int = 0
    registry_error: str | None = None
    # The first message of batches dropped before they were put, as (offset, timestamp
    # ms): a registry outage, a schema evolution or a dropped writer rewound `position`
    # to it. Consumed, not durable, fetched again: the lag in seconds counts from it
    # (nothing in flight or held says so meanwhile) until `done` passes it.
    rewound: tuple[int, int | None] | None = None
    # The shard of the writer last opened for the partition (its series are removed on
    # release), and what that writer last reported as durable and flushed (1 + offset)
    # when it was dropped: the offsets shown while the partition has no writer.
    shard: str | None = None
    writer_durable: int = 0
    writer_flushed: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return (self.topic, self.partition)

    @property
    def log(self) -> Any:
        """The sink's logger bound to the partition (topic, partition)."""
        return _log.bind(topic=self.topic, partition=self.partition)

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)

    @property
    def fenced(self) -> bool:
        """A newer writer owns the shard (`sink.maintenance_role` reads this)."""
        return self.phase is Phase.FENCED

    @property
    def fetched(self) -> bool:
        """Whether the sink's consumer fetches the partition (so librdkafka's cached high
        watermark is current): assigned to it, not paused, with a shard writer."""
        return self.assigned and not self.paused and self.writer is not None

    @property
    def feeds(self) -> bool:
        """Whether consumed messages of the partition go on to decoding: ACTIVE and not
        paused (a partition paused by the drain takes nothing more)."""
        return self.phase is Phase.ACTIVE and not self.paused

    @property
    def settled(self) -> bool:
        """Nothing consumed on its way: everything consumed is durable (or acknowledged by
        the dead-letter topic) and nothing is parked, decoding, held or in flight."""
        return (
            not self.parked
            and not self.decoding
            and self.held is None
            and not self.inflight
            and self.done == self.position
        )

    @property
    def writer_unusable(self) -> bool:
        """The writer-poisoned gauge: no writer serves the partition (dropped when poisoned
        or fenced, or its open failed) and none is being opened for the first time (a
        first open is a readiness reason while it lasts, not a failure)."""
        return self.writer is None and self.phase is not Phase.OPENING

    def unacked_dead_letters(self) -> DeadLetterBatch | None:
        """The dead letters holding the partition, while any of them is undelivered."""
        held = self.held
        letters = held.dead_letters if held is not None else None
        return letters if letters is not None and not letters.acked else None

    def oldest_pending_timestamp_ms(self) -> int | None:
        """The timestamp of the oldest consumed message not yet durable (None when nothing
        consumed waits, or that message has no timestamp). In offset order: the oldest put
        in flight, the held batch, then a batch dropped to be fetched again (`rewound`)
        until `done` passes it."""
        if self.inflight:
            return self.inflight[0].first_timestamp_ms
        if (held := self.held) is not None and held.messages:
            return timestamp_ms(held.messages[0])
        rewound, done = self.rewound, self.done
        if rewound is not None and (done is None or done <= rewound[0]):
            return rewound[1]
        return None

    def oldest_unsettled_timestamp_ms(self) -> int | None:
        """`oldest_pending_timestamp_ms`, counting the batches still decoding or parked too
        (what a dropped writer drops with them)."""
        pending = self.oldest_pending_timestamp_ms()
        if pending is not None:
            return pending
        if self.decoding and self.decoding[0].messages:
            return timestamp_ms(self.decoding[0].messages[0])
        if self.parked:
            return timestamp_ms(self.parked[0])
        return None

    def rewind_to(self, offset: int, timestamp_ms: int | None) -> None:
        """Messages from `offset` on were dropped before they were put and are fetched
        again: remember when the first was produced for the lag in seconds (`rewound`),
        unless an older message not yet durable is remembered already."""
        rewound = self.rewound
        stale = rewound is not None and self.done is not None and self.done > rewound[0]
        if rewound is None or stale or offset < rewound[0]:
            self.rewound = (offset, timestamp_ms)

    def park(self, messages: list[Any], fetched_at: float = 0.0) -> None:
        """Queue consumed messages for decoding (fetched at `fetched_at`, monotonic)."""
        if not self.parked:
            self.parked_at = fetched_at
        self.parked.extend(messages)
        self.counts.parked += len(messages)

    def take_parked(self) -> list[Any]:
        """The parked messages, to be handed to a decode worker (`add_decoding`; the oldest
        was fetched at `parked_at`)."""
        messages, self.parked = self.parked, []
        self.counts.parked -= len(messages)
        return messages

    def add_decoding(self, job: Decoding) -> None:
        """A batch handed to a decode worker (or decoded already), after those before it."""
        self.decoding.append(job)
        self.counts.decoding += len(job.messages)

    def pop_decoded(self) -> Decoding:
        """The oldest batch, its decoding ended: to be fed."""
        job = self.decoding.popleft()
        self.counts.decoding -= len(job.messages)
        return job

    def drop_queued(self) -> None:
        """Forget batches not yet fed (nothing of them is durable or committed): they are
        fetched again from `position` (or by the partition's next owner)."""
        for job in self.decoding:
            job.future.cancel()
            self.counts.decoding -= len(job.messages)
        self.decoding.clear()
        self.counts.parked -= len(self.parked)
        self.parked = []

    def rewind(self, first: Any) -> None:
        """`rewind_to` the message `first` (a consumed message)."""
        self.rewind_to(first.offset(), timestamp_ms(first))


def _forget_refused_offset(state: PartitionState) -> None:
    """Leave ACTIVE's out-of-range sub-state: fetching resumes (if ever) from `position`,
    where a refusal that stands is met again; a look-up of an older fetch offset would
    move `position` past messages that were dropped to be fetched again."""
    state.out_of_range = state.out_of_range_retry = state.out_of_range_since = None


def _move(state: PartitionState, event: Event) -> None:
    """Take `event`'s transition, before any field changes: a forbidden one raises and
    leaves the state as it was."""
    to = TRANSITIONS[event].get(state.phase)
    if to is None:
        raise IllegalTransition(
            f"{state.topic}[{state.partition}]: no {event.value} transition from {state.phase.name}"
        )
    state.phase = to
    state.counts.transitions += 1


# ---------------------------------------------------------------- transitions


def opened(state: PartitionState, writer: ShardWriter, start: int | None) -> None:
    """OPENING / RECOVERING -> ACTIVE: the shard is claimed and replayed; fetching resumes
    at `start` (None: where `kafka.auto_offset_reset` says)."""
    _move(state, Event.OPENED)
    state.writer = writer
    state.shard = writer.shard
    state.position = state.done = start
    state.open_error, state.open_failures = None, 0


def open_failed(state: PartitionState, error: str, retry_at: float) -> None:
    """OPENING / RECOVERING -> RECOVERING: opening the shard failed (or its writer was
    dropped, `writer_dropped`); tried again at `retry_at`."""
    _move(state, Event.OPEN_FAILED)
    state.open_failures += 1
    state.open_error = error
    state.recover_at = retry_at


def writer_dropped(state: PartitionState, *, fenced: bool, now: float) -> None:
    """ACTIVE / HELD / REGISTRY_WAIT / EVOLVING -> RECOVERING or FENCED; STOPPED stays.

    The writer failed (poisoned) or a newer one owns the shard (fenced): what it did not
    acknowledge is dropped, fetching resumes at `done` (after a reopen, or by the next
    owner), and the lag in seconds counts from the oldest message dropped. A RECOVERING
    partition gets its `open_error` and backoff from `open_failed`, which the caller
    calls next."""
    stopped = state.phase is Phase.STOPPED
    _move(state, Event.WRITER_FENCED if fenced else Event.WRITER_POISONED)
    if fenced and not stopped:
        state.fenced_at = now
    dropped = state.oldest_unsettled_timestamp_ms()
    if state.done is not None and dropped is not None:
        state.rewind_to(state.done, dropped)
    state.writer = None
    state.position = state.done
    state.drop_queued()
    state.inflight.clear()
    state.held = None
    state.registry_retry_at = None
    _forget_refused_offset(state)


def hold(state: PartitionState, held: Held) -> None:
    """ACTIVE -> HELD: a decoded batch waits; batches consumed after it are dropped
    and fetched again once it is put (from `position`, its end)."""
    _move(state, Event.HOLD)
    state.held = held
    state.position = held.decoded.last_offset + 1
    state.drop_queued()
    _forget_refused_offset(state)


def put_held(state: PartitionState) -> None:
    """HELD -> ACTIVE: the held batch is put; fetching resumes at `position`."""
    _move(state, Event.PUT_HELD)
    state.held = None


def registry_wait(state: PartitionState, first: Any, error: str, retry_at: float) -> None:
    """ACTIVE -> REGISTRY_WAIT: the registry could not answer for the batch starting at
    message `first`: it and what follows are decoded again from its offset at
    `retry_at`."""
    _move(state, Event.REGISTRY_WAIT)
    state.registry_failures += 1
    state.registry_error = error
    state.registry_retry_at = retry_at
    state.position = first.offset()
    state.rewind(first)
    state.drop_queued()
    _forget_refused_offset(state)


def registry_retry(state: PartitionState) -> None:
    """REGISTRY_WAIT -> ACTIVE: the backoff is over; fetched again from `position`."""
    _move(state, Event.REGISTRY_RETRY)
    state.registry_retry_at = None


def evolving(state: PartitionState, first: Any) -> None:
    """ACTIVE -> EVOLVING: the batch starting at message `first` needs the derived table
    evolved: nothing of it is put; the next process reads it again from its offset."""
    _move(state, Event.EVOLVE)
    state.position = first.offset()
    state.rewind(first)
    state.drop_queued()
    _forget_refused_offset(state)


def stop(state: PartitionState, why: str) -> None:
    """ACTIVE / HELD / REGISTRY_WAIT / EVOLVING -> STOPPED, for good (until assigned
    again): `why` shows in /readyz and /v1/status. Nothing more is fed: batches parked or
    decoding are dropped (not durable, not committed: the partition's next owner fetches
    them, and the lag in seconds counts from the oldest); a held batch stays, to show.
    Puts in flight still become durable."""
    _move(state, Event.STOP)
    state.stopped = why
    if state.decoding and state.decoding[0].messages:
        state.rewind(state.decoding[0].messages[0])
    elif state.parked:
        state.rewind(state.parked[0])
    state.drop_queued()
    state.registry_retry_at = None
    _forget_refused_offset(state)


def release(state: PartitionState) -> None:
    """Any phase -> RELEASED: revoked, lost or drained."""
    _move(state, Event.RELEASE)
    state.drop_queued()
    state.writer = None
    state.opening = None


# ---------------------------------------------------------------- the table


class PartitionTable(Mapping[tuple[str, int], PartitionState]):
    """The partitions this process holds, by (topic, partition): written by the loop,
    read by any thread. Copy on write: `add` and `remove` (rebalances) build a new mapping
    and tuple of states under a lock and publish them with one assignment each, so reads
    (every loop iteration, queries asking for the writers) take no lock and see one
    consistent set; the states themselves are the loop's."""

    def __init__(self) -> None:
        self._states: dict[tuple[str, int], PartitionState] = {}
        self._all: tuple[PartitionState, ...] = ()
        self._lock = threading.Lock()

    def add(self, state: PartitionState) -> None:
        with self._lock:
            self._publish({**self._states, state.key: state})

    def remove(self, state: PartitionState) -> None:
        with self._lock:
            if self._states.get(state.key) is state:
                self._publish({k: s for k, s in self._states.items() if s is not state})

    def _publish(self, states: dict[tuple[str, int], PartitionState]) -> None:
        self._all = tuple(states.values())
        self._states = states

    def states(self) -> tuple[PartitionState, ...]:
        """Every state, as of the last `add` or `remove`: safe to iterate while the loop
        adds or removes partitions."""
        return self._all

    def writers(self) -> list[ShardWriter]:
        """The open shard writers (readers and the query layer use these)."""
        return [s.writer for s in self._all if s.writer is not None]

    def get(self, key: tuple[str, int], default: Any = None) -> Any:
        return self._states.get(key, default)

    def __getitem__(self, key: tuple[str, int]) -> PartitionState:
        return self._states[key]

    def __contains__(self, key: object) -> bool:
        return key in self._states

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)


def timestamp_ms(message: Any) -> int | None:
    """A consumed message's timestamp in milliseconds (None when it has none)."""
    kind, ts = message.timestamp()
    return int(ts) if kind != confluent_kafka.TIMESTAMP_NOT_AVAILABLE else None
