"""The `lance-sink` command line: parse settings, build the service, run it.

Exit codes:
    0  success (for `run`: stopped by SIGTERM/SIGINT and drained)
    1  runtime failure: a fatal error stopped the service (fenced everywhere, table schema
       incompatible, authentication failure, ...); the message says which
    2  invalid configuration or usage (the message names key, source and reason)
    3  the command is not implemented yet
    4  `lag`: the lag (at `--level`) is above `--max-lag`
    130  `run` was interrupted by a second signal before the drain finished (what was not
       committed is replayed or re-read on the next start; nothing acknowledged is lost)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import confluent_kafka
import structlog
from pydantic import ValidationError

from config import (
    ConfigError,
    Settings,
    load_settings,
    problem_at,
    redacted,
    validation_problems,
)
from engine.malloc import tune_malloc
from sink import __version__
from sink.log import LogLevel, configure_logging

if TYPE_CHECKING:
    from engine.backpressure import BackpressureController
    from sink.http import ListenError
    from sink.lag import Level, PartitionLag

#: `observability.log_level`'s values, least severe first.
LOG_LEVELS: tuple[LogLevel, ...] = ("debug", "info", "warning", "error")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_NOT_IMPLEMENTED = 3
EXIT_LAG = 4
EXIT_INTERRUPTED = 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lance-sink",
        description="Stream Kafka topic-partitions into a Lance table: durable before the "
        "offset is committed, searchable the moment it is.",
    )
    parser.add_argument("--version", action="version", version=f"lance-sink {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run the sink until SIGTERM/SIGINT")
    run.add_argument("--config", type=Path, required=True, help="TOML or YAML config file")
    _add_overrides(run)

    serve = commands.add_parser(
        "serve",
        help="serve queries only (no consumer): the base table and, by fan-out, the fresh "
        "rows of the pods that run the sink; until SIGTERM/SIGINT",
    )
    serve.add_argument("--config", type=Path, required=True, help="the sink's config file")
    _add_overrides(serve)

    check = commands.add_parser(
        "check-config", help="validate a config file and print the effective config (redacted)"
    )
    check.add_argument("file", type=Path, help="TOML or YAML config file")
    _add_overrides(check)

    lag = commands.add_parser(
        "lag", help="print the consumer group's lag per partition (without running the sink)"
    )
    lag.add_argument("--config", type=Path, help="config file (bootstrap, group, topics)")
    lag.add_argument("--bootstrap", help="bootstrap servers (instead of --config)")
    lag.add_argument("--group", help="consumer group (instead of --config)")
    lag.add_argument("--topic", action="append", default=[], help="topic; repeatable")
    lag.add_argument("--json", action="store_true", help="print JSON instead of a table")
    lag.add_argument(
        "--max-lag", type=int, default=None, help="exit 4 if the total lag is above this"
    )
    lag.add_argument(
        "--level",
        choices=["committed", "flushed"],
        default="committed",
        help="which lag --max-lag and TOTAL count: after the group's committed offsets, or "
        "after the flushed watermarks in table storage (rows not in the Lance table yet; "
        "needs --config)",
    )
    lag.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for brokers")
    _add_overrides(lag)

    demo = commands.add_parser(
        "demo", help="the whole product on an embedded broker and a local table", add_help=False
    )
    demo.add_argument("demo_args", nargs=argparse.REMAINDER, help="see `lance-sink demo --help`")

    status = commands.add_parser("status", help="one-screen summary of a running sink")
    status.add_argument("--url", help="the sink's metrics endpoint, e.g. http://host:9102")
    status.add_argument(
        "--config",
        type=Path,
        help="derive the URL from observability.* and the bearer token from query.auth_token "
        "(else LANCE_SINK__QUERY__AUTH_TOKEN)",
    )
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    return parser


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting (highest precedence); repeatable",
    )


def _load(path: Path, overrides: list[str]) -> Settings:
    return load_settings(path, overrides)


def _check_config(args: argparse.Namespace) -> int:
    settings = _load(args.file, args.overrides)
    check_controller(settings, args.file, args.overrides)
    print(json.dumps(redacted(settings), indent=2, sort_keys=False))
    return EXIT_OK


def check_controller(
    settings: Settings, path: Path | None, overrides: list[str]
) -> BackpressureController | None:
    """Build the backpressure controller a custom `backpressure.controller` names (None for
    the built-in ones): loading the settings imported the factory; this calls it with the
    configured limits and checks it returns a `BackpressureController`. `check-config`
    discards it; `run` hands it to the engine, so the factory is called once per start.

    Raises:
        ConfigError: naming `backpressure.controller`, its origin and what went wrong.
    """
    from engine.backpressure import build_controller  # noqa: PLC0415 - keep `check-config` light

    bp = settings.backpressure
    if bp.controller in {"budget", "valve"}:
        return None
    try:
        return build_controller(
            bp.controller,
            process_budget_bytes=int(bp.process_budget_bytes),
            max_unflushed_memtable_bytes=int(bp.max_unflushed_memtable_bytes),
        )
    except Exception as exc:  # whatever the user's factory raises is the answer
        reason = f"the factory failed: {type(exc).__name__}: {exc}"
        raise ConfigError([problem_at("backpressure.controller", reason, path, overrides)]) from exc


PR_SET_THP_DISABLE = 41  # linux/prctl.h
LOOP_SWITCH_INTERVAL_S = 0.001


def disable_transparent_huge_pages() -> bool:
    """Opt this process out of transparent huge pages (Linux `prctl(PR_SET_THP_DISABLE)`).

    The allocators under Arrow and Lance return memory and fault it in again at the pace
    batches flow through; in huge-page regions every fault zeroes 2 MiB, which took about a
    sixth of the sink's CPU on vector messages. Returns whether it took effect."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):  # not Linux
        return False


def tune_process(lance_cpu_threads: int | None = None) -> bool:
    """Process settings `lance-sink run` applies to itself before the engine starts
    (benchmarks that stand in for the sink process apply them too). Returns whether
    transparent huge pages are off.

    - Transparent huge pages off (`disable_transparent_huge_pages`).
    - glibc malloc: at most `MALLOC_ARENAS` arenas, a fixed mmap threshold (`tune_malloc`).
    - GIL switch interval `LOOP_SWITCH_INTERVAL_S`: decode, WAL and flush threads hold the
      GIL in turns; the consumer loop, which notices durable puts and commits, gets it back
      within 1 ms instead of Python's 5 ms.
    - Lance's CPU pool (`LANCE_CPU_THREADS`, read by Lance on first use): `lance_cpu_threads`
      (`query.lance_cpu_threads`), else the variable as set, else half the CPUs (at least
      1). Lance sizes it to every CPU, so one index optimisation (seconds of PQ encoding)
      took them all and queries queued behind it: on 2 CPUs under ingestion, query p99
      went from 174-246 ms to 121 ms with 1 thread, idle latency unchanged.
    """
    thp_off = disable_transparent_huge_pages()
    tune_malloc()
    sys.setswitchinterval(LOOP_SWITCH_INTERVAL_S)
    if lance_cpu_threads is not None:
        os.environ[LANCE_CPU_THREADS] = str(lance_cpu_threads)
    else:
        os.environ.setdefault(LANCE_CPU_THREADS, str(max(1, available_cpus() // 2)))
    return thp_off


LANCE_CPU_THREADS = "LANCE_CPU_THREADS"


def available_cpus() -> int:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a pod's
    CPU limit)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def _derive_waiting(
    settings: Settings,
    schema_ids: tuple[int, ...],
    signals: list[int],
    log: Any,
    leaves: tuple[Any, ...] = (),
) -> Settings | None:
    """`derive_settings`, tried again while the Schema Registry cannot answer (a new table's
    columns come from it): the registry's outage is not the configuration's fault, so the
    sink waits for it (1 s, doubling up to ``unreachable_backoff_max_s``), as a paused
    partition does, rather than exit. None if a signal in `signals` ends the wait.

    Raises:
        LanceSinkError, LookupError, ValueError: as `derive_settings`, but for an
            unreachable registry.
    """
    from sink.formats import RegistryUnavailable  # noqa: PLC0415
    from sink.formats.derive import derive_settings  # noqa: PLC0415

    registry = settings.source.schema_registry
    longest = registry.unreachable_backoff_max_s if registry is not None else 30.0
    wait = 1.0
    while not signals:
        try:
            return derive_settings(settings, schema_ids, leaves)
        except RegistryUnavailable as exc:
            log.warning("registry_unavailable_at_start", error=str(exc), retry_in_s=wait)
        deadline = time.monotonic() + wait
        while not signals and time.monotonic() < deadline:
            time.sleep(0.1)
        wait = min(2 * wait, longest)
    return None


def _early_signals() -> list[int]:
    """Until a service exists a signal is remembered (and asked of the service once it
    does), so a SIGTERM during start-up stops it before it begins and exits 0, not -15; a
    second one exits at once, as during a drain (a start-up stuck on storage, say)."""
    early: list[int] = []

    def on_early_signal(signum: int, _frame: object) -> None:
        if early:
            os._exit(EXIT_INTERRUPTED)
        early.append(signum)

    signal.signal(signal.SIGTERM, on_early_signal)
    signal.signal(signal.SIGINT, on_early_signal)
    return early


def _load_and_log(args: argparse.Namespace) -> tuple[Settings, Any]:
    """What `run` and `serve` do first: load the settings, start logging, tune the process.
    The settings and the logger."""
    settings = _load(args.config, args.overrides)
    obs = settings.observability
    configure_logging(obs.log_level, obs.log_format)
    log = structlog.get_logger("lance_sink")
    log.info("config_loaded", config=redacted(settings))
    if not tune_process(settings.query.lance_cpu_threads):
        log.info("transparent_huge_pages_left_on")
    return settings, log


def _with_columns(
    settings: Settings, args: argparse.Namespace, early: list[int], log: Any
) -> Settings | int:
    """`settings` with `table.columns` derived from the Schema Registry when they are left
    out (waiting for an unreachable registry), or the exit code to return."""
    if settings.table.columns:
        return settings
    from engine.errors import LanceSinkError  # noqa: PLC0415 - keep `check-config` light
    from sink.formats.derive import EVOLVE_LEAVES_ENV, EVOLVE_SCHEMA_IDS_ENV  # noqa: PLC0415

    ids = tuple(int(i) for i in os.environ.pop(EVOLVE_SCHEMA_IDS_ENV, "").split(",") if i)
    leaves = tuple(
        (tuple(path), type_name)
        for path, type_name in json.loads(os.environ.pop(EVOLVE_LEAVES_ENV, "[]"))
    )
    try:
        derived = _derive_waiting(settings, ids, early, log, leaves)
    except ValidationError as exc:  # the derived columns do not fit the other settings
        problems = validation_problems(exc, args.config, args.overrides)
        raise ConfigError(problems) from exc
    except (LanceSinkError, LookupError, ValueError) as exc:
        log.error("startup_failed", error=str(exc), error_type=type(exc).__name__)
        print(f"lance-sink: cannot derive table.columns: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if derived is None:  # a signal came while the registry was away
        log.info("shutdown_requested", signal=signal.Signals(early[0]).name)
        return EXIT_OK
    return derived


def _run(args: argparse.Namespace) -> int:
    early = _early_signals()
    settings, log = _load_and_log(args)
    controller = check_controller(settings, args.config, args.overrides)
    derived = not settings.table.columns
    with_columns = _with_columns(settings, args, early, log)
    if isinstance(with_columns, int):
        return with_columns
    settings = with_columns
    from engine.engine import Engine  # noqa: PLC0415
    from engine.errors import LanceSinkError  # noqa: PLC0415 - keep `check-config` light
    from sink.advertise import with_advertised_url  # noqa: PLC0415
    from sink.metrics import Metrics  # noqa: PLC0415
    from sink.service import SinkService  # noqa: PLC0415

    settings = with_advertised_url(settings)  # fan-out reaches this process's memtables
    try:
        metrics = Metrics(partition_metrics=settings.observability.partition_metrics)
        engine = Engine.from_settings(settings, controller=controller, events=metrics)
        service = SinkService(settings, metrics=metrics, engine=engine, derived_columns=derived)
    except LanceSinkError as exc:
        log.error("startup_failed", error=str(exc), error_type=type(exc).__name__)
        print(f"lance-sink: {exc}", file=sys.stderr)
        return EXIT_FAILURE

    _stop_on_signals(service, early, log)
    from sink.http import ListenError  # noqa: PLC0415

    try:
        code = service.run()
    except ListenError as exc:  # raised by start_servers, before anything is consumed
        _listen_failed(exc, log)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FAILURE)
    # The drain is over (bounded by shutdown.drain_deadline_s): what is acknowledged is
    # durable and committed. Threads still running (a slow query inside Lance, an open the
    # drain stopped waiting for) would hold the interpreter's exit, which joins every
    # executor thread, daemon or not: abandon them.
    main_thread = threading.main_thread()
    lingering = [t.name for t in threading.enumerate() if t is not main_thread and t.is_alive()]
    if lingering:
        log.info("threads_abandoned_at_exit", threads=lingering)
    sys.stdout.flush()
    sys.stderr.flush()
    if service.evolution is not None:
        # Restart in place (same pid, arguments and environment) to evolve the table; the
        # schema ids the messages need are passed on so the new columns cannot be missed.
        from sink.formats.derive import EVOLVE_LEAVES_ENV, EVOLVE_SCHEMA_IDS_ENV  # noqa: PLC0415

        met = ",".join(str(i) for i in service.evolution.schema_ids)
        log.info("restarting_to_evolve", schema_ids=met)
        os.environ[EVOLVE_SCHEMA_IDS_ENV] = met
        # (json change events' schema blocks have no id: their leaves are passed on)
        os.environ[EVOLVE_LEAVES_ENV] = json.dumps(service.evolution.leaves)
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])  # noqa: S606 - the same program
    os._exit(code)


def _serve(args: argparse.Namespace) -> int:
    early = _early_signals()
    settings, log = _load_and_log(args)
    if not settings.query.enabled:
        reason = "`lance-sink serve` serves the query API: it cannot be off"
        raise ConfigError([problem_at("query.enabled", reason, args.config, args.overrides)])
    with_columns = _with_columns(settings, args, early, log)
    if isinstance(with_columns, int):
        return with_columns
    settings = with_columns
    from engine.errors import LanceSinkError  # noqa: PLC0415 - keep `check-config` light
    from sink.http import ListenError  # noqa: PLC0415
    from sink.serve import QueryService  # noqa: PLC0415

    try:
        service = QueryService(settings)
    except LanceSinkError as exc:
        log.error("startup_failed", error=str(exc), error_type=type(exc).__name__)
        print(f"lance-sink: {exc}", file=sys.stderr)
        return EXIT_FAILURE

    _stop_on_signals(service, early, log)
    try:
        code = service.run()
    except ListenError as exc:
        _listen_failed(exc, log)
        code = EXIT_FAILURE
    # A query still running inside Lance would hold the interpreter's exit: abandon it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Stoppable(Protocol):
    """What `_stop_on_signals` asks of `SinkService` and `QueryService`."""

    @property
    def stopping(self) -> bool: ...
    def stop(self) -> None: ...


def _stop_on_signals(service: _Stoppable, early: list[int], log: Any) -> None:
    """SIGTERM and SIGINT ask `service` to stop (a second one exits at once); those that
    came during the start-up (`early`) are asked of it now."""

    def on_signal(signum: int, _frame: object) -> None:
        if service.stopping:
            log.warning("forced_exit", signal=signal.Signals(signum).name)
            os._exit(EXIT_INTERRUPTED)
        log.info("shutdown_requested", signal=signal.Signals(signum).name)
        service.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for signum in early:
        on_signal(signum, None)


def _listen_failed(exc: ListenError, log: Any) -> None:
    """A server could not listen: one line naming the setting and the port."""
    key = listen_setting(exc)
    log.error("startup_failed", error=str(exc), key=key, port=exc.port)
    print(f"lance-sink: {key} ({exc.port}): {exc}", file=sys.stderr)


def listen_setting(exc: ListenError) -> str:
    """The setting whose port a server could not listen on: `observability.metrics_port`
    for the metrics and health endpoints, `query.port` for the query API, both when one
    server serves both (the ports are equal)."""
    from sink.http import SERVES_METRICS, SERVES_QUERY  # noqa: PLC0415

    keys = []
    if SERVES_QUERY in exc.serves:
        keys.append("query.port")
    if SERVES_METRICS in exc.serves:
        keys.append("observability.metrics_port")
    return " and ".join(keys) or "port"


def _lag(args: argparse.Namespace) -> int:
    from sink.lag import FlushedReader, group_lag  # noqa: PLC0415 - keep the other commands light

    flushed: FlushedReader | None = None
    # The report is the output: logs go to standard error, warnings and above only (or the
    # config's observability.log_level if it is higher), in the config's format.
    configure_logging("warning")
    if args.config is not None:
        from sink.kafka_conf import lag_confs  # noqa: PLC0415

        settings = _load(args.config, args.overrides)
        obs = settings.observability
        configure_logging(max(obs.log_level, "warning", key=LOG_LEVELS.index), obs.log_format)
        conf, probe_conf = lag_confs(settings)
        group = args.group or settings.kafka.group_id
        topics = args.topic or list(settings.kafka.topics)
        flushed = FlushedReader(settings)
    elif args.bootstrap and args.group and args.topic:
        conf = probe_conf = {"bootstrap.servers": args.bootstrap}
        group, topics = args.group, args.topic
    else:
        print("lance-sink lag: give --config, or --bootstrap, --group and --topic", file=sys.stderr)
        return EXIT_CONFIG
    if args.level == "flushed" and flushed is None:
        print(
            "lance-sink lag: --level flushed reads the table's shard manifests: give --config",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    from engine.errors import LanceSinkError  # noqa: PLC0415

    try:
        lags = group_lag(
            conf, group, topics, timeout=args.timeout, flushed=flushed, probe_conf=probe_conf
        )
    except (TimeoutError, confluent_kafka.KafkaException, LanceSinkError, OSError) as exc:
        print(f"lance-sink lag: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    level = cast("Level", args.level)
    total = sum(p.at(level) for p in lags)
    if args.json:
        print(json.dumps(lag_report(group, lags, level, flushed is not None), indent=2))
    else:
        print(render_lag(lags, flushed is not None))
    if args.max_lag is not None and total > args.max_lag:
        return EXIT_LAG
    return EXIT_OK


def lag_report(
    group: str, lags: list[PartitionLag], level: Level, with_flushed: bool
) -> dict[str, Any]:
    """The JSON `lance-sink lag --json` prints: per partition the end, committed and (with a
    config) flushed offsets, the commit lag (`lag`), and with a config the flush lag and the
    committed messages not in the Lance table (`unflushed`); `total_lag` at `level`."""
    rows = []
    for p in lags:
        row: dict[str, Any] = {
            "topic": p.topic,
            "partition": p.partition,
            "end": p.end,
            "committed": p.committed,
            "lag": p.lag,
        }
        if with_flushed:
            row.update(flushed=p.flushed, flush_lag=p.flush_lag, unflushed=p.unflushed)
        rows.append(row)
    report: dict[str, Any] = {
        "group": group,
        "level": level,
        "partitions": rows,
        "total_lag": sum(p.at(level) for p in lags),
        "total_commit_lag": sum(p.lag for p in lags),
    }
    if with_flushed:
        report["total_flush_lag"] = sum(p.flush_lag for p in lags)
        report["total_unflushed"] = sum(p.unflushed for p in lags)
    return report


def render_lag(lags: list[PartitionLag], with_flushed: bool) -> str:
    """The table `lance-sink lag` prints. UNFLUSHED: committed messages not in the Lance
    table, durable only in their shard's WAL until a writer replays and flushes them."""
    head = f"{'TOPIC':30} {'PARTITION':>9} {'END':>12} {'COMMITTED':>12} {'LAG':>10}"
    if with_flushed:
        head += f" {'FLUSHED':>12} {'FLUSH LAG':>10} {'UNFLUSHED':>10}"
    lines = [head]
    for p in lags:
        committed = "-" if p.committed is None else str(p.committed)
        line = f"{p.topic:30} {p.partition:>9} {p.end:>12} {committed:>12} {p.lag:>10}"
        if with_flushed:
            flushed = "-" if p.flushed is None else str(p.flushed)
            line += f" {flushed:>12} {p.flush_lag:>10} {p.unflushed:>10}"
        lines.append(line)
    total = f"{'TOTAL':30} {'':>9} {'':>12} {'':>12} {sum(p.lag for p in lags):>10}"
    if with_flushed:
        total += f" {'':>12} {sum(p.flush_lag for p in lags):>10}"
        total += f" {sum(p.unflushed for p in lags):>10}"
    lines.append(total)
    return "\n".join(lines)


def _local_host(host: str) -> str:
    """The host part of a URL reaching a server listening on `host` from this machine: the
    loopback address of the wildcard's family (the sink's IPv6 sockets are IPv6 only, so
    ``::`` is not reachable at 127.0.0.1), an IPv6 address in brackets."""
    if host == "0.0.0.0":  # noqa: S104 - a listening address, mapped to loopback
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def freshness_line(freshness: dict[str, Any] | None) -> str | None:
    """`freshness: fetched 12/40 ms, decoded ..., durable ..., committed ...` (p50/p99 from
    a message's timestamp; None before any batch was measured)."""
    if not freshness or not any(freshness.values()):
        return None
    parts = [
        f"{stage} {p['p50'] * 1000:.0f}/{p['p99'] * 1000:.0f} ms"
        for stage, p in freshness.items()
        if p is not None
    ]
    return "freshness p50/p99 from the message timestamp: " + ", ".join(parts)


def _status(args: argparse.Namespace) -> int:
    url = args.url
    # /v1/status follows query.auth_token: from the config file, else its environment variable.
    token = os.environ.get("LANCE_SINK__QUERY__AUTH_TOKEN")
    if args.config is not None:
        settings = _load(args.config, [])
        secret = settings.query.auth_token
        token = secret.get_secret_value() if secret is not None else token
        if url is None:
            obs = settings.observability
            url = f"http://{_local_host(obs.metrics_host)}:{obs.metrics_port}"
    if url is None:
        print("lance-sink status: give --url or --config", file=sys.stderr)
        return EXIT_CONFIG
    request = urllib.request.Request(url.rstrip("/") + "/v1/status")  # noqa: S310 - operator-given URL
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:  # noqa: S310 - operator-given URL
            status = json.loads(resp.read())
    except (OSError, ValueError) as exc:
        print(f"lance-sink status: cannot read {url}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print(json.dumps(status, indent=2))
        return EXIT_OK
    print(render_status(status))
    return EXIT_OK


def render_status(status: dict[str, Any]) -> str:
    """The one-screen summary `lance-sink status` prints. Lags are in messages after the
    end offset (CONS: consumed, COMMIT, FLUSH), LAG S the age of the oldest message not yet
    durable; under a partition that waits, a line says on what (`partition_notes`); the
    base table's unindexed rows are counted now, from its fragments and index segments
    (`sink.lag.unindexed_rows`), or, when table storage does not answer in time, said to be
    unknown with the figures last read and their age (`sink.base_status`)."""
    reasons = "; ".join(status["not_ready_reasons"])
    lines = [
        f"group {status['group']}  topics {', '.join(status['topics'])}  table {status['table']}",
        f"ready: {'yes' if status['ready'] else 'no - ' + reasons}",
        "",
        (
            f"{'PARTITION':24} {'END':>10} {'CONS LAG':>9} {'COMMIT LAG':>10} "
            f"{'FLUSH LAG':>10} {'LAG S':>7} {'MEMTABLE':>12} {'FROZEN':>6} {'FLUSHES':>8} "
            f"{'STATE':>13}"
        ),
    ]
    for p in status["partitions"]:
        lag = p.get("lag") or {}
        mem = p.get("memtable") or {}
        flush = p.get("flush") or {}
        state = partition_state(p)
        name = f"{p['topic']}[{p['partition']}]"
        seconds = lag.get("seconds")
        lines.append(
            f"{name:24} {p.get('end') or '-':>10} {lag.get('consumer', '-'):>9} "
            f"{lag.get('commit', '-'):>10} {lag.get('flush', '-'):>10} "
            f"{'-' if seconds is None else f'{seconds:.1f}':>7} {_size(mem.get('bytes', 0)):>12} "
            f"{mem.get('frozen_count', 0):>6} {flush.get('flushes', 0):>8} {state:>13}"
        )
        lines += [f"  {note}" for note in partition_notes(p)]
    bp = status["backpressure"]
    lines += [
        "",
        (
            f"backpressure: {bp['controller']}, used {_size(bp['used_bytes'] or 0)} of "
            f"{_size(bp['budget_bytes'] or 0)}, rejections {bp['rejections_total']}, "
            f"waits {bp['waits_total']} ({bp['wait_seconds_total']} s), "
            f"active {bp['active_waits']}"
        ),
    ]
    ingest = status.get("ingest")
    if ingest is not None:
        lines.append(
            f"ingest: {ingest['rows_per_second']:,.1f} rows/s "
            f"(over the last {ingest['window_seconds']:.0f} s)"
        )
    if (line := freshness_line(status.get("freshness"))) is not None:
        lines.append(line)
    memory = status.get("memory")
    if memory is not None:

        def size_or(n: int | None, none: str) -> str:
            return none if n is None else _size(n)

        lines.append(
            f"memory: {size_or(memory['resident_bytes'], 'unknown')} resident, budget "
            f"{size_or(memory['budget_bytes'], 'none')}, limit "
            f"{size_or(memory['limit_bytes'], 'none')}"
        )
    maintenance = status.get("maintenance")
    if maintenance is not None:
        anchor = maintenance["partition"]
        if anchor is None:  # subscription patterns only: every pod maintains
            holds = "(every pod does: kafka.topics holds patterns only)"
            holder = "no partition"
        else:
            holder = f"{anchor['topic']}[{anchor['partition']}]"
            holds = f"(it holds {holder})"
        lines.append(
            {
                "active": f"maintenance: runs in this pod {holds}",
                "standby": f"maintenance: standby (the pod that holds {holder} runs it)",
            }.get(maintenance["role"], "maintenance: off")
        )
    base = status["base"]
    if base.get("unindexed_rows") is None:
        line = f"base table: unindexed rows unknown ({base.get('error', 'not read')})"
        last = base.get("last_known")
        if last is not None and last.get("unindexed_rows") is not None:
            line += (
                f"; {last['age_s']:.0f} s ago: {last['unindexed_rows']:,} unindexed rows of "
                f"{last.get('rows', 0):,}"
            )
        lines.append(line)
    elif not base.get("unindexed_by_index", True):
        lines.append(f"base table: {base.get('rows', 0):,} rows, no index yet")
    else:
        lines.append(
            f"base table: {base['unindexed_rows']:,} unindexed rows of {base.get('rows', 0):,} "
            "(least complete index, now)"
        )
    return "\n".join(lines)


def partition_state(p: dict[str, Any]) -> str:
    """A partition's STATE column: its phase (`sink.consumer.partition.Phase`), an ACTIVE
    one as ``running`` (or ``paused`` while the drain pauses it); a document without a
    phase says what its flags say."""
    phase = p.get("phase")
    if phase is not None and phase != "active":
        return str(phase)
    if phase is None and p.get("fenced"):
        return "fenced"
    if phase is None and p.get("stopped"):
        return "stopped"
    return "paused" if p.get("paused") else "running"


def partition_notes(p: dict[str, Any]) -> list[str]:
    """Why a partition of `/v1/status` waits, as `lance-sink status` prints it under the
    partition's row: the schema registry it cannot reach, or its dead letters not yet
    acknowledged (a stopped partition or a shard that does not open is a readiness reason,
    printed on the `ready:` line)."""
    notes = []
    registry = p.get("schema_registry")
    if registry is not None:
        retry = registry.get("retry_in_s")
        error = str(registry.get("error"))
        if not error.startswith("schema registry"):  # 'unreachable: ...', 'answered 503: ...'
            error = f"schema registry: {error}"
        notes.append(
            f"{'paused' if p.get('paused') else 'waiting'}: {error} "
            f"({registry.get('failures')} failed tries); "
            + ("retry pending" if retry is None else f"retry in {retry:.1f} s")
        )
    letters = p.get("dead_letters")
    if letters is not None:
        note = (
            f"waiting for {letters.get('pending')} dead letters to be acknowledged for "
            f"{letters.get('waiting_s', 0):.1f} s"
        )
        if letters.get("stalled"):
            note += " (stalled)"
        if letters.get("last_error"):
            note += f"; last error: {letters['last_error']}"
        notes.append(note)
    return notes


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _demo(args: argparse.Namespace) -> int:
    from sink.demo import main as demo  # noqa: PLC0415 - only the demo needs rich

    return demo(list(args.demo_args))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lance-sink` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # the demo parses its own options
        return _demo(argparse.Namespace(demo_args=argv[1:]))
    args = _parser().parse_args(argv)
    handlers = {
        "run": _run,
        "serve": _serve,
        "check-config": _check_config,
        "lag": _lag,
        "status": _status,
        "demo": _demo,
    }
    try:
        return handlers[args.command](args)
    except ConfigError as exc:
        print(f"lance-sink: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
