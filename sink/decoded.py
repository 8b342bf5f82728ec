"""What decoding gives: each message becomes a row, a `DeadLetter` with its `Reason`, or a
skipped tombstone, and one batch's outcome is a `Decoded` (`sink.decode.Decoder` makes
them; the consumer loop, the dead-letter producer and the decode processes read them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol, TypeAlias

import numpy as np
import pyarrow as pa

__all__ = [
    "TIMESTAMP_NOT_AVAILABLE",
    "DeadLetter",
    "Decoded",
    "MessageLike",
    "Reason",
    "dead_letter",
    "value_sizes",
]

Reason: TypeAlias = Literal[
    "invalid_json",
    "not_an_object",
    "wrong_type",
    "wrong_vector_dimension",
    "nan_in_vector",
    "missing_primary_key",
    "missing_required",
    "oversized",
    "invalid_utf8",
    "tombstone",
    "rejected_by_table",  # the engine refused a decoded batch (set by the consumer loop)
    "decode_error",  # decoding it raised (`decode_error_letter`): no path foresaw the value
    # Registry formats (sink.formats):
    "missing_magic_byte",  # the value is not in the Confluent wire format
    "unknown_schema_id",  # the registry does not know the value's schema id (HTTP 404)
    "not_matching_schema",  # the value does not decode with its schema
    # Change events (source.envelope = "debezium", sink.cdc):
    "cdc_missing_op",  # the value has no op: not a Debezium change event
    "cdc_unknown_op",  # an op other than c, r, u, d, t
    "cdc_missing_after",  # op c, r or u without an after image
    "cdc_missing_key",  # op d with its primary key neither in before nor in the Kafka key
    "cdc_truncate",  # op t with source.truncate = "dlq"
]

#: Kafka's TIMESTAMP_NOT_AVAILABLE timestamp type: the message carries no timestamp.
TIMESTAMP_NOT_AVAILABLE: Final = 0


class MessageLike(Protocol):
    """The accessors of `confluent_kafka.Message` that decoding reads."""

    def topic(self) -> str | None: ...
    def partition(self) -> int | None: ...
    def offset(self) -> int | None: ...
    def timestamp(self) -> tuple[int, int]: ...
    def key(self) -> bytes | None: ...
    def value(self) -> bytes | None: ...
    def headers(self) -> Sequence[tuple[str, bytes | None]] | None: ...


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One message that cannot be written, with why.

    Attributes:
        topic: source topic.
        partition: source partition.
        offset: source offset.
        timestamp_ms: the Kafka timestamp, or None when the message carries none.
        key: the raw key bytes.
        value: the raw value bytes (None for a tombstone).
        headers: the raw headers (a header value may be None, as in Kafka).
        reason: a stable snake_case code (`Reason`).
        detail: human text naming the column and JSON path at fault.
    """

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    reason: Reason
    detail: str


@dataclass(frozen=True, slots=True)
class Decoded:
    """The result of decoding one batch of one topic-partition.

    Attributes:
        batch: the good rows in `TableSpec.batch_schema`, in offset order; None if none.
        dead_letters: the messages that cannot be written, in offset order.
        skipped_offsets: tombstones skipped by policy on append tables; with
            ``source.envelope = "debezium"`` Debezium's tombstones and skipped truncates.
        first_offset: offset of the first message given (good, dead or skipped).
        last_offset: offset of the last message given.
        truncates: how many of `skipped_offsets` are skipped truncates (``source.truncate =
            "skip"``), counted by the consumer loop (``lance_sink_cdc_truncates_total``).
    """

    batch: pa.RecordBatch | None
    dead_letters: list[DeadLetter]
    skipped_offsets: list[int]
    first_offset: int
    last_offset: int
    truncates: int = 0


def value_sizes(values: Sequence[bytes | None]) -> np.ndarray:
    """Each value's length, -1 for a tombstone (None), as int64."""
    try:
        return np.fromiter(map(len, values), np.int64, len(values))  # type: ignore[arg-type]
    except TypeError:  # tombstones among them
        return np.fromiter((-1 if v is None else len(v) for v in values), np.int64, len(values))


def dead_letter(message: MessageLike, reason: Reason, detail: str) -> DeadLetter:
    """The dead letter of `message`: its coordinates, key, value and headers as consumed."""
    kind, ms = message.timestamp()
    return DeadLetter(
        topic=message.topic() or "",
        partition=message.partition() or 0,
        offset=int(message.offset() or 0),
        timestamp_ms=None if kind == TIMESTAMP_NOT_AVAILABLE else ms,
        key=message.key(),
        value=message.value(),
        headers=list(message.headers() or ()),
        reason=reason,
        detail=detail,
    )
