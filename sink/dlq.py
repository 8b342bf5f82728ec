"""The dead-letter destination: a Kafka topic per source topic, written by an idempotent
producer with acks=all.

Each dead letter carries the original key, value and headers, plus headers saying why it
was rejected and where it came from:

    lance_sink.reason      stable snake_case code (invalid_json, wrong_type, ...)
    lance_sink.detail      human text naming the column or JSON path
    lance_sink.topic / lance_sink.partition / lance_sink.offset / lance_sink.timestamp

Lifecycle: the sink builds one `DeadLetterProducer`, calls `send` for every rejected
message, `poll` on every loop iteration (delivery reports arrive there), and `close` at
shutdown. With `dlq.lance_table_uri` the dead letters are also appended to that Lance table.
A source offset may be committed only once `acked` says its dead letter was delivered; a
failed delivery is re-sent after a backoff, so a dead-letter topic that is down makes the
partition wait, never lose the message. Delivery is at-least-once: a crash
between delivery and the offset commit re-sends the message after restart.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import confluent_kafka
import lance
import pyarrow as pa
import structlog

from sink.decode import DeadLetter

log = structlog.get_logger("lance_sink.dlq")

RETRY_BACKOFF_S = 1.0  # a refused or timed-out delivery is re-sent after this


@dataclass
class _Pending:
    letter: DeadLetter
    attempts: int = 0
    delivered: bool = False
    retry_at: float = 0.0
    error: str | None = None


@dataclass
class DeadLetterBatch:
    """The dead letters of one consumed batch; `acked` once every one was delivered."""

    letters: list[_Pending] = field(default_factory=list)

    @property
    def acked(self) -> bool:
        return all(p.delivered for p in self.letters)


class DeadLetterProducer:
    """Sends dead letters to `topic_template.format(topic=...)`. Used by the loop thread only."""

    def __init__(
        self,
        conf: dict[str, Any],
        topic_template: str,
        metrics: Any = None,
        *,
        timeout_ms: int = 30_000,
        table_uri: str | None = None,
        storage_options: dict[str, str] | None = None,
    ) -> None:
        producer_conf = dict(conf)
        producer_conf.update(
            {
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "message.timeout.ms": timeout_ms,
            }
        )
        self._producer = confluent_kafka.Producer(producer_conf)
        self._template = topic_template
        self._metrics = metrics
        self._waiting: list[_Pending] = []
        self._table = DeadLetterTable(table_uri, storage_options) if table_uri else None

    def destination(self, topic: str) -> str:
        return self._template.format(topic=topic)

    def send(self, letters: list[DeadLetter]) -> DeadLetterBatch:
        """Queue the dead letters of one batch; returns a handle to check delivery."""
        if self._table is not None:
            self._table.append(letters)
        batch = DeadLetterBatch([_Pending(letter) for letter in letters])
        for pending in batch.letters:
            self._produce(pending)
        return batch

    def _produce(self, pending: _Pending) -> None:
        letter = pending.letter
        pending.attempts += 1
        headers: list[tuple[str, str | bytes | None]] = [
            *letter.headers,
            ("lance_sink.reason", letter.reason.encode()),
            ("lance_sink.detail", letter.detail.encode()),
            ("lance_sink.topic", letter.topic.encode()),
            ("lance_sink.partition", str(letter.partition).encode()),
            ("lance_sink.offset", str(letter.offset).encode()),
        ]
        if letter.timestamp_ms is not None:
            headers.append(("lance_sink.timestamp", str(letter.timestamp_ms).encode()))

        def delivered(err: confluent_kafka.KafkaError | None, _msg: Any) -> None:
            if err is None:
                pending.delivered = True
                if self._metrics is not None:
                    self._metrics.dead_lettered(letter.topic, letter.reason)
                log.info(
                    "dead_lettered",
                    topic=letter.topic,
                    partition=letter.partition,
                    offset=letter.offset,
                    reason=letter.reason,
                )
                return
            pending.error = str(err)
            pending.retry_at = time.monotonic() + RETRY_BACKOFF_S
            self._waiting.append(pending)
            log.warning(
                "dlq_delivery_failed",
                topic=letter.topic,
                partition=letter.partition,
                offset=letter.offset,
                attempt=pending.attempts,
                error=str(err),
            )

        try:
            self._producer.produce(
                self.destination(letter.topic),
                key=letter.key,
                value=letter.value,
                headers=headers,
                on_delivery=delivered,
            )
        except (BufferError, confluent_kafka.KafkaException) as exc:
            pending.error = str(exc)
            pending.retry_at = time.monotonic() + RETRY_BACKOFF_S
            self._waiting.append(pending)

    def poll(self) -> None:
        """Serve delivery reports and re-send failed deliveries whose backoff expired."""
        self._producer.poll(0)
        if not self._waiting:
            return
        now = time.monotonic()
        due = [p for p in self._waiting if p.retry_at <= now]
        self._waiting = [p for p in self._waiting if p.retry_at > now]
        for pending in due:
            self._produce(pending)

    def close(self, timeout: float) -> int:
        """Deliver what is queued (bounded); returns how many are still undelivered."""
        remaining: int = self._producer.flush(timeout)
        if self._table is not None:
            self._table.close()
        return remaining


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


class DeadLetterTable:
    """`dlq.lance_table_uri`: dead letters also appended to a Lance table, off the loop
    thread. Best effort next to the topic (which is what gates offset commits): a failed
    append is logged, not retried."""

    def __init__(self, uri: str, storage_options: dict[str, str] | None) -> None:
        self.uri = uri
        self.options = storage_options or None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlq-table")

    def append(self, letters: list[DeadLetter]) -> None:
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
        self._pool.submit(self._write, pa.Table.from_pylist(rows, schema=DEAD_LETTER_SCHEMA))

    def _write(self, table: pa.Table) -> None:
        try:
            lance.write_dataset(table, self.uri, mode="append", storage_options=self.options)
        except (OSError, ValueError, RuntimeError) as exc:
            log.warning("dlq_table_append_failed", uri=self.uri, error=str(exc))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
