"""The partition state machine (`sink.consumer.partition`): every allowed transition is
taken by its function and lands where the table says; every other one raises and leaves
the state as it was; each transition changes the fields that go with it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, cast

import pytest

from engine.shard import ShardWriter
from sink.consumer import partition
from sink.consumer.partition import (
    TRANSITIONS,
    Decoding,
    Event,
    Held,
    IllegalTransition,
    InFlight,
    PartitionCounts,
    PartitionState,
    Phase,
)
from sink.decoded import Decoded


class Message:
    """A consumed message as far as the transitions read one (offset, timestamp)."""

    def __init__(self, offset: int, timestamp_ms: int = 1_000) -> None:
        self._offset = offset
        self._timestamp_ms = timestamp_ms

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return (1, self._timestamp_ms)  # TIMESTAMP_CREATE_TIME


WRITER = cast(ShardWriter, SimpleNamespace(shard="shard-0"))


def held_batch(first: int = 10, last: int = 19) -> Held:
    return Held(Decoded(None, [], [], first, last), [Message(first)])


Transition = Callable[[PartitionState], None]

#: Each event's transition function, as the loop calls it.
FUNCTIONS: dict[Event, Transition] = {
    Event.OPENED: lambda s: partition.opened(s, WRITER, 7),
    Event.OPEN_FAILED: lambda s: partition.open_failed(s, "OSError: down", 99.0),
    Event.WRITER_POISONED: lambda s: partition.writer_dropped(s, fenced=False, now=5.0),
    Event.WRITER_FENCED: lambda s: partition.writer_dropped(s, fenced=True, now=5.0),
    Event.HOLD: lambda s: partition.hold(s, held_batch()),
    Event.PUT_HELD: partition.put_held,
    Event.REGISTRY_WAIT: lambda s: partition.registry_wait(s, Message(4), "unreachable", 9.0),
    Event.REGISTRY_RETRY: partition.registry_retry,
    Event.EVOLVE: lambda s: partition.evolving(s, Message(4)),
    Event.STOP: lambda s: partition.stop(s, "bad message at offset 3: invalid_json"),
    Event.RELEASE: partition.release,
}

WRITING = (Phase.ACTIVE, Phase.HELD, Phase.REGISTRY_WAIT, Phase.EVOLVING)

#: (from, event, to): every transition the loop makes, written out independently of the
#: table it is checked against.
EDGES: list[tuple[Phase, Event, Phase]] = [
    (Phase.OPENING, Event.OPENED, Phase.ACTIVE),
    (Phase.RECOVERING, Event.OPENED, Phase.ACTIVE),
    (Phase.OPENING, Event.OPEN_FAILED, Phase.RECOVERING),
    (Phase.RECOVERING, Event.OPEN_FAILED, Phase.RECOVERING),
    *[(p, Event.WRITER_POISONED, Phase.RECOVERING) for p in WRITING],
    *[(p, Event.WRITER_FENCED, Phase.FENCED) for p in WRITING],
    (Phase.STOPPED, Event.WRITER_POISONED, Phase.STOPPED),
    (Phase.STOPPED, Event.WRITER_FENCED, Phase.STOPPED),
    (Phase.ACTIVE, Event.HOLD, Phase.HELD),
    (Phase.HELD, Event.PUT_HELD, Phase.ACTIVE),
    (Phase.ACTIVE, Event.REGISTRY_WAIT, Phase.REGISTRY_WAIT),
    (Phase.REGISTRY_WAIT, Event.REGISTRY_RETRY, Phase.ACTIVE),
    (Phase.ACTIVE, Event.EVOLVE, Phase.EVOLVING),
    *[(p, Event.STOP, Phase.STOPPED) for p in WRITING],
    *[(p, Event.RELEASE, Phase.RELEASED) for p in Phase if p is not Phase.RELEASED],
]
ALLOWED = {(start, event): end for start, event, end in EDGES}


def state_in(phase: Phase) -> PartitionState:
    state = PartitionState("t", 0, 3, phase=phase, position=12, done=10)
    if phase in (Phase.ACTIVE, Phase.HELD, Phase.REGISTRY_WAIT, Phase.EVOLVING, Phase.STOPPED):
        state.writer = WRITER
    if phase is Phase.HELD:
        state.held = held_batch()
    return state


def test_the_table_is_exactly_the_transitions_the_loop_makes() -> None:
    assert {
        (start, event): end for event, moves in TRANSITIONS.items() for start, end in moves.items()
    } == ALLOWED
    assert set(FUNCTIONS) == set(Event)


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.name)
@pytest.mark.parametrize("start", list(Phase), ids=lambda p: p.name)
def test_every_event_in_every_phase_moves_as_the_table_says_or_raises(
    start: Phase, event: Event
) -> None:
    state = state_in(start)
    end = ALLOWED.get((start, event))
    if end is not None:
        FUNCTIONS[event](state)
        assert state.phase is end
        assert state.counts.transitions == 1  # the status board publishes after it
        return
    before = repr(state)
    with pytest.raises(IllegalTransition, match=f"no {event.value} transition from {start.name}"):
        FUNCTIONS[event](state)
    assert state.phase is start
    assert state.counts.transitions == 0
    assert repr(state) == before  # nothing changed


def pending_decode(state: PartitionState) -> Future[Decoded]:
    future: Future[Decoded] = Future()
    state.add_decoding(Decoding([Message(12)], future))
    state.park([Message(13)])
    assert state.counts == PartitionCounts(parked=1, decoding=1)
    return future


def test_opened_resumes_at_the_start_and_forgets_the_failures() -> None:
    state = state_in(Phase.RECOVERING)
    state.open_error, state.open_failures = "OSError: down", 3
    partition.opened(state, WRITER, 42)
    assert (state.position, state.done, state.shard) == (42, 42, "shard-0")
    assert (state.open_error, state.open_failures, state.writer) == (None, 0, WRITER)


def test_open_failed_counts_and_backs_off() -> None:
    state = state_in(Phase.OPENING)
    partition.open_failed(state, "OSError: down", 99.0)
    partition.open_failed(state, "OSError: still down", 101.0)
    assert (state.open_failures, state.open_error, state.recover_at) == (
        2,
        "OSError: still down",
        101.0,
    )
    assert state.writer_unusable


def test_a_dropped_writer_drops_what_it_did_not_acknowledge_and_rewinds_to_done() -> None:
    state = state_in(Phase.HELD)
    state.inflight.append(InFlight(11, None, 1, 10, 500))
    decoding = pending_decode(state)
    state.registry_retry_at = 1.0
    state.out_of_range_retry = (12, 1.0)
    partition.writer_dropped(state, fenced=False, now=5.0)
    assert state.writer is None
    assert state.position == state.done == 10
    assert not state.inflight
    assert not state.decoding
    assert not state.parked
    assert decoding.cancelled()
    # the shared counts follow the queues (and count the transition)
    assert state.counts == PartitionCounts(transitions=1)
    assert state.held is None
    assert state.rewound == (10, 500)  # the oldest message dropped: the lag counts from it
    assert (state.registry_retry_at, state.out_of_range_retry) == (None, None)
    fenced = state_in(Phase.ACTIVE)
    partition.writer_dropped(fenced, fenced=True, now=5.0)
    assert (fenced.phase, fenced.fenced, fenced.fenced_at) == (Phase.FENCED, True, 5.0)


def test_hold_sets_fetching_back_to_the_batch_end_and_drops_the_batches_after_it() -> None:
    state = state_in(Phase.ACTIVE)
    decoding = pending_decode(state)
    held = held_batch(10, 11)
    partition.hold(state, held)
    assert state.held is held
    assert state.position == 12
    assert decoding.cancelled()
    assert not state.parked
    partition.put_held(state)
    assert state.held is None


def test_registry_wait_and_evolving_refetch_from_the_batch_start() -> None:
    state = state_in(Phase.ACTIVE)
    decoding = pending_decode(state)
    partition.registry_wait(state, Message(10, 700), "registry unreachable", 9.0)
    assert (state.position, state.rewound, state.registry_retry_at) == (10, (10, 700), 9.0)
    assert (state.registry_failures, state.registry_error) == (1, "registry unreachable")
    assert decoding.cancelled()
    partition.registry_retry(state)
    assert state.registry_retry_at is None
    assert state.registry_failures == 1  # until a batch decodes
    partition.evolving(state, Message(11, 800))
    assert (state.position, state.rewound) == (11, (10, 700))  # the older rewind stays


def test_the_queue_counts_are_the_sum_of_the_partitions_queues() -> None:
    counts = PartitionCounts()
    one = PartitionState("t", 0, -1, phase=Phase.ACTIVE, counts=counts)
    two = PartitionState("t", 1, -1, phase=Phase.ACTIVE, counts=counts)
    one.park([Message(0), Message(1)])
    two.park([Message(5)])
    one.add_decoding(Decoding(one.take_parked(), Future()))
    assert counts == PartitionCounts(parked=1, decoding=2)
    one.park([Message(2)])
    job = one.pop_decoded()
    assert len(job.messages) == 2
    assert counts == PartitionCounts(parked=2, decoding=0)
    partition.release(two)
    partition.hold(one, held_batch(2, 2))
    assert counts == PartitionCounts(transitions=2)  # and the phases changed twice


def test_release_drops_everything_queued() -> None:
    state = state_in(Phase.ACTIVE)
    decoding = pending_decode(state)
    opening: Future[Any] = Future()
    state.opening = opening
    partition.release(state)
    assert (state.writer, state.opening, state.parked) == (None, None, [])
    assert decoding.cancelled()
    with pytest.raises(IllegalTransition):
        partition.release(state)


@pytest.mark.parametrize(
    "event",
    [Event.HOLD, Event.REGISTRY_WAIT, Event.EVOLVE, Event.STOP, Event.WRITER_POISONED],
    ids=lambda e: e.name,
)
def test_leaving_active_forgets_a_refused_fetch_offset(event: Event) -> None:
    # A look-up of a refused fetch offset made while ACTIVE is stale once the partition
    # left it: acting on it (a skip to the log start) would move `position` past
    # messages dropped to be fetched again. Fetching resumes from `position`, where a
    # refusal that stands comes back.
    state = state_in(Phase.ACTIVE)
    state.out_of_range = (12, Future())
    state.out_of_range_retry = (12, 1.0)
    state.out_of_range_since = 0.5
    FUNCTIONS[event](state)
    assert (state.out_of_range, state.out_of_range_retry, state.out_of_range_since) == (
        None,
        None,
        None,
    )


def test_stop_drops_what_is_queued_and_keeps_the_held_batch() -> None:
    state = state_in(Phase.ACTIVE)
    decoding = pending_decode(state)
    partition.stop(state, "offset 12 is past the log end 9")
    assert decoding.cancelled()
    assert not state.parked
    assert state.rewound == (12, 1_000)  # the lag in seconds counts from the dropped batch
    assert state.stopped == "offset 12 is past the log end 9"
    held = state_in(Phase.HELD)
    kept = held.held
    partition.stop(held, "bad message at offset 10: invalid_json")
    assert held.held is kept
