"""The dead-letter destination: a Kafka topic per source topic, written by an idempotent
producer with acks=all.

Each dead letter carries the original key, value and headers, plus headers saying why it
was rejected and where it came from:

    lance_sink.reason      stable snake_case code (invalid_json, wrong_type, ...)
    lance_sink.detail      human text naming the column or JSON path
    lance_sink.topic / lance_sink.partition / lance_sink.offset / lance_sink.timestamp

**Envelopes.** When the dead letter itself is refused for good (larger than the producer's
`message.max.bytes` or the topic's `max.message.bytes`, a record the broker will not
validate, no authorization to write it, see `classify`), an *envelope* goes to the topic in
its place: the same `lance_sink.*` headers plus

    lance_sink.payload         "omitted"
    lance_sink.payload_bytes   size of the original value
    lance_sink.payload_sha256  hex SHA-256 of the original value
    lance_sink.refused         why the full dead letter was refused (librdkafka's error)
    lance_sink.payload_table   the dead-letter Lance table holding the full payload, when
                               `dlq.lance_table_uri` is set and its append succeeded

and a small JSON value with the same fields (never a tombstone), the original key (up to
`ENVELOPE_MAX_KEY_BYTES`) and headers (up to `ENVELOPE_MAX_HEADER_BYTES`). The payload then
lives in the dead-letter Lance table when one is configured, and in the source topic at the
envelope's coordinates until its retention deletes it. If the envelope is refused for good
too, a letter whose payload the Lance table holds counts as recorded there (logged as
`dead_letter_recorded_in_table_only`); without that, it is retried with backoff and its
partition stays held, reported (see `DeadLetterBatch.waiting_s`): never dropped unrecorded.

Lifecycle: the sink builds one `DeadLetterProducer`, calls `send` for every rejected
message, `poll` on every loop iteration (delivery reports arrive there), and `close` at
shutdown. With `dlq.lance_table_uri` the dead letters are also written to that Lance table
(full payloads, envelopes or not). A source offset may be committed only once `acked` says
its dead letter (or envelope) was delivered; a delivery failing for a transient reason is
re-sent after a backoff (doubling up to `RETRY_MAX_BACKOFF_S`), so a dead-letter topic that
is down makes the partition wait, never lose the message. Every failed attempt is counted
(`DeadLetterEvents.dlq_delivery_failed`) and logged (`dlq_delivery_failed`, at most once per
`LOG_INTERVAL_S` per topic-partition, with the number of attempts not logged). A producer
that the broker fences or that hits a fatal idempotence error is replaced by a new one and
its letters re-sent.

Delivery to the topic is at-least-once: a batch's dead letters are acknowledged before the
batch is put (so nothing is lost), and its offsets are committed only once that put is
durable. A crash in between reads the batch again after the restart and sends its dead
letters again (the idempotent producer drops repeats within one producer session only).
Readers of the topic drop repeats by the `lance_sink.topic`/`.partition`/`.offset`
headers; the dead-letter Lance table holds each once (`DeadLetterTable`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import confluent_kafka
import lance
import pyarrow as pa
import structlog
from confluent_kafka import KafkaError

from config.settings import Settings
from engine.errors import PersistenceError
from engine.table import open_or_create
from sink.decoded import DeadLetter
from sink.log import librdkafka_logger

log = structlog.get_logger("lance_sink.dlq")

# A transient failure is re-sent after 1 s, doubling per attempt up to 30 s: librdkafka has
# already retried internally for up to dlq.produce_timeout_ms before reporting it.
RETRY_INITIAL_BACKOFF_S = 1.0
RETRY_MAX_BACKOFF_S = 30.0
# An envelope waits this long between checks that its batch's Lance table append ended.
TABLE_WAIT_S = 0.05
# Failed attempts of one topic-partition are logged at most this often (each is counted).
LOG_INTERVAL_S = 10.0
# The dead-letter producer's message.max.bytes is source.max_message_bytes plus this much
# for the original key and headers and the lance_sink.* headers (a few hundred bytes), and
# never below librdkafka's own default.
HEADROOM_BYTES = 64 << 10
LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES = 1_000_000
LIBRDKAFKA_MAX_MESSAGE_MAX_BYTES = 1_000_000_000
# An envelope keeps the original key and headers up to these sizes (else drops them and
# says so): it must fit where the full dead letter did not.
ENVELOPE_MAX_KEY_BYTES = 4 << 10
ENVELOPE_MAX_HEADER_BYTES = 16 << 10
ENVELOPE_MAX_DETAIL_CHARS = 1_000
#: The dead-letter Lance table is compacted once a write leaves it this many fragments
#: (each write adds one), and its versions older than the retention are removed then.
DLQ_TABLE_COMPACT_FRAGMENTS = 16

Failure = Literal["size", "refused", "producer", "retry"]

# The broker or librdkafka refuses the record for its size: an envelope fits.
_SIZE_CODES = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
# Refused for good whatever the size: an envelope may still be accepted (a validating broker,
# a timestamp out of range); if it is not, see the module docstring.
_REFUSED_CODES = frozenset(
    {
        KafkaError.INVALID_RECORD,
        KafkaError.INVALID_TIMESTAMP,
        KafkaError.POLICY_VIOLATION,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.UNSUPPORTED_FOR_MESSAGE_FORMAT,
        KafkaError._INVALID_ARG,
    }
)
# The idempotent producer's state is broken (fenced, sequence gap after a refusal): only a
# new producer can send again.
_PRODUCER_CODES = frozenset(
    {
        KafkaError._FATAL,
        KafkaError.PRODUCER_FENCED,
        KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
        KafkaError.UNKNOWN_PRODUCER_ID,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.INVALID_PRODUCER_ID_MAPPING,
    }
)


# Our own purge of a replaced producer's queue: not a failure, re-sent on the new producer.
_PURGED_CODES = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})


def classify(err: KafkaError) -> Failure:
    """What a failed dead-letter delivery calls for.

    Returns:
        "size": refused for its size, send an envelope; "refused": refused for good, send
        an envelope; "producer": replace the producer and re-send; "retry": transient
        (timeouts, brokers down, unknown topic while it is being created), re-send later.
    """
    code = err.code()
    if code in _SIZE_CODES:
        return "size"
    if code in _REFUSED_CODES:
        return "refused"
    if err.fatal() or code in _PRODUCER_CODES:
        return "producer"
    return "retry"


def message_max_bytes(max_message_bytes: int) -> int:
    """The dead-letter producer's default `message.max.bytes`: room for every dead letter
    of a message within `source.max_message_bytes`, with its key and headers."""
    wanted = max(max_message_bytes + HEADROOM_BYTES, LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES)
    return min(wanted, LIBRDKAFKA_MAX_MESSAGE_MAX_BYTES)


def producer_conf(security: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The dead-letter producer's librdkafka properties: the Kafka section's connection and
    security, the sizing, `dlq.librdkafka`, then what the sink owns."""
    conf = dict(security)
    conf.update(
        {
            "message.max.bytes": message_max_bytes(int(settings.source.max_message_bytes)),
            # One dead letter per produce request: a broker refuses whole requests, so a
            # letter refused for its size or content takes no other letter with it into an
            # envelope.
            "batch.num.messages": 1,
            "linger.ms": 5,
        }
    )
    conf.update(settings.dlq.librdkafka)
    conf.update(
        {
            "enable.idempotence": True,
            "acks": "all",
            "message.timeout.ms": settings.dlq.produce_timeout_ms,
        }
    )
    return conf


class DeadLetterEvents(Protocol):
    """What the producer reports (the metrics facade implements it)."""

    def dead_lettered(self, topic: str, reason: str) -> None: ...
    def dlq_delivery_failed(self, topic: str, error: str) -> None: ...
    def dlq_payload_omitted(self, topic: str, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Envelope:
    """What goes to the dead-letter topic in place of a refused dead letter."""

    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes | None]]


def envelope(letter: DeadLetter, refused: str, payload_table: str | None) -> Envelope:
    """The envelope of `letter` (see the module docstring): coordinates, reason, size and
    SHA-256 of the payload, why the full letter was refused, where the payload is stored."""
    payload = letter.value or b""
    key = letter.key if letter.key is None or len(letter.key) <= ENVELOPE_MAX_KEY_BYTES else None
    header_bytes = sum(len(k) + len(v or b"") for k, v in letter.headers)
    headers = list(letter.headers) if header_bytes <= ENVELOPE_MAX_HEADER_BYTES else []
    detail = letter.detail[:ENVELOPE_MAX_DETAIL_CHARS]
    fields: dict[str, Any] = {
        "lance_sink": "dead_letter_envelope",
        "reason": letter.reason,
        "detail": detail,
        "topic": letter.topic,
        "partition": letter.partition,
        "offset": letter.offset,
        "timestamp": letter.timestamp_ms,
        "payload": "omitted",
        "payload_bytes": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "refused": refused,
        "payload_table": payload_table,
        "key_omitted": key is None and letter.key is not None,
        "headers_omitted": len(headers) < len(letter.headers),
    }
    extra: list[tuple[str, bytes | None]] = [
        ("lance_sink.payload", b"omitted"),
        ("lance_sink.payload_bytes", str(len(payload)).encode()),
        ("lance_sink.payload_sha256", fields["payload_sha256"].encode()),
        ("lance_sink.refused", refused.encode()),
    ]
    if payload_table is not None:
        extra.append(("lance_sink.payload_table", payload_table.encode()))
    return Envelope(
        key,
        json.dumps(fields, separators=(",", ":")).encode(),
        [*headers, *_coordinates(letter, detail), *extra],
    )


def _coordinates(letter: DeadLetter, detail: str) -> list[tuple[str, bytes | None]]:
    headers: list[tuple[str, bytes | None]] = [
        ("lance_sink.reason", letter.reason.encode()),
        ("lance_sink.detail", detail.encode()),
        ("lance_sink.topic", letter.topic.encode()),
        ("lance_sink.partition", str(letter.partition).encode()),
        ("lance_sink.offset", str(letter.offset).encode()),
    ]
    if letter.timestamp_ms is not None:
        headers.append(("lance_sink.timestamp", str(letter.timestamp_ms).encode()))
    return headers


@dataclass
class _Pending:
    letter: DeadLetter
    stored: Future[bool] | None = None  # the Lance table append of its batch
    attempts: int = 0
    failures: int = 0
    delivered: bool = False
    retry_at: float = 0.0
    error: str | None = None
    refused: str | None = None  # why the full letter was refused for good: send an envelope
    batch: weakref.ref[DeadLetterBatch] | None = None

    @property
    def abandoned(self) -> bool:
        """The sink dropped the batch (partition revoked, writer recovered): the letter
        will be sent again from the source, so it is not re-sent from here."""
        return self.batch is not None and self.batch() is None


@dataclass
class DeadLetterBatch:
    """The dead letters of one consumed batch; `acked` once every one was delivered."""

    letters: list[_Pending] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)

    @property
    def acked(self) -> bool:
        return all(p.delivered for p in self.letters)

    @property
    def pending(self) -> int:
        """Dead letters not delivered yet."""
        return sum(not p.delivered for p in self.letters)

    @property
    def last_error(self) -> str | None:
        """The latest delivery error of a dead letter not delivered yet."""
        errors = [p.error for p in self.letters if not p.delivered and p.error]
        return errors[-1] if errors else None

    def waiting_s(self) -> float:
        """Seconds since the batch was sent, while a dead letter of it is undelivered."""
        return 0.0 if self.acked else time.monotonic() - self.since


class _Throttle:
    """At most one log line per key per interval; counts the ones it held back."""

    def __init__(self, interval_s: float) -> None:
        self._interval = interval_s
        self._next: dict[tuple[str, int], float] = {}
        self._held: dict[tuple[str, int], int] = {}

    def allow(self, key: tuple[str, int]) -> int | None:
        """None = do not log now; else how many were held back since the last line."""
        now = time.monotonic()
        if now < self._next.get(key, 0.0):
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._next[key] = now + self._interval
        return self._held.pop(key, 0)


class DeadLetterProducer:
    """Sends dead letters to `topic_template.format(topic=...)`. Used by the loop thread only.

    `conf` is the full librdkafka configuration (`producer_conf`)."""

    def __init__(
        self,
        conf: dict[str, Any],
        topic_template: str,
        metrics: DeadLetterEvents | None = None,
        *,
        table_uri: str | None = None,
        storage_options: dict[str, str] | None = None,
        retention_s: float = 3_600,
    ) -> None:
        # librdkafka's own lines (connection failures, ...) through the sink's log pipeline.
        self._conf = {**conf, "logger": librdkafka_logger()}
        self._producer = confluent_kafka.Producer(self._conf)
        self._generation = 0
        self._rebuild_due = False
        self._retired: list[confluent_kafka.Producer] = []
        self._template = topic_template
        self._metrics = metrics
        self._waiting: list[_Pending] = []
        self._throttle = _Throttle(LOG_INTERVAL_S)
        self._table = (
            DeadLetterTable(table_uri, storage_options, retention_s=retention_s)
            if table_uri
            else None
        )

    def destination(self, topic: str) -> str:
        return self._template.format(topic=topic)

    def send(self, letters: list[DeadLetter]) -> DeadLetterBatch:
        """Queue the dead letters of one batch; returns a handle to check delivery."""
        stored = self._table.append(letters) if self._table is not None else None
        batch = DeadLetterBatch([_Pending(letter, stored) for letter in letters])
        for pending in batch.letters:
            pending.batch = weakref.ref(batch)
            self._produce(pending)
        return batch

    def _produce(self, pending: _Pending) -> None:
        letter = pending.letter
        headers: list[tuple[str, str | bytes | None]]
        if pending.refused is None:
            key, value = letter.key, letter.value
            headers = [*letter.headers, *_coordinates(letter, letter.detail)]
        else:
            if pending.stored is not None and not pending.stored.done():
                # The envelope names the table only once its append succeeded.
                self._retry(pending, TABLE_WAIT_S)
                return
            table = self._table.uri if self._table is not None and _stored(pending) else None
            env = envelope(letter, pending.refused, table)
            key, value, headers = env.key, env.value, list(env.headers)
        pending.attempts += 1
        generation = self._generation
        try:
            self._producer.produce(
                self.destination(letter.topic),
                key=key,
                value=value,
                headers=headers,
                on_delivery=self._on_delivery(pending, generation),
            )
        except BufferError as exc:  # librdkafka's queue is full: try again shortly
            pending.error = str(exc)
            self._retry(pending, RETRY_INITIAL_BACKOFF_S)
        except confluent_kafka.KafkaException as exc:
            self._failed(pending, exc.args[0], generation)

    def _on_delivery(
        self, pending: _Pending, generation: int
    ) -> Callable[[KafkaError | None, Any], None]:
        def delivered(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                self._failed(pending, err, generation)
                return
            letter = pending.letter
            pending.delivered = True
            pending.error = None
            if self._metrics is not None:
                self._metrics.dead_lettered(letter.topic, letter.reason)
                if pending.refused is not None:
                    self._metrics.dlq_payload_omitted(letter.topic, letter.reason)
            log.info(
                "dead_lettered",
                topic=letter.topic,
                partition=letter.partition,
                offset=letter.offset,
                reason=letter.reason,
                payload="omitted" if pending.refused is not None else "included",
            )

        return delivered

    def _failed(self, pending: _Pending, err: KafkaError, generation: int) -> None:
        """One failed attempt: count it, log it (throttled), decide what comes next."""
        letter = pending.letter
        if err.code() in _PURGED_CODES:  # purged by `_rebuild`: re-send on the new producer
            self._retry(pending, 0.0)
            return
        kind = classify(err)
        pending.failures += 1
        pending.error = f"{err.name()}: {err.str()}"
        if self._metrics is not None:
            self._metrics.dlq_delivery_failed(letter.topic, err.name())
        held_back = self._throttle.allow((letter.topic, letter.partition))
        if held_back is not None:
            log.warning(
                "dlq_delivery_failed",
                topic=letter.topic,
                partition=letter.partition,
                offset=letter.offset,
                destination=self.destination(letter.topic),
                attempt=pending.attempts,
                error=pending.error,
                outcome=kind,
                payload="omitted" if pending.refused is not None else "included",
                failures_not_logged=held_back,
            )
        backoff = min(
            RETRY_INITIAL_BACKOFF_S * 2 ** min(pending.failures - 1, 16), RETRY_MAX_BACKOFF_S
        )
        if kind == "producer":
            if generation == self._generation:
                self._rebuild_due = True
            self._retry(pending, backoff)  # a producer failing at once is not rebuilt in a loop
        elif kind in ("size", "refused") and pending.refused is None:
            pending.refused = pending.error
            self._retry(pending, 0.0)
        elif kind in ("size", "refused") and _stored(pending):
            # The envelope is refused too, but the table holds the whole dead letter.
            pending.delivered = True
            log.error(
                "dead_letter_recorded_in_table_only",
                topic=letter.topic,
                partition=letter.partition,
                offset=letter.offset,
                reason=letter.reason,
                table=self._table.uri if self._table is not None else None,
                error=pending.error,
            )
        else:
            self._retry(pending, backoff)

    def _retry(self, pending: _Pending, after_s: float) -> None:
        pending.retry_at = time.monotonic() + after_s
        self._waiting.append(pending)

    def _rebuild(self) -> None:
        """Replace a fenced or failed producer; what it still holds is purged (its delivery
        reports re-send those letters on the new producer)."""
        self._rebuild_due = False
        old = self._producer
        self._generation += 1
        self._producer = confluent_kafka.Producer(self._conf)
        old.purge(in_queue=True, in_flight=True)
        self._retired.append(old)
        log.warning("dlq_producer_replaced", generation=self._generation)

    def poll(self) -> None:
        """Serve delivery reports and re-send failed deliveries whose backoff expired."""
        self._producer.poll(0)
        if self._retired:
            for old in self._retired:
                old.poll(0)
            self._retired = [old for old in self._retired if len(old) > 0]
        if self._rebuild_due:
            self._rebuild()
        if not self._waiting:
            return
        now = time.monotonic()
        due = [p for p in self._waiting if p.retry_at <= now]
        self._waiting = [p for p in self._waiting if p.retry_at > now]
        for pending in due:
            if not pending.delivered and not pending.abandoned:
                self._produce(pending)

    def close(self, timeout: float) -> int:
        """Deliver what is queued (bounded); returns how many are still undelivered."""
        remaining: int = self._producer.flush(timeout)
        for old in self._retired:
            old.flush(0)
        remaining += sum(not p.delivered and not p.abandoned for p in self._waiting)
        if self._table is not None:
            self._table.close()
        return remaining


def _stored(pending: _Pending) -> bool:
    """Whether the Lance table append of the letter's batch ended and succeeded."""
    stored = pending.stored
    return stored is not None and stored.done() and stored.exception() is None and stored.result()


DEAD_LETTER_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string(), nullable=False),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("timestamp", pa.timestamp("ms", tz="UTC")),
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string()),
    ]
)


#: The columns that identify a dead letter in the dead-letter Lance table: its source
#: coordinates, the same as the topic's lance_sink.topic/.partition/.offset headers.
DEAD_LETTER_KEY = ["topic", "partition", "offset"]


class DeadLetterTable:
    """`dlq.lance_table_uri`: dead letters also written to a Lance table, full payloads
    included, off the loop thread. Best effort next to the topic (which is what gates
    offset commits): a failed write is logged, not retried; its future says which.

    Idempotent: a write is a merge-insert on `DEAD_LETTER_KEY` that inserts only the
    letters the table does not hold yet, so dead letters sent again after a crash (their
    batch's offsets were not committed) are in the table once. It costs a scan of the key
    columns per write (dead letters are few; the first write creates the table).

    Kept small: each write adds a fragment and a version, so once a write leaves
    `DLQ_TABLE_COMPACT_FRAGMENTS` fragments the table is compacted, and its versions older
    than `retention_s` (``maintenance.cleanup_retention_s``) are removed.
    """

    def __init__(
        self, uri: str, storage_options: dict[str, str] | None, *, retention_s: float = 3_600
    ) -> None:
        self.uri = uri
        self.options = storage_options or None
        self.retention = dt.timedelta(seconds=retention_s)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlq-table")

    def append(self, letters: list[DeadLetter]) -> Future[bool]:
        """Add the letters the table does not hold yet (one Lance commit); the future says
        whether it succeeded."""
        rows = [
            {
                "topic": d.topic,
                "partition": d.partition,
                "offset": d.offset,
                "timestamp": d.timestamp_ms,
                "key": d.key,
                "value": d.value,
                "reason": d.reason,
                "detail": d.detail,
            }
            for d in letters
        ]
        return self._pool.submit(self._write, pa.Table.from_pylist(rows, schema=DEAD_LETTER_SCHEMA))

    def _write(self, table: pa.Table) -> bool:
        try:
            # Created empty, then written like any other batch: a create carrying the
            # letters could land on top of another pod's (`create_table`).
            ds = open_or_create(self.uri, DEAD_LETTER_SCHEMA, self.options)
            ds.merge_insert(DEAD_LETTER_KEY).when_not_matched_insert_all().execute(table)
        except (PersistenceError, OSError, ValueError, RuntimeError) as exc:
            log.warning("dlq_table_append_failed", uri=self.uri, error=str(exc))
            return False
        self._upkeep()
        return True

    def _upkeep(self) -> None:
        """Compact the table and remove its old versions once it has many fragments. A
        failure (another pod compacting at once, storage trouble) is logged; the next write
        tries again."""
        try:
            ds = lance.dataset(self.uri, storage_options=self.options)
            if len(ds.get_fragments()) < DLQ_TABLE_COMPACT_FRAGMENTS:
                return
            ds.optimize.compact_files()
            ds.cleanup_old_versions(older_than=self.retention)
        except (OSError, ValueError, RuntimeError) as exc:
            log.warning("dlq_table_upkeep_failed", uri=self.uri, error=str(exc))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
