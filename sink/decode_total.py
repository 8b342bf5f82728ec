"""Totality: no message's content can make decoding raise.

`total` wraps a batch decode (`sink.decode.Decoder.decode` is `total` around its own
steps): whatever a decode path raises for a batch, but the registry and evolution signals,
the batch is split until the message it raises on is alone, a ``decode_error`` dead
letter; `sink.decode_process.ProcessDecoder` does the same for a worker process that dies
on a batch (DESIGN I23).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

import pyarrow as pa
import structlog

from sink.decoded import DeadLetter, Decoded, MessageLike, dead_letter
from sink.formats import RegistryUnavailable, SchemaEvolution

__all__ = ["DECODE_ERROR_LOG_INTERVAL_S", "decode_error_letter", "joined", "total"]

log = structlog.get_logger("lance_sink.sink")

#: What `total` lets out of a decode: the consumer loop's signals, not a message's fault.
_SIGNALS: Final = (RegistryUnavailable, SchemaEvolution)

#: Longest exception text kept in a `decode_error` dead letter's detail.
_ERROR_CHARS: Final = 1_000

#: An exception of one type at one place is logged with its traceback at most this often
#: (a flood of one bad kind would otherwise write a traceback per message); each is
#: counted all the same (`lance_sink_decode_errors_total`) and dead-lettered.
DECODE_ERROR_LOG_INTERVAL_S: Final = 60.0

_logged_at: dict[tuple[str, str, int], float] = {}

_logged_lock = threading.Lock()


def total(
    decode: Callable[[Sequence[MessageLike]], Decoded],
    messages: Sequence[MessageLike],
    catch: type[Exception] = Exception,
) -> Decoded:
    """`decode(messages)`, made total: whatever it raises for a batch (of `catch`, but the
    registry and evolution signals, `_SIGNALS`), the batch is split in halves, each decoded
    the same way, until the message that raises is alone; that message is a
    ``decode_error`` dead letter naming the exception, the others decode as they would
    have.

    A message's outcome stays its own: a half decodes exactly as a batch of those messages
    would (the decoder's paths give every message the same outcome whatever its batch:
    tests/unit/test_decode_metamorphic.py). The cost of one raising message among ``n`` is
    about ``2n`` more messages decoded.

    Args:
        decode: decodes a non-empty batch of one topic-partition's messages.
        messages: that batch, at least one message.
        catch: what a message may make `decode` raise (`ProcessDecoder`: a worker dying
            on the batch; anything else it raises is raised).
    """
    try:
        return decode(messages)
    except _SIGNALS:
        raise
    except catch as exc:
        if len(messages) == 1:
            offset = int(messages[0].offset() or 0)
            return Decoded(None, [decode_error_letter(messages[0], exc)], [], offset, offset)
        mid = len(messages) // 2
        return joined([total(decode, messages[:mid], catch), total(decode, messages[mid:], catch)])


def decode_error_letter(message: MessageLike, exc: BaseException) -> DeadLetter:
    """The ``decode_error`` dead letter of a message whose decoding raised `exc`; logs
    the exception with its traceback (at most once a `DECODE_ERROR_LOG_INTERVAL_S` per
    exception type and place)."""
    text = f"{type(exc).__name__}: {exc}"
    if len(text) > _ERROR_CHARS:
        text = text[: _ERROR_CHARS - 3] + "..."
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = ("", 0) if tb is None else (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
    key = (type(exc).__name__, *where)
    now = time.monotonic()
    with _logged_lock:
        due = now - _logged_at.get(key, -math.inf) >= DECODE_ERROR_LOG_INTERVAL_S
        if due:
            _logged_at[key] = now
    if due:
        log.error(
            "decode_error",
            topic=message.topic(),
            partition=message.partition(),
            offset=message.offset(),
            error=text,
            exc_info=exc,
        )
    return dead_letter(
        message,
        "decode_error",
        f"decoding the value raised {text} (a dead letter instead; please report it)",
    )


def joined(parts: Sequence[Decoded]) -> Decoded:
    """Decoded batches of consecutive runs of one partition's messages, as one."""
    batches = [p.batch for p in parts if p.batch is not None and p.batch.num_rows]
    batch = None
    if len(batches) == 1:
        batch = batches[0]
    elif batches:
        batch = pa.concat_batches(batches)
    return Decoded(
        batch,
        [d for p in parts for d in p.dead_letters],
        [o for p in parts for o in p.skipped_offsets],
        parts[0].first_offset,
        parts[-1].last_offset,
        sum(p.truncates for p in parts),
    )
