"""The `lance-sink` command line as an operator meets it: exit codes and what reaches standard
output and standard error (each command in a process of its own, as it runs)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.sink import minimal_config

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("LANCE_SINK__")}


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env if env is not None else _env(),
        timeout=120,
        check=False,
    )


# --- run: a port another process holds ------------------------------------------------------


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port on 127.0.0.1 that another socket listens on for the whole test."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize(
    ("held", "key"),
    [
        ("metrics", "observability.metrics_port"),
        ("query", "query.port"),
        ("both", "query.port and observability.metrics_port"),
    ],
)
def test_a_port_in_use_stops_the_start_with_one_line_naming_the_key(
    tmp_path: Path, held_port: int, held: str, key: str, command: str
) -> None:
    """A metrics or query port that another process holds is a start failure (exit 1) said
    in one line naming the setting and the port; it was a RuntimeError traceback ("query
    server did not start"), for the metrics port too."""
    metrics_port = held_port if held in {"metrics", "both"} else 0
    query_port = held_port if held in {"query", "both"} else 0
    config = minimal_config(
        tmp_path / "sink.toml",
        {
            "maintenance": {"enabled": False},
            "observability": {
                "metrics_host": "127.0.0.1",
                "metrics_port": metrics_port,
                "log_format": "json",
            },
            "query": {"host": "127.0.0.1", "port": query_port},
        },
    )
    result = _run("-m", "sink.cli", command, "--config", str(config))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    [line] = [s for s in result.stderr.splitlines() if s.startswith("lance-sink:")]
    assert line == (
        f"lance-sink: {key} ({held_port}): cannot listen on 127.0.0.1:{held_port}: "
        "Address already in use"
    )
    [failed] = [json.loads(s) for s in result.stderr.splitlines() if '"startup_failed"' in s]
    assert (failed["key"], failed["port"]) == (key, held_port)


def test_serve_refuses_a_config_with_the_query_api_off(tmp_path: Path) -> None:
    config = minimal_config(tmp_path / "sink.toml", {"query": {"enabled": False}})
    result = _run("-m", "sink.cli", "serve", "--config", str(config))
    assert result.returncode == 2, result.stderr
    assert f"query.enabled (file {config}): `lance-sink serve` serves the query" in result.stderr


# --- lag: the report is the output --------------------------------------------------------

#: `lance-sink lag` with the group's offsets faked: reading them logs what a real read of the
#: table's commits does (a debug `transaction_undecodable`) and a warning.
LAG_WITH_LOGS = """
import sys

import structlog

import sink.lag
from engine.table import transaction_properties
from sink.lag import PartitionLag


class Undecodable:
    def read_transaction(self, version):
        raise TypeError("RewrittenIndex.__init__() missing 1 required positional argument")


def group_lag(conf, group, topics, **kwargs):
    assert transaction_properties(Undecodable(), 7) == {}
    structlog.get_logger("lance_sink.test").warning("lag_test_warning")
    return [PartitionLag("events", 0, start=0, end=10, committed=4)]


sink.lag.group_lag = group_lag
from sink.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("with_config", [False, True])
def test_lag_prints_its_report_and_only_warnings_to_stderr(
    tmp_path: Path, with_config: bool
) -> None:
    """`lance-sink lag` configures logging as `run` does: warnings and above on standard
    error, so the report (JSON here) is all of standard output. It never configured it, and
    structlog's default printed every debug line (`transaction_undecodable` while reading
    the table's commits) onto the report."""
    script = tmp_path / "lag_with_logs.py"
    script.write_text(LAG_WITH_LOGS)
    if with_config:
        config = minimal_config(
            tmp_path / "sink.toml",
            {"observability": {"log_level": "debug", "log_format": "json"}},
        )
        args = ["--config", str(config)]
    else:
        args = ["--bootstrap", "127.0.0.1:1", "--group", "g", "--topic", "events"]
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = _run(str(script), "lag", *args, "--json", env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # nothing but the report
    assert report["total_lag"] == 6
    assert "transaction_undecodable" not in result.stdout + result.stderr
    assert "lag_test_warning" in result.stderr
