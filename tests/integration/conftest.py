"""Fixtures of the integration tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from config import load_settings
from sink.service import SinkService
from tests.support.brokers import Broker
from tests.support.sink import write_config


def unstarted_service(
    kafka_broker: Broker,
    topic: str,
    group: str,
    tmp_path: Path,
    extra: dict[str, dict[str, Any]] | None = None,
) -> SinkService:
    """A sink service on `topic` (real broker client, real Lance table), not started: the
    tests set its partitions by hand. `extra` as in `write_config`."""
    config = write_config(
        tmp_path / "sink.toml",
        bootstrap=kafka_broker.bootstrap,
        topics=[topic],
        group=group,
        table_uri=str(tmp_path / "table.lance"),
        extra=extra,
    )
    return SinkService(load_settings(config))


@pytest.fixture
def service(kafka_broker: Broker, topic: str, group: str, tmp_path: Path) -> Iterator[SinkService]:
    """`unstarted_service` with the test defaults, drained after the test."""
    service = unstarted_service(kafka_broker, topic, group, tmp_path)
    try:
        yield service
    finally:
        service.drain()
