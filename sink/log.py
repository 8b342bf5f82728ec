"""structlog, configured once per process.

JSON lines when stderr is not a TTY (production, tests, containers), a readable console
renderer on a TTY. Events have stable snake_case names and their data as fields; bound
context (topic, partition, shard, generation) is added with `structlog.contextvars` or
`log.bind`. librdkafka's own log lines reach the same pipeline through `librdkafka_logger`,
and other libraries' warnings and errors through Python's root logger (uvicorn's, for one:
a request it cannot read, an exception in a handler) as `library_log` events.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Literal

import structlog

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "json", "console"]
#: What `configure_logging` takes (``observability.log_level``, ``.log_format``), for a
#: worker process to log as the sink's does.
LogConfig = tuple[LogLevel, LogFormat]

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

_configured = False


def configure_logging(level: LogLevel = "info", fmt: LogFormat = "auto") -> None:
    """Configure structlog (and stdlib logging, which librdkafka's logger feeds) once.

    Later calls only change the level, so libraries and tests may call it freely.
    """
    global _configured  # noqa: PLW0603 - logging is process-global by nature
    renderer: structlog.types.Processor
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    if not _configured:
        handler = _StructlogHandler()
        root = logging.getLogger("lance_sink.stdlib")
        root.addHandler(handler)
        root.propagate = False
        # Everything else that logs through the stdlib (at the root's WARNING, as Python's
        # last-resort handler printed it: plain text on stderr before).
        logging.getLogger().addHandler(_LibraryHandler())
        _configured = True
    logging.getLogger("lance_sink.stdlib").setLevel(_LEVELS[level])


class _StructlogHandler(logging.Handler):
    """Forwards stdlib records (librdkafka's logger) into structlog as `librdkafka_log`."""

    def emit(self, record: logging.LogRecord) -> None:
        log = structlog.get_logger("librdkafka")
        level = record.levelname.lower()
        method = getattr(log, level if level in _LEVELS else "info")
        # librdkafka formats "FAC [client] [thrd:...]: message"; keep the facility apart.
        message = record.getMessage()
        facility, _, rest = message.partition(" ")
        method("librdkafka_log", facility=facility, message=rest or message)


class _LibraryHandler(logging.Handler):
    """Forwards other libraries' stdlib records into structlog as `library_log`, with the
    logger's name and, for an exception, its traceback."""

    def emit(self, record: logging.LogRecord) -> None:
        log = structlog.get_logger(record.name)
        level = record.levelname.lower()
        method = getattr(log, level if level in _LEVELS else "error")
        fields: dict[str, str] = {"logger": record.name, "message": record.getMessage().rstrip()}
        if record.exc_info and record.exc_info[1] is not None:
            fields["exception"] = "".join(traceback.format_exception(*record.exc_info))
        method("library_log", **fields)


def librdkafka_logger() -> logging.Logger:
    """The stdlib logger to pass as librdkafka's `logger` config property."""
    return logging.getLogger("lance_sink.stdlib.librdkafka")
