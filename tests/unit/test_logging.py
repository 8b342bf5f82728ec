"""structlog is configured once; librdkafka's own log lines come through the same pipeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: str) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh interpreter at the repository root; it must exit 0."""
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


SCRIPT = """
import time, confluent_kafka, structlog
from sink.log import configure_logging, librdkafka_logger
configure_logging("debug", "json")
structlog.get_logger("test").info("bound_event", topic="t", partition=3)
# A client pointed at nothing logs connection failures through librdkafka's logger.
p = confluent_kafka.Producer({"bootstrap.servers": "127.0.0.1:1",
                              "logger": librdkafka_logger(), "reconnect.backoff.ms": 10})
deadline = time.time() + 3
while time.time() < deadline:
    p.poll(0.2)
"""


def test_json_events_and_librdkafka_lines_share_one_pipeline() -> None:
    result = run_script(SCRIPT)
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert result.stdout == ""  # logs go to stderr only
    bound = next(e for e in events if e["event"] == "bound_event")
    assert (bound["topic"], bound["partition"], bound["level"]) == ("t", 3, "info")
    assert "timestamp" in bound
    routed = [e for e in events if e["event"] == "librdkafka_log"]
    assert routed, result.stderr[-2000:]
    assert all("facility" in e and "message" in e for e in routed)


CLIENTS = """
import time
from sink.dlq import DeadLetterProducer
from sink.log import configure_logging
from sink.topic_shards import TopicShards
configure_logging("info", "json")
# The dead-letter producer and the fan-out's topic lister, pointed at nothing.
conf = {"bootstrap.servers": "127.0.0.1:1", "reconnect.backoff.ms": 10}
dlq = DeadLetterProducer(conf, "{topic}.dlq")
shards = TopicShards(conf, ["events"], lambda topic, partition: f"{topic}-{partition}")
shards.start()
deadline = time.time() + 3
while time.time() < deadline:
    dlq.poll()
    time.sleep(0.2)
"""


def test_the_sinks_other_kafka_clients_log_through_the_same_pipeline() -> None:
    """The dead-letter producer and the topic lister printed librdkafka's raw lines
    ('%3|...|FAIL|lance-sink#producer-1| ...') on standard error, beside the JSON events."""
    result = run_script(CLIENTS)
    lines = result.stderr.splitlines()
    assert lines, "the clients logged nothing"
    assert all(line.startswith("{") for line in lines), result.stderr[-2000:]
    events = [json.loads(line) for line in lines]
    assert any(e["event"] == "librdkafka_log" and "FAIL" in e["facility"] for e in events)


SERVER = """
import socket, time
from fastapi import FastAPI
from sink.http import run_server
from sink.log import configure_logging
configure_logging("info", "json")
app = FastAPI()

@app.get("/boom")
def boom():
    raise RuntimeError("boom")

handle = run_server(app, "127.0.0.1", 0)
for request in (b"NOT HTTP AT ALL\\r\\n\\r\\n", b"GET /boom HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n"):
    with socket.create_connection(("127.0.0.1", handle.port)) as s:
        s.sendall(request)
        s.settimeout(5)
        s.recv(100)
handle.stop()
"""


def test_the_http_servers_own_warnings_and_errors_are_json_events() -> None:
    """uvicorn's warnings (a request it cannot read) and errors (an exception in a handler,
    with its traceback) were plain text lines on stderr, outside the JSON log stream."""
    result = run_script(SERVER)
    events = [json.loads(line) for line in result.stderr.splitlines()]  # every line is JSON
    library = [e for e in events if e["event"] == "library_log"]
    assert [(e["logger"], e["level"], e["message"]) for e in library] == [
        ("uvicorn.error", "warning", "Invalid HTTP request received."),
        ("uvicorn.error", "error", "Exception in ASGI application"),
    ]
    assert library[1]["exception"].rstrip().endswith("RuntimeError: boom")
