"""`lance-sink demo` runs the whole product to completion, its queries find what they should,
and the `curl` commands it prints answer while it serves."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest

from sink.demo import SERVING
from tests.support.brokers import free_ports
from tests.support.sink import ROOT

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(300)]


def test_demo_runs_to_completion(tmp_path: Path) -> None:
    query_port, metrics_port = free_ports(2)
    result = subprocess.run(
        _demo_args(tmp_path, query_port, metrics_port),
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
    # Not on a terminal: it says plainly that the commands stop answering, and how to serve.
    assert SERVING not in out
    assert "'connection refused'" in out
    assert "`lance-sink demo --serve`" in out


def _demo_args(tmp_path: Path, query_port: int, metrics_port: int) -> list[str]:
    return [
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
    ]


def _lines(stream: IO[str], out: queue.Queue[str]) -> None:
    for line in stream:
        out.put(line)


def test_demo_on_a_terminal_serves_the_commands_it_prints(tmp_path: Path) -> None:
    """On a terminal (stdin a TTY) the demo keeps the sink and the broker up: every `curl`
    command it printed answers, pasted as printed into a shell; Ctrl-C (SIGINT) then drains
    the sink and stops the broker, and the demo exits 0."""
    query_port, metrics_port = free_ports(2)
    tty, tty_peer = os.openpty()
    demo = subprocess.Popen(
        _demo_args(tmp_path, query_port, metrics_port),
        stdin=tty_peer,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    os.close(tty_peer)
    lines: queue.Queue[str] = queue.Queue()
    assert demo.stdout is not None
    reader = threading.Thread(target=_lines, args=(demo.stdout, lines), daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any(SERVING in line for line in seen):
            assert demo.poll() is None, "".join(seen)[-3000:]
            assert time.monotonic() < deadline, "".join(seen)[-3000:]
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        commands = [line.strip() for line in seen if line.startswith("curl ")]
        assert len(commands) == 5, seen
        results = {}
        for command in commands:
            shell = subprocess.run(
                ["bash", "-o", "pipefail", "-c", command],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert shell.returncode == 0, (command, shell.stdout, shell.stderr)
            results[command] = shell.stdout
        search, filtered, lookup, status, metrics = results.values()
        assert json.loads(search)["rows"], search
        rows = json.loads(filtered)["rows"]
        assert rows, filtered
        assert all(r["rating"] >= 4 for r in rows), rows
        assert [r["id"] for r in json.loads(lookup)["rows"]] == ["r-0000042"]
        assert json.loads(status)["partitions"], status
        assert "lance_sink_consumer_lag_messages" in metrics, metrics
        demo.send_signal(signal.SIGINT)
        assert demo.wait(120) == 0, "".join(seen)[-3000:]
    finally:
        if demo.poll() is None:  # a failed assertion: stop it as Ctrl-C would
            demo.send_signal(signal.SIGINT)
            try:
                demo.wait(90)
            except subprocess.TimeoutExpired:
                demo.kill()
                demo.wait()
        reader.join(10)
        demo.stdout.close()
        os.close(tty)
    # Stopped, the sink no longer answers.
    with (
        pytest.raises(ConnectionRefusedError),
        socket.create_connection(("127.0.0.1", query_port), 1),
    ):
        pass
