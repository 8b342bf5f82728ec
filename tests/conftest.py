"""Session fixtures: real brokers (mock cluster, tansu, or KAFKA_BOOTSTRAP) and a real S3 API.

Broker-backed tests use the `kafka_broker` fixture (KAFKA_BOOTSTRAP if set, else librdkafka's
mock cluster in a child process) or ask for `mock_broker` / `tansu_broker` by name. When a
broker cannot be started the fixture raises, so those tests error instead of skipping.

At the end of the session the number of passed tests per marker is written to
`build/test-tiers.json`; `.ci/run` fails when the broker tier passed zero tests.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.brokers import Broker, start_mock_cluster, start_moto, start_tansu
from tests.support.sink import SinkProcess

ROOT = Path(__file__).resolve().parents[1]
_passed_by_marker: Counter[str] = Counter()


@pytest.fixture(scope="session")
def broker_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("broker-logs")


@pytest.fixture(scope="session")
def mock_broker(broker_log_dir: Path) -> Iterator[Broker]:
    broker = start_mock_cluster(broker_log_dir)
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def tansu_broker(broker_log_dir: Path) -> Iterator[Broker]:
    broker = start_tansu(broker_log_dir)
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def kafka_broker(request: pytest.FixtureRequest) -> Broker:
    """KAFKA_BOOTSTRAP if set (bring your own cluster), else the mock cluster."""
    external = os.environ.get("KAFKA_BOOTSTRAP")
    if external:
        return Broker("external", external)
    broker: Broker = request.getfixturevalue("mock_broker")
    return broker


@pytest.fixture(scope="session")
def s3_server(broker_log_dir: Path) -> Iterator[Broker]:
    server = start_moto(broker_log_dir)
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: Broker) -> str:
    """A fresh bucket on the moto server; returns its name."""
    import boto3  # noqa: PLC0415 - boto3 comes with moto[server] (dev only)

    name = f"b-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_server.bootstrap,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_storage_options(s3_server: Broker) -> dict[str, str]:
    """Object-store options (obstore and Lance spell them alike) for the moto server."""
    return {
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "aws_region": "us-east-1",
        "aws_endpoint": s3_server.bootstrap,
        "allow_http": "true",
    }


@pytest.fixture
def topic() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def group() -> str:
    return f"g-{uuid.uuid4().hex[:12]}"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.passed:
        for marker in ("broker", "s3", "slow", "helm"):
            if marker in report.keywords:
                _passed_by_marker[marker] += 1
        _passed_by_marker["all"] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = ROOT / "build" / "test-tiers.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(dict(_passed_by_marker), sort_keys=True) + "\n")


@pytest.fixture(autouse=True)
def kill_leftover_sinks() -> Iterator[None]:
    """Kill the `lance-sink` child processes a test left running (see `SinkProcess`)."""
    yield
    SinkProcess.kill_leftovers()
