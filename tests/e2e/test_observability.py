"""Observability against a real broker and a real sink process: lags that match what Kafka
reports, series removed on revoke, readiness during replay, the lag CLI, stable metric names,
and logs without secrets."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.brokers import Broker, free_port, free_ports
from tests.support.kafka import committed_offsets, end_offsets, produce
from tests.support.sink import ROOT, SinkProcess, messages, wait_caught_up, write_config

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(400)]

SAMPLE = re.compile(r"^(lance_sink_\w+)\{([^}]*)\} (\S+)$")
LABEL = re.compile(r'(\w+)="([^"]*)"')


def scrape(port: int) -> dict[str, dict[int, float]]:
    """Per-partition samples of every lance_sink metric: name -> partition -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, dict[int, float]] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = dict(LABEL.findall(m.group(2)))
            if "partition" in labels:
                out.setdefault(m.group(1), {})[int(labels["partition"])] = float(m.group(3))
    return out


def get(port: int, path: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def wait_http(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            get(port, "/healthz")
        except OSError:
            time.sleep(0.1)
        else:
            return
    raise TimeoutError("the sink's HTTP endpoint did not come up")


def sink_config(
    tmp_path: Path, broker: Broker, topic: str, group: str, port: int, **extra: object
) -> Path:
    sections: dict[str, dict[str, object]] = {"observability": {"metrics_port": port}}
    for key, value in extra.items():
        section, _, name = key.partition("__")
        sections.setdefault(section, {})[name] = value
    return write_config(
        tmp_path / f"sink-{port}.toml",
        bootstrap=broker.bootstrap,
        topics=[topic],
        group=group,
        table_uri=str(tmp_path / "table.lance"),
        extra=sections,
    )


def test_exported_lag_matches_the_broker(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    port = free_port()
    produce(kafka_broker.bootstrap, topic, messages(0, 2000))
    sink = SinkProcess(sink_config(tmp_path, kafka_broker, topic, group, port), tmp_path / "s.log")
    stop = threading.Event()
    rate = 400  # messages per second while the test samples

    def load() -> None:
        i = 2000
        while not stop.is_set():
            produce(kafka_broker.bootstrap, topic, messages(i, rate // 10))
            i += rate // 10
            time.sleep(0.1)

    producer = threading.Thread(target=load, daemon=True)
    try:
        wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
        producer.start()
        # Under load: each sample agrees with the broker within what one scrape interval
        # (1 s of metrics refresh + 1 s of commits) lets through.
        for _ in range(5):
            time.sleep(1.0)
            metrics = scrape(port)
            truth_end = end_offsets(kafka_broker.bootstrap, topic)
            truth_committed = committed_offsets(kafka_broker.bootstrap, group, topic)
            slack = 3 * rate
            for p in range(4):
                assert abs(metrics["lance_sink_committed_offset"][p] - truth_committed[p]) <= slack
                assert abs(metrics["lance_sink_log_end_offset"][p] - truth_end[p]) <= slack
                assert metrics["lance_sink_commit_lag_messages"][p] <= slack
        stop.set()
        producer.join(30)
        # Freshness by stage, from each batch's oldest message timestamp: the three stages
        # up to durable are recorded together for every put, so their percentiles keep the
        # path's order; committed follows the group's acknowledgements.
        _, status = get(port, "/v1/status")
        freshness = status["freshness"]
        assert isinstance(freshness, dict)
        assert list(freshness) == ["fetched", "decoded", "durable", "committed"]
        for stage in freshness.values():
            assert stage["samples"] > 0, freshness
            assert 0 <= stage["p50"] <= stage["p99"] < 30, freshness
        for percentile in ("p50", "p99"):
            fetched, decoded, durable = (freshness[s][percentile] for s in list(freshness)[:3])
            assert fetched <= decoded <= durable, freshness
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        for stage in freshness:
            count = f'lance_sink_freshness_stage_seconds_count{{stage="{stage}"}}'
            assert count in text.decode(), stage
        # Idle: lags are exactly zero and every offset equals what Kafka reports.
        ends = wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
        deadline = time.monotonic() + 20
        while True:  # within a scrape interval or two of the broker's truth
            metrics = scrape(port)
            if all(
                metrics["lance_sink_committed_offset"][p] == ends[p]
                and metrics["lance_sink_log_end_offset"][p] == ends[p]
                for p in range(4)
            ):
                break
            assert time.monotonic() < deadline, metrics
            time.sleep(0.5)
        committed = committed_offsets(kafka_broker.bootstrap, group, topic)
        for p in range(4):
            assert metrics["lance_sink_log_end_offset"][p] == ends[p]
            assert metrics["lance_sink_committed_offset"][p] == committed[p] == ends[p]
            assert metrics["lance_sink_durable_offset"][p] == ends[p]
            assert metrics["lance_sink_consumer_lag_messages"][p] == 0
            assert metrics["lance_sink_durable_lag_messages"][p] == 0
            assert metrics["lance_sink_commit_lag_messages"][p] == 0
            assert metrics["lance_sink_partition_paused"][p] == 0
        # The lag CLI agrees with the broker, and its exit code honours --max-lag.
        cli = [
            sys.executable,
            "-m",
            "sink.cli",
            "lag",
            "--bootstrap",
            kafka_broker.bootstrap,
            "--group",
            group,
            "--topic",
            topic,
            "--json",
        ]
        out = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert {p["partition"]: p["end"] for p in report["partitions"]} == ends
        assert {p["partition"]: p["committed"] for p in report["partitions"]} == committed
        assert report["total_lag"] == 0
    finally:
        stop.set()
        assert sink.stop() == 0


def test_lag_cli_counts_and_thresholds(kafka_broker: Broker, topic: str, group: str) -> None:
    produce(kafka_broker.bootstrap, topic, messages(0, 100), partition=1)
    base = [
        sys.executable,
        "-m",
        "sink.cli",
        "lag",
        "--bootstrap",
        kafka_broker.bootstrap,
        "--group",
        group,
        "--topic",
        topic,
    ]
    table = subprocess.run(base, capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
    assert table.returncode == 0, table.stderr
    assert re.search(rf"{topic}\s+1\s+100\s+-\s+100", table.stdout)
    assert re.search(r"TOTAL\s+100", table.stdout)
    above = subprocess.run(
        [*base, "--max-lag", "99"], capture_output=True, cwd=ROOT, timeout=60, check=False
    )
    assert above.returncode == 4
    at = subprocess.run(
        [*base, "--max-lag", "100"], capture_output=True, cwd=ROOT, timeout=60, check=False
    )
    assert at.returncode == 0


def test_revoked_series_disappear_and_readyz_flips_during_replay(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    produce(kafka_broker.bootstrap, topic, messages(0, 400))
    port_a, port_b = free_ports(2)
    controller = {"backpressure__controller": "tests.support.slow:controller"}
    a = SinkProcess(
        sink_config(tmp_path, kafka_broker, topic, group, port_a, **controller),
        tmp_path / "a.log",
        env={"LANCE_SINK_TEST_REPLAY_DELAY_S": "3"},
    )
    b: SinkProcess | None = None
    try:
        wait_http(port_a)
        seen_not_ready = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            code, body = get(port_a, "/readyz")
            if code == 503 and any("replaying" in r for r in body["reasons"]):  # type: ignore[union-attr]
                seen_not_ready = True
            if code == 200:
                break
            time.sleep(0.2)
        assert seen_not_ready, "readiness never reported the replay"
        assert get(port_a, "/readyz")[0] == 200
        assert get(port_a, "/healthz")[0] == 200
        wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[a])
        deadline = time.monotonic() + 15  # lags appear with the first broker statistics
        while set(scrape(port_a).get("lance_sink_commit_lag_messages", {})) != {0, 1, 2, 3}:
            assert time.monotonic() < deadline, scrape(port_a)
            time.sleep(0.3)
        b = SinkProcess(
            sink_config(tmp_path, kafka_broker, topic, group, port_b), tmp_path / "b.log"
        )
        wait_http(port_b)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            mine = set(scrape(port_a).get("lance_sink_commit_lag_messages", {}))
            theirs = set(scrape(port_b).get("lance_sink_commit_lag_messages", {}))
            if len(mine) == 2 and len(theirs) == 2:
                break
            time.sleep(0.5)
        assert len(mine) == 2, mine  # the revoked partitions' series are gone
        assert mine.isdisjoint(theirs)
        assert mine | theirs == {0, 1, 2, 3}
        status = subprocess.run(
            [sys.executable, "-m", "sink.cli", "status", "--url", f"http://127.0.0.1:{port_a}"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=30,
            check=False,
        )
        assert status.returncode == 0, status.stderr
        assert "ready: yes" in status.stdout
        assert f"{topic}[" in status.stdout
    finally:
        assert a.stop() == 0
        if b is not None:
            assert b.stop() == 0


def test_logs_never_contain_secrets(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    secrets = {
        "LANCE_SINK__KAFKA__SASL_PASSWORD": "pw-7f3a9c1e",
        "LANCE_SINK__QUERY__AUTH_TOKEN": "tok-51d0b2aa",
        "LANCE_SINK__TABLE__STORAGE_OPTIONS__AWS_SECRET_ACCESS_KEY": "sk-99e1c4d7",
    }
    produce(kafka_broker.bootstrap, topic, messages(0, 200))
    port = free_port()
    sink = SinkProcess(
        sink_config(tmp_path, kafka_broker, topic, group, port, observability__log_level="debug"),
        tmp_path / "s.log",
        env=secrets,
    )
    try:
        wait_caught_up(kafka_broker.bootstrap, group, topic, procs=[sink])
    finally:
        assert sink.stop() == 0
    text = sink.log_path.read_text()
    assert "config_loaded" in text  # the effective config was logged, redacted
    for value in secrets.values():
        assert value not in text
    for line in text.splitlines():
        assert "message number" not in line  # no payloads either
