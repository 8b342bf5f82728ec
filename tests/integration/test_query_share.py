"""A writer pod's consumer loop yields to the queries running on it (`sink.query_share`),
with a real broker client, real shard writers and a real Lance table."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from sink.query_share import MAX_PAUSE_S
from tests.integration.conftest import unstarted_service
from tests.support.brokers import Broker
from tests.support.kafka import produce
from tests.support.sink import messages

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]

MESSAGES = 20_000


def test_the_loop_pauses_while_a_query_runs_and_still_ingests(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    produce(kafka_broker.bootstrap, topic, messages(0, MESSAGES))
    service = unstarted_service(kafka_broker, topic, group, tmp_path)
    registry = service.metrics.registry

    def paused() -> float:
        return registry.get_sample_value("lance_sink_ingest_paused_seconds_total") or 0.0

    service.share.enter()  # a query runs on this pod, as the query pools count them in
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while service.metrics.rows_total < 1_000 or paused() <= 0:
            assert time.monotonic() < deadline, (service.metrics.rows_total, paused())
            time.sleep(0.02)
        # Ingestion went on at its share (no query starves the sink), and it paused.
        assert service.metrics.rows_total < MESSAGES
        service.share.leave()
        after_leaving = paused()
        while service.metrics.rows_total < MESSAGES:
            assert time.monotonic() < deadline, service.metrics.rows_total
            time.sleep(0.02)
        # With no query running, the loop stopped pausing (one pause may have been owed
        # by the iteration running as the query ended).
        assert paused() <= after_leaving + MAX_PAUSE_S
    finally:
        service.stop()
        thread.join(timeout=60)
    assert not thread.is_alive()
