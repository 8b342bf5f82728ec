"""`lance-sink demo` runs the whole product to completion and its queries find what they should."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.brokers import free_ports
from tests.support.sink import ROOT

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]


def test_demo_runs_to_completion(tmp_path: Path) -> None:
    query_port, metrics_port = free_ports(2)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sink.cli",
            "demo",
            "--messages",
            "2000",
            "--dir",
            str(tmp_path / "demo"),
            "--query-port",
            str(query_port),
            "--metrics-port",
            str(metrics_port),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=280,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "caught up: 2000 reviews" in out
    for kind in ("vector (kNN", "full-text", "filter:", "lookup:"):
        line = next(line for line in out.splitlines() if line.startswith(kind))
        assert line.endswith("OK"), line
    assert "UNEXPECTED" not in out
    assert '"id": "r-0000007"' in out  # the probe's own review comes back first
    assert (tmp_path / "demo" / "reviews.lance").is_dir()
    assert f"http://127.0.0.1:{metrics_port}/metrics" in out
