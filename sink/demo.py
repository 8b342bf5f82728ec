"""`lance-sink demo`: the whole product on an embedded default, in one command.

1. Starts an embedded Kafka-protocol broker: librdkafka's mock cluster in a child process.
2. Produces a synthetic stream of product reviews (id, title, text of real words, category,
   rating, and a 384-dim embedding that is the normalised mean of deterministic per-word
   vectors, so reviews sharing words are near each other; no model download).
3. Runs the real sink (`lance-sink run`, a child process) with the quickstart config into a
   local Lance table, and shows live progress from its status endpoint.
4. When caught up, runs one vector, one full-text, one filtered and one lookup query through
   the HTTP API, checks that each returns the documents it should, and prints them with
   `curl` commands for the query API, the status and the metrics.
5. Keeps the sink and the broker serving those commands until Ctrl-C when it runs on a
   terminal (stdin is a TTY) or with `--serve`; `--follow` also keeps producing. Otherwise
   (a script, CI) it says so and stops them. Ctrl-C drains the sink (SIGTERM), then stops the
   broker: the sink and the broker run in their own sessions, so the terminal's Ctrl-C reaches
   only the demo, which stops them in that order.

The broker is the mock cluster, which keeps only ~5 MiB per partition: the stream is
produced at a bounded rate (`--rate`) that the sink keeps up with.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import logging
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka
import numpy as np
from rich.console import Console
from rich.live import Live
from rich.table import Table

DIM = 384
TOPIC = "reviews"


def _words(text: str) -> list[str]:
    return text.split()


CATEGORIES: dict[str, list[str]] = {
    "books": _words(
        "novel author chapter plot characters story writing pages ending reader "
        "mystery romance history biography poetry fiction series library paperback"
    ),
    "kitchen": _words(
        "knife pan blender recipe cooking kettle oven spatula coffee grinder "
        "dishwasher skillet toaster cutting board steel nonstick sharp boil"
    ),
    "garden": _words(
        "hose shovel seeds soil plants flowers lawn mower rake pruning tomatoes "
        "compost watering greenhouse trowel fertilizer weeds roses"
    ),
    "electronics": _words(
        "battery screen charger headphones speaker bluetooth laptop camera "
        "cable keyboard mouse monitor wireless sound resolution usb processor"
    ),
    "toys": _words(
        "puzzle lego doll blocks kids game board pieces plush robot train cars "
        "building colorful birthday gift toddler educational"
    ),
}
COMMON = _words(
    "great good excellent poor terrible quality price value works broke fast slow love "
    "hate recommend returned perfect cheap sturdy would again bought"
)
_ADDRESS = re.compile(r"replaced with (\S+)")


def word_vector(word: str) -> np.ndarray:
    """A deterministic unit vector per word (seeded by the word's hash)."""
    seed = int.from_bytes(hashlib.sha256(word.encode()).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


class Embedder:
    """Hashed word vectors averaged per document: same words -> near vectors."""

    def __init__(self) -> None:
        self._cache: dict[str, np.ndarray] = {}

    def __call__(self, text: str) -> list[float]:
        words = re.findall(r"[a-z]+", text.lower())
        vecs = [self._cache.setdefault(w, word_vector(w)) for w in words] or [word_vector("")]
        mean = np.mean(vecs, axis=0)
        return [round(float(x), 5) for x in mean / np.linalg.norm(mean)]


def review(i: int, embed: Embedder) -> dict[str, Any]:
    """Review number `i`: deterministic, category-flavoured words."""
    rng = np.random.default_rng(i)
    category = list(CATEGORIES)[i % len(CATEGORIES)]
    words = CATEGORIES[category]
    title = " ".join(rng.choice(words, 2)) + " " + str(rng.choice(COMMON))
    body = " ".join(
        [str(w) for w in rng.choice(words, 14)] + [str(w) for w in rng.choice(COMMON, 8)]
    )
    return {
        "id": f"r-{i:07d}",
        "title": title,
        "text": body,
        "category": category,
        "rating": int(rng.integers(1, 6)),
        "embedding": embed(f"{title} {body}"),
    }


# ------------------------------------------------------------------------------ broker


def serve_mock_broker() -> None:
    """Child-process entry: hold a mock cluster open, print its address, run until killed."""
    found = threading.Event()

    class _Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            match = _ADDRESS.search(record.getMessage())
            if match and not found.is_set():
                print(f"BOOTSTRAP {match.group(1)}", flush=True)  # noqa: T201 - to the parent
                found.set()

    logger = logging.getLogger("lance_sink.demo.broker")
    logger.addHandler(_Grab())
    logger.setLevel(logging.DEBUG)
    producer = confluent_kafka.Producer({"test.mock.num.brokers": 1, "logger": logger})
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        producer.poll(0.5)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _stop_with_parent() -> None:
    """In a child before exec: SIGTERM it when the demo dies, even by SIGKILL (Linux).

    The children run in their own sessions, so nothing else would stop them."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: Ctrl-C still stops them
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _child(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Start a demo child (broker or sink) in its own session, stopped with the demo: a
    terminal's Ctrl-C reaches only the demo, which drains the sink, then stops the broker."""
    return subprocess.Popen(
        args,
        start_new_session=True,
        preexec_fn=_stop_with_parent,  # noqa: PLW1509 - both start before the demo's threads
        **kwargs,
    )


def start_broker() -> tuple[subprocess.Popen[bytes], str]:
    proc = _child(
        [sys.executable, "-m", "sink.demo", "--serve-broker"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("BOOTSTRAP "):
        proc.kill()
        raise RuntimeError(f"the embedded broker did not start: {line!r}")
    return proc, line.split()[1]


# ------------------------------------------------------------------------------ demo


def write_config(
    path: Path, bootstrap: str, data: Path, query_port: int, metrics_port: int
) -> Path:
    """The quickstart config, pointed at the embedded broker and the demo directory."""
    example = Path(__file__).resolve().parents[1] / "config" / "examples" / "quickstart.toml"
    text = example.read_text()
    text = text.replace(
        'bootstrap_servers = "localhost:9092"', f'bootstrap_servers = "{bootstrap}"'
    )
    text = text.replace('uri = "./data/reviews.lance"', f'uri = "{data / "reviews.lance"}"')
    text = text.replace("port = 8080", f"port = {query_port}")
    text = text.replace("metrics_port = 9102", f"metrics_port = {metrics_port}")
    text = text.replace("[observability]\n", '[observability]\nlog_format = "json"\n')
    path.write_text(text)
    return path


def http(method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(  # noqa: S310 - a local URL this demo built
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310
        return json.loads(resp.read())


def produce(
    bootstrap: str, start: int, count: int, rate: float, stop: threading.Event
) -> Iterator[int]:
    """Produce reviews start..start+count-1 (at most `rate` per second); yields progress."""
    embed = Embedder()
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    began = time.monotonic()
    for i in range(start, start + count):
        if stop.is_set():
            break
        doc = review(i, embed)
        while True:
            try:
                producer.produce(TOPIC, key=doc["id"].encode(), value=json.dumps(doc).encode())
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
        if rate > 0:
            ahead = (i - start + 1) / rate - (time.monotonic() - began)
            if ahead > 0:
                time.sleep(ahead)
        if (i + 1) % 500 == 0:
            yield i + 1
    producer.flush(60)
    yield start + count


def progress_table(status: dict[str, Any], produced: int, rate: float) -> Table:
    table = Table(title="lance-sink demo", expand=False)
    for col in ("produced", "committed", "commit lag", "rows/s", "memtable", "frozen", "flushes"):
        table.add_column(col, justify="right")
    parts = status.get("partitions", [])
    committed = sum(max(p.get("committed", 0), 0) for p in parts)
    lag = sum((p.get("lag") or {}).get("commit", 0) for p in parts)
    mem = sum((p.get("memtable") or {}).get("bytes", 0) for p in parts)
    frozen = sum((p.get("memtable") or {}).get("frozen_count", 0) for p in parts)
    flushes = sum((p.get("flush") or {}).get("flushes", 0) for p in parts)
    table.add_row(
        str(produced),
        str(committed),
        str(lag),
        f"{rate:,.0f}",
        f"{mem / 1e6:.1f} MB",
        str(frozen),
        str(flushes),
    )
    return table


def caught_up(status: dict[str, Any], produced: int) -> bool:
    parts = status.get("partitions", [])
    return bool(parts) and sum(max(p.get("committed", 0), 0) for p in parts) >= produced


def run_queries(base: str, console: Console) -> bool:
    """One query of each kind; returns True when each found what it should."""
    embed = Embedder()
    ok = True
    probe = review(7, embed)
    checks: list[tuple[str, str, dict[str, Any], Any]] = [
        (
            "vector (kNN, k=5) with the embedding of review r-0000007",
            "/v1/search",
            {"vector": probe["embedding"], "k": 5, "columns": ["id", "title", "category"]},
            lambda rows: rows and rows[0]["id"] == probe["id"],
        ),
        (
            "full-text: 'mystery novel'",
            "/v1/search",
            {"text": "mystery novel", "k": 5, "columns": ["id", "title", "category"]},
            lambda rows: rows and all(r["category"] == "books" for r in rows),
        ),
        (
            "filter: category = 'garden' AND rating >= 4",
            "/v1/search",
            {
                "filter": "category = 'garden' AND rating >= 4",
                "k": 5,
                "columns": ["id", "category", "rating"],
            },
            lambda rows: rows and all(r["category"] == "garden" and r["rating"] >= 4 for r in rows),
        ),
        (
            "lookup: r-0000001, r-0000002, r-0000003",
            "/v1/lookup",
            {"keys": ["r-0000001", "r-0000002", "r-0000003"], "columns": ["id", "title"]},
            lambda rows: sorted(r["id"] for r in rows) == ["r-0000001", "r-0000002", "r-0000003"],
        ),
    ]
    for label, path, body, expect in checks:
        result = http("POST", base + path, body)
        rows = result["rows"]
        good = bool(expect(rows))
        ok &= good
        console.print(
            f"\n[bold]{label}[/bold]  ({result['took_ms']:.1f} ms) {'OK' if good else 'UNEXPECTED'}"
        )
        for r in rows[:5]:
            console.print("  " + json.dumps(r))
    return ok


def commands(query: str, metrics: str) -> list[str]:
    """The `curl` commands the demo prints for a newcomer to paste (tested verbatim)."""
    post = "curl -s {url} -H 'content-type: application/json' -d '{body}'"
    return [
        post.format(url=f"{query}/v1/search", body='{"text": "sharp knife", "k": 3}'),
        post.format(
            url=f"{query}/v1/search",
            body='{"text": "mystery novel", "filter": "rating >= 4", "k": 3}',
        ),
        post.format(url=f"{query}/v1/lookup", body='{"keys": ["r-0000042"]}'),
        f"curl -s {metrics}/v1/status",
        f"curl -s {metrics}/metrics | grep _lag_messages",
    ]


#: Ends the line after which the demo serves until Ctrl-C (tests wait for it).
SERVING = "the commands above work until Ctrl-C"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lance-sink demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000, help="reviews to produce")
    parser.add_argument("--rate", type=float, default=2_000, help="reviews per second (0 = max)")
    parser.add_argument(
        "--follow", action="store_true", help="keep producing and serving until Ctrl-C"
    )
    parser.add_argument(
        "--serve",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the sink and the broker up for queries until Ctrl-C (default: when stdin "
        "is a terminal)",
    )
    parser.add_argument("--dir", type=Path, default=Path("demo-data"), help="where data lives")
    parser.add_argument("--query-port", type=int, default=8080)
    parser.add_argument("--metrics-port", type=int, default=9102)
    parser.add_argument("--serve-broker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_broker:
        serve_mock_broker()
        return 0
    # Ctrl-C and SIGTERM both stop the demo the same way: drain the sink, stop the broker.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    console = Console()
    data = args.dir.resolve()
    if data.exists():
        shutil.rmtree(data)
    data.mkdir(parents=True)
    broker, bootstrap = start_broker()
    console.print(f"embedded Kafka-protocol broker (librdkafka mock cluster) at {bootstrap}")
    config = write_config(data / "sink.toml", bootstrap, data, args.query_port, args.metrics_port)
    log_path = data / "sink.log"
    log_file = log_path.open("wb")
    sink = _child(
        [sys.executable, "-m", "sink.cli", "run", "--config", str(config)],
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    stop = threading.Event()
    metrics = f"http://127.0.0.1:{args.metrics_port}"
    query = f"http://127.0.0.1:{args.query_port}"
    code = 1
    try:
        produced = [0]

        def producing() -> None:
            start = 0
            while True:
                for n in produce(bootstrap, start, args.messages, args.rate, stop):
                    produced[0] = n
                start += args.messages
                if not args.follow or stop.is_set():
                    return

        producer = threading.Thread(target=producing, daemon=True)
        producer.start()
        last, last_t, rate = 0, time.monotonic(), 0.0
        with Live(console=console, refresh_per_second=4) as live:
            while True:
                if sink.poll() is not None:
                    raise RuntimeError(f"the sink exited ({sink.returncode}); see {log_path}")
                with contextlib.suppress(OSError, ValueError):
                    status = http("GET", metrics + "/v1/status")
                    committed = sum(max(p.get("committed", 0), 0) for p in status["partitions"])
                    now = time.monotonic()
                    rate = 0.7 * rate + 0.3 * (committed - last) / max(now - last_t, 1e-3)
                    last, last_t = committed, now
                    live.update(progress_table(status, produced[0], rate))
                    if not producer.is_alive() and caught_up(status, produced[0]):
                        break
                time.sleep(0.25)
        console.print(f"\ncaught up: {produced[0]} reviews are durable, committed and searchable")
        ok = run_queries(query, console)
        console.print(
            f"\ndata: Lance table {data / 'reviews.lance'} (WAL in its _lance_sink folder)\n"
            f"metrics: {metrics}/metrics   status: {metrics}/v1/status   logs: {log_path}",
            soft_wrap=True,
        )
        on_terminal = sys.stdin is not None and sys.stdin.isatty()
        serve = args.follow or (on_terminal if args.serve is None else args.serve)
        console.print("\ntry it (from another terminal, while the demo serves):")
        for command in commands(query, metrics):
            # Plain output: no markup or wrapping, so a command pastes as printed.
            console.print(command, soft_wrap=True, markup=False, highlight=False)
        if serve:
            what = "producing more reviews and serving" if args.follow else "serving"
            console.print(f"\n{what} queries and metrics: {SERVING}", markup=False)
            with contextlib.suppress(KeyboardInterrupt):
                while sink.poll() is None:
                    time.sleep(0.5)
            if sink.returncode is not None:
                raise RuntimeError(f"the sink exited ({sink.returncode}); see {log_path}")
        else:
            console.print(
                "\nstopping the sink and the broker now (stdin is not a terminal), so the "
                "commands above get 'connection refused' from here on. `lance-sink demo "
                "--serve` (or `--follow`, or running it on a terminal) keeps them up until "
                "Ctrl-C.",
                markup=False,
            )
        code = 0 if ok else 1
    except KeyboardInterrupt:
        code = 130
    finally:
        stop.set()
        if sink.poll() is None:
            sink.send_signal(signal.SIGTERM)
            try:
                sink.wait(60)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):  # or a second Ctrl-C
                sink.kill()
                sink.wait()
        log_file.close()
        broker.terminate()
        broker.wait(10)
        if broker.stdout is not None:
            broker.stdout.close()
    if sink.returncode not in (0, None) and code == 0:
        code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
