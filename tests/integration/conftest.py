"""Fixtures of the integration tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from config import load_settings
from sink.service import SinkService
from tests.support.brokers import Broker
from tests.support.sink import write_config


@pytest.fixture
def service(kafka_broker: Broker, topic: str, group: str, tmp_path: Path) -> Iterator[SinkService]:
    """A sink service on `topic` (real broker client, real Lance table), not started: the
    tests set its partitions by hand."""
    config = write_config(
        tmp_path / "sink.toml",
        bootstrap=kafka_broker.bootstrap,
        topics=[topic],
        group=group,
        table_uri=str(tmp_path / "table.lance"),
    )
    service = SinkService(load_settings(config))
    try:
        yield service
    finally:
        service._drain()
