"""`lance-sink status`'s one-screen summary (`sink.cli.render_status`) of a `/v1/status`
document."""

from __future__ import annotations

from typing import Any

from sink.cli import render_status


def status(**partition: Any) -> dict[str, Any]:
    """A `/v1/status` document with one partition, `partition` merged into it."""
    return {
        "group": "lance-sink",
        "topics": ["orders"],
        "table": "./data/orders.lance",
        "ready": True,
        "not_ready_reasons": [],
        "partitions": [
            {
                "topic": "orders",
                "partition": 0,
                "paused": False,
                "fenced": False,
                "stopped": None,
                "end": 120,
                "lag": {"consumer": 20, "commit": 20, "flush": 120, "seconds": 4.5},
                "memtable": {"bytes": 2048, "frozen_count": 0},
                "flush": {"flushes": 0},
                **partition,
            }
        ],
        "backpressure": {
            "controller": "budget",
            "used_bytes": 0,
            "budget_bytes": 1 << 30,
            "rejections_total": 0,
            "waits_total": 0,
            "wait_seconds_total": 0,
            "active_waits": 0,
        },
        "base": {"unindexed_rows": 0, "rows": 0, "unindexed_by_index": {}},
    }


def partition_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("orders[0]"))
    end = lines.index("", start)
    return lines[start:end]


def test_a_partition_paused_by_the_registry_says_why() -> None:
    """During a registry outage the row said only 'paused'; /v1/status has the error and
    when the partition tries again, and so does the summary now."""
    registry = {
        "error": "schema registry unreachable: ConnectError: [Errno 111] Connection refused",
        "failures": 3,
        "retry_in_s": 4.04,
    }
    row, note = partition_lines(render_status(status(paused=True, schema_registry=registry)))
    assert row.endswith("paused")
    assert note == (
        "  paused: schema registry unreachable: ConnectError: [Errno 111] Connection refused "
        "(3 failed tries); retry in 4.0 s"
    )
    registry["retry_in_s"] = None  # the retry is due: the loop decodes again at its next turn
    _row, note = partition_lines(render_status(status(paused=True, schema_registry=registry)))
    assert note.endswith("; retry pending")


def test_a_partition_waiting_for_its_dead_letters_says_so() -> None:
    letters = {"pending": 2, "waiting_s": 75.25, "stalled": True, "last_error": "MSG_TIMED_OUT"}
    _row, note = partition_lines(render_status(status(paused=True, dead_letters=letters)))
    assert note == (
        "  waiting for 2 dead letters to be acknowledged for 75.2 s (stalled); "
        "last error: MSG_TIMED_OUT"
    )


def test_a_running_partition_has_one_line() -> None:
    [row] = partition_lines(render_status(status()))
    assert row.endswith("running")
    [row] = partition_lines(render_status(status(phase="active")))
    assert row.endswith(" running")


def test_the_state_column_is_the_partitions_phase() -> None:
    """/v1/status names each partition's phase (`sink.consumer.partition.Phase`): the
    summary shows it, where the flags alone said ``paused`` for a held batch, a registry
    wait and an evolution restart alike, and nothing for a shard still opening."""
    for phase in ("opening", "held", "registry_wait", "evolving", "recovering", "fenced"):
        [row] = partition_lines(render_status(status(phase=phase, paused=True)))
        assert row.endswith(f" {phase}"), row
    [row] = partition_lines(
        render_status(status(phase="stopped", stopped="bad message at offset 3: invalid_json"))
    )
    assert row.endswith(" stopped")


def test_base_figures_storage_did_not_answer_for_show_the_last_read() -> None:
    """While table storage does not answer, /v1/status has the base table's figures as
    unknown with the reason and the last ones read (`sink.base_status`)."""
    doc = status()
    doc["base"] = {
        "unindexed_rows": None,
        "error": "table storage has not answered for 3.2 s (a read of the base table is "
        "still in flight)",
        "last_known": {"rows": 5000, "unindexed_rows": 1200, "unindexed_by_index": {}, "age_s": 42},
    }
    line = render_status(doc).splitlines()[-1]
    assert line == (
        "base table: unindexed rows unknown (table storage has not answered for 3.2 s (a read "
        "of the base table is still in flight)); 42 s ago: 1,200 unindexed rows of 5,000"
    )
    del doc["base"]["last_known"]  # storage never answered since the start
    assert render_status(doc).splitlines()[-1].startswith("base table: unindexed rows unknown")


def test_the_summary_says_whether_this_pod_runs_maintenance() -> None:
    """Every pod ran maintenance and nothing said so; one pod does now, and each says which."""
    anchor = {"topic": "orders", "partition": 0}
    lines = {
        role: [
            line
            for line in render_status(
                {**status(), "maintenance": {"role": role, "partition": anchor}}
            ).splitlines()
            if line.startswith("maintenance:")
        ]
        for role in ("active", "standby", "off")
    }
    assert lines == {
        "active": ["maintenance: runs in this pod (it holds orders[0])"],
        "standby": ["maintenance: standby (the pod that holds orders[0] runs it)"],
        "off": ["maintenance: off"],
    }


def test_the_summary_breaks_freshness_down_by_stage() -> None:
    freshness = {
        "fetched": {"p50": 0.004, "p99": 0.012, "samples": 300},
        "decoded": {"p50": 0.006, "p99": 0.02, "samples": 300},
        "durable": {"p50": 0.031, "p99": 0.09, "samples": 300},
        "committed": None,  # no acknowledgement yet
    }
    text = render_status({**status(), "freshness": freshness})
    assert (
        "freshness p50/p99 from the message timestamp: fetched 4/12 ms, decoded 6/20 ms, "
        "durable 31/90 ms"
    ) in text.splitlines()
    nothing = dict.fromkeys(freshness)
    assert "freshness" not in render_status({**status(), "freshness": nothing})
    assert "freshness" not in render_status(status())  # a sink of an earlier build
