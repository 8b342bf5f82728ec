"""BrokerStats: what librdkafka's statistics tell readiness, and when their absence does."""

from __future__ import annotations

import orjson
import pytest

from sink.consumer.broker_stats import STALE_INTERVALS, BrokerStats

INTERVAL_S = 5.0
STALE_S = STALE_INTERVALS * INTERVAL_S + 1


def statistics(*, up: bool, ends: dict[tuple[str, int], int] | None = None) -> str:
    """A statistics document as librdkafka writes it (the parts `on_stats` reads)."""
    topics: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
    for (topic, partition), hi in (ends or {}).items():
        partitions = topics.setdefault(topic, {"partitions": {"-1": {"hi_offset": -1}}})
        partitions["partitions"][str(partition)] = {"hi_offset": hi}
    brokers = {
        "127.0.0.1:9092/1": {"state": "UP" if up else "DOWN", "nodeid": 1},
        "GroupCoordinator": {"state": "UP", "nodeid": -1},  # not a broker of its own
    }
    return orjson.dumps({"brokers": brokers, "topics": topics}).decode()


def test_before_the_first_statistics_a_process_is_not_held_back_for_their_interval() -> None:
    # librdkafka sends its first statistics one interval after the start: readiness used to
    # say "no broker statistics yet" until then, so a longer interval delayed every start.
    stats = BrokerStats(set(), INTERVAL_S)
    assert stats.unreachable(stats.created_at + INTERVAL_S + 0.5) is None
    assert stats.unreachable(stats.created_at + STALE_S - 0.1) is None
    assert stats.unreachable(stats.created_at + STALE_S + 0.1) == "no broker statistics yet"


def test_statistics_say_whether_a_broker_is_up_until_they_grow_stale() -> None:
    stats = BrokerStats(set(), INTERVAL_S)
    stats.on_stats(statistics(up=True))
    received = stats.received_at
    assert stats.brokers_up == 1  # the coordinator's pseudo-broker is not counted
    assert stats.unreachable(received + STALE_S - 0.1) is None
    assert (
        stats.unreachable(received + STALE_S + 1.2)
        == f"no broker statistics for {STALE_S + 1.2:.0f} s"
    )
    stats.on_stats(statistics(up=False))
    assert stats.unreachable(stats.received_at) == "no broker reachable"


def test_only_held_partitions_keep_their_log_end() -> None:
    held = {("events", 0)}
    stats = BrokerStats(held, INTERVAL_S)
    stats.on_stats(statistics(up=True, ends={("events", 0): 12, ("events", 1): 40}))
    assert stats.end(("events", 0)) == 12
    assert stats.end(("events", 1)) is None
    stats.forget(("events", 0))
    assert stats.end(("events", 0)) is None


@pytest.mark.parametrize("text", ["", "{", "not json"])
def test_a_document_that_does_not_parse_changes_nothing(text: str) -> None:
    stats = BrokerStats(set(), INTERVAL_S)
    stats.on_stats(text)
    assert (stats.received_at, stats.brokers_up) == (0.0, 0)
