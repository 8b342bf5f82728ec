"""`/v1/status` answers promptly while table storage is stalled.

The stall is real: the moto S3 server the table lives on is stopped with SIGSTOP (it keeps
accepting connections and never answers, as a hung S3 endpoint does), as in the operations
trial where 4 of 4 status calls timed out after 8 s because every call opened the dataset
and counted its rows with no bound. Now the base table's part is read on one thread at a
time and waited for briefly: it is reported unknown, with why and the last figures read.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pytest

from config import load_settings
from sink.cli import render_status
from sink.service import SinkService
from tests.support.brokers import Broker
from tests.support.sink import DIM, write_config

pytestmark = [pytest.mark.broker, pytest.mark.s3, pytest.mark.timeout(120)]

# Far above the status's own bound (`sink.base_status.BASE_STATUS_TIMEOUT_S`, 1 s) and far
# below what a stalled store holds a read (the store client's timeouts and retries: minutes).
ANSWER_WITHIN_S = 4.0


def answered_within(call: Callable[[], dict[str, Any]], timeout: float) -> dict[str, Any]:
    """`call()`'s result, or fail if it has not returned within `timeout` (it goes on, on a
    daemon thread, so a hanging call fails the test instead of hanging it)."""
    out: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert out, f"status did not answer within {timeout} s while table storage was stalled"
    return out[0]


def base_readers() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "base-status" and t.is_alive())


def test_status_answers_while_table_storage_is_stalled(
    kafka_broker: Broker,
    s3_server: Broker,
    s3_bucket: str,
    s3_storage_options: dict[str, str],
    topic: str,
    group: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert s3_server.process is not None
    for key, value in s3_storage_options.items():
        monkeypatch.setenv(f"LANCE_SINK__TABLE__STORAGE_OPTIONS__{key.upper()}", value)
    table = f"s3://{s3_bucket}/stall/table.lance"
    config = write_config(
        tmp_path / "sink.toml",
        bootstrap=kafka_broker.bootstrap,
        topics=[topic],
        group=group,
        table_uri=table,
    )
    service = SinkService(load_settings(config))  # creates the table
    try:
        rows = pa.Table.from_pylist(
            [
                {"id": f"m-{i}", "n": i, "text": f"t {i}", "vec": [0.0] * DIM}
                | {"_topic": topic, "_partition": 0, "_offset": i}
                for i in range(40)
            ],
            schema=service.engine.spec.table_schema,
        )
        lance.write_dataset(rows, table, mode="append", storage_options=s3_storage_options)
        base = service.board.status()["base"]
        assert (base["rows"], base["unindexed_rows"]) == (40, 0)

        os.kill(s3_server.process.pid, signal.SIGSTOP)
        try:
            for _ in range(4):
                started = time.monotonic()
                status = answered_within(service.board.status, ANSWER_WITHIN_S)
                assert time.monotonic() - started < ANSWER_WITHIN_S
                base = status["base"]
                assert base["unindexed_rows"] is None
                assert "table storage has not answered" in base["error"], base
                assert base["last_known"]["rows"] == 40
                assert base["last_known"]["age_s"] >= 0
                assert "unindexed rows unknown (table storage has not answered" in (
                    render_status(status)
                )
                # One read in flight, however many calls wait on the stalled store.
                assert base_readers() == 1
        finally:
            os.kill(s3_server.process.pid, signal.SIGCONT)

        # Storage answers again: the stalled read ends and the figures are current again.
        deadline = time.monotonic() + 60
        while (base := service.board.status()["base"]).get("unindexed_rows") is None:
            assert time.monotonic() < deadline, base
            time.sleep(0.2)
        assert base["rows"] == 40
        assert "last_known" not in base
    finally:
        service.drain()
