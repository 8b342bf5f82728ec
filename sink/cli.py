"""The `lance-sink` command line: parse settings, build the service, run it.

Exit codes:
    0  success (for `run`: stopped by SIGTERM/SIGINT and drained)
    1  runtime failure: a fatal error stopped the service (fenced everywhere, table schema
       incompatible, authentication failure, ...); the message says which
    2  invalid configuration or usage (the message names key, source and reason)
    3  the command is not implemented yet
    130  `run` was interrupted by a second signal before the drain finished (what was not
       committed is replayed or re-read on the next start; nothing acknowledged is lost)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog

from config import ConfigError, Settings, load_settings, redacted
from sink import __version__
from sink.log import configure_logging

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_NOT_IMPLEMENTED = 3
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

    check = commands.add_parser(
        "check-config", help="validate a config file and print the effective config (redacted)"
    )
    check.add_argument("file", type=Path, help="TOML or YAML config file")
    _add_overrides(check)
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
    print(json.dumps(redacted(settings), indent=2, sort_keys=False))
    return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    settings = _load(args.config, args.overrides)
    obs = settings.observability
    configure_logging(obs.log_level, obs.log_format)
    log = structlog.get_logger("lance_sink")
    log.info("config_loaded", config=redacted(settings))
    from engine.errors import LanceSinkError  # noqa: PLC0415 - keep `check-config` light
    from sink.service import SinkService  # noqa: PLC0415

    try:
        service = SinkService(settings)
    except LanceSinkError as exc:
        log.error("startup_failed", error=str(exc), error_type=type(exc).__name__)
        print(f"lance-sink: {exc}", file=sys.stderr)
        return EXIT_FAILURE

    def on_signal(signum: int, _frame: object) -> None:
        if service.stopping:
            log.warning("forced_exit", signal=signal.Signals(signum).name)
            os._exit(EXIT_INTERRUPTED)
        log.info("shutdown_requested", signal=signal.Signals(signum).name)
        service.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return service.run()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lance-sink` console script."""
    args = _parser().parse_args(argv)
    handlers = {"run": _run, "check-config": _check_config}
    try:
        return handlers[args.command](args)
    except ConfigError as exc:
        print(f"lance-sink: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
