"""The error tree of lance-sink, grouped by what the caller does about it.

    LanceSinkError                      root; carries shard/topic/partition/offset context
    ├── RetriableError                  try again later; nothing acknowledged was lost
    │   ├── PersistenceError            a storage operation (WAL put, Lance commit) failed
    │   ├── RegistryUnavailable (sink/formats)  the schema registry cannot answer; pause
    │   └── FreshRowsUnavailable        other pods' memtable rows did not arrive in time
    │                                   (a query that did not accept a partial answer)
    ├── FatalError                      stop: operator action needed
    │   ├── SchemaMismatch              the table's schema is incompatible with the settings
    │   ├── Poisoned                    the shard writer failed to persist; close and reopen
    │   ├── AmbiguousShard              a moved table's topic-partition has state under
    │   │                               several old shard ids; the operator picks one
    │   └── ListenError (sink/http/serving.py)  a server cannot listen on its port (in use, ...)
    ├── InvalidRecord                   poison message: this input can never be written
    │                                   (→ dead-letter destination with the raw bytes)
    ├── QueryError (engine/filters.py)  a query that cannot succeed as written (→ HTTP 400)
    │   ├── FilterSyntaxError           the filter does not parse (with the position)
    │   └── UnknownColumn               a column the table does not have
    └── ControlFlow                     expected signals, not failures
        ├── Backpressure                admission refused; pause the partition, retry later
        ├── Fenced                      a newer writer (epoch) owns the shard
        └── SchemaEvolution (sink/formats)  a writer schema needs the table evolved; restart

`Sink` code decides per group: retry with backoff, exit non-zero, dead-letter, or
pause/release. Always `raise ... from` the underlying cause.
"""

from __future__ import annotations

from typing import Any


class LanceSinkError(Exception):
    """Root of every lance-sink error. Keyword context is kept in `context` and shown."""

    def __init__(self, message: str, **context: Any) -> None:
        self.message = message
        self.context = {k: v for k, v in context.items() if v is not None}
        detail = " ".join(f"{k}={v}" for k, v in self.context.items())
        super().__init__(f"{message} [{detail}]" if detail else message)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (a decode worker process raises these in the sink's process): the
        # default would call the class with the formatted message alone.
        return (_restore, (type(self), self.args, self.__dict__))


def _restore(cls: type[LanceSinkError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class RetriableError(LanceSinkError):
    """A transient failure: the same operation may succeed later."""


class PersistenceError(RetriableError):
    """A storage operation (WAL append, manifest update, Lance commit) failed."""


class FreshRowsUnavailable(RetriableError):
    """A query needed other pods' memtable rows, some did not arrive within
    `query.fanout_timeout_ms`, and the request did not accept a partial answer.

    Attributes:
        missing: what is missing, one `engine.reads.remote.MissingShard` per shard.
    """

    def __init__(self, message: str, missing: list[Any]) -> None:
        self.missing = missing
        super().__init__(message)


class FatalError(LanceSinkError):
    """A condition that retrying cannot fix."""


class SchemaMismatch(FatalError):
    """The existing table (or a batch) does not match the configured schema."""


class Poisoned(FatalError):
    """The shard writer can no longer persist; it refuses puts and reads until reopened (I6)."""


class AmbiguousShard(FatalError):
    """A table moved with its WAL storage has state of one topic-partition under several
    shard ids of earlier locations; adopting either could lose the other's WAL entries, so
    the shard is not opened until the operator removes all but one (`Engine.shard_id`)."""


class InvalidRecord(LanceSinkError):
    """Input that can never be written (bad type, wrong vector dimension, NaN, null key).

    Attributes:
        column: the offending column, if known.
        row: the row index within the batch, if known.
    """

    def __init__(
        self, message: str, *, column: str | None = None, row: int | None = None, **context: Any
    ) -> None:
        self.column = column
        self.row = row
        super().__init__(message, column=column, row=row, **context)


class ControlFlow(LanceSinkError):
    """Expected signals that steer the caller; not failures."""


class Backpressure(ControlFlow):
    """Admission refused because memory is full; retry once the controller admits again.

    Nothing of the refused put was accepted.
    """

    is_backpressure = True


class Fenced(ControlFlow):
    """A newer writer claimed the shard (higher epoch). This writer acknowledges nothing more."""


def is_backpressure(exc: BaseException) -> bool:
    """True for a `Backpressure` refusal (retryable, distinct from real failures)."""
    return isinstance(exc, Backpressure)
