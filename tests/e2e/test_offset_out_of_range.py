"""Offsets the broker does not have: a partition whose offset lies past its log end (the
log truncated, or the topic deleted and created again) stops and says why, instead of
jumping back to the log start and taking every offset below the old one for done; a
partition without offsets starts where `kafka.auto_offset_reset` says (the sink assigns it
there itself: librdkafka's own reset is "error")."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.brokers import Broker, free_port
from tests.support.kafka import commit_offsets, committed_offsets, produce
from tests.support.sink import SinkProcess, message, messages, sink_config, table_rows

pytestmark = [pytest.mark.broker, pytest.mark.timeout(180)]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text: str = response.read().decode()
    return text


def test_an_offset_past_the_log_end_stops_its_partition_and_says_why(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    bootstrap = kafka_broker.bootstrap
    produce(bootstrap, topic, messages(0, 10), partition=0)
    produce(bootstrap, topic, messages(10, 10), partition=1)
    # The group stands at 50 on partition 0, whose log ends at 10: what a consumer sees when
    # the topic was created again, or its log truncated, after it read offsets up to 49.
    commit_offsets(bootstrap, group, topic, {0: 50})
    port = free_port()
    config, table = sink_config(
        tmp_path, bootstrap, [topic], group, extra={"observability": {"metrics_port": port}}
    )
    sink = SinkProcess(config, tmp_path / "sink.log")
    try:
        deadline = time.monotonic() + 90
        while committed_offsets(bootstrap, group, topic).get(1) != 10 or (
            "partition_stopped_offset_out_of_range" not in sink.log_path.read_text()
        ):
            assert sink.alive(), sink.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, sink.log_path.read_text()[-3000:]
            time.sleep(0.3)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5)
        body = info.value.read().decode()
        assert f"{topic}[0]: stopped, offset 50 is past the log end 10" in body, body
        stopped = f'lance_sink_partition_stopped{{partition="0",topic="{topic}"}} 1.0'
        assert stopped in scrape(port)
        # Later messages of partition 0 (offsets 10-14) stay unread: nothing below 50 is
        # taken for done.
        produce(bootstrap, topic, messages(20, 5), partition=0)
        time.sleep(2)
        assert committed_offsets(bootstrap, group, topic)[0] == 50
    finally:
        assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    assert sorted(r["n"] for r in table_rows(table)) == list(range(10, 20))
    events = [e for e in sink.events() if e["event"] == "partition_stopped_offset_out_of_range"]
    assert [(e["partition"], e["offset"], e["log_end"]) for e in events] == [(0, 50, 10)]


def test_a_partition_without_offsets_starts_at_the_log_end_with_latest(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    bootstrap = kafka_broker.bootstrap
    produce(bootstrap, topic, messages(0, 5), partition=0)  # before the sink: never read
    config, table = sink_config(
        tmp_path, bootstrap, [topic], group, extra={"kafka": {"auto_offset_reset": "latest"}}
    )
    sink = SinkProcess(config, tmp_path / "sink.log")
    last = 4
    try:
        # One message at a time until the sink has committed one: when it resolved the log
        # end is its own business, so the rows must be a contiguous tail of what came after.
        deadline = time.monotonic() + 90
        while committed_offsets(bootstrap, group, topic).get(0, -1) <= 5:
            assert sink.alive(), sink.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, sink.log_path.read_text()[-3000:]
            last += 1
            produce(bootstrap, topic, [message(last)], partition=0)
            time.sleep(0.3)
        deadline = time.monotonic() + 60
        while committed_offsets(bootstrap, group, topic).get(0) != last + 1:
            assert time.monotonic() < deadline, sink.log_path.read_text()[-3000:]
            time.sleep(0.3)
    finally:
        assert sink.stop() == 0, sink.log_path.read_text()[-3000:]
    got = sorted(r["n"] for r in table_rows(table))
    assert got, "nothing ingested"
    assert got[0] >= 5
    assert got == list(range(got[0], last + 1))
