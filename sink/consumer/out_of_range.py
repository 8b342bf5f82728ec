"""Out of range: what the sink does when the broker refuses a partition's fetch offset.

librdkafka's auto.offset.reset is "error" (`sink.consumer.conf`), so a fetch offset the
broker no longer has (or does not have yet) is reported to the sink as a message error
instead of being replaced silently. `refused` looks the partition's log range up on the
open pool (a round trip to the broker); `service` (every loop iteration) acts on it as
`out_of_range_action` says, and fetches again the offsets whose wait is over. It is a
sub-state of ACTIVE (`PartitionState.out_of_range`, `.out_of_range_retry`,
`.out_of_range_since`), forgotten by every transition out of ACTIVE (fetching then
resumes from `position`, where a refusal that stands comes back), and may end the
partition in STOPPED.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, Literal

import confluent_kafka
import structlog
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._listoffsets import OffsetSpec  # not re-exported for typing

from sink.consumer.flow import Flow
from sink.consumer.partition import PartitionState, PartitionTable, Phase
from sink.consumer.pipeline import Pipeline
from sink.metrics import Metrics

log = structlog.get_logger("lance_sink.sink")

# Longest wait for a partition's log range after the broker refused a fetch offset.
LOG_RANGE_TIMEOUT_S: Final = 10.0
# An offset past the log end stops its partition only when the broker keeps refusing it
# for this long (asked again every `OUT_OF_RANGE_RETRY_S`): a broker that just restarted
# may report its log end late, which no truncation explains.
OUT_OF_RANGE_GRACE_S: Final = 10.0
OUT_OF_RANGE_RETRY_S: Final = 1.0


class OutOfRange:
    """Refused fetch offsets and what is done about them (see the module docstring)."""

    def __init__(
        self,
        partitions: PartitionTable,
        flow: Flow,
        pipeline: Pipeline,
        metrics: Metrics,
        pool: ThreadPoolExecutor,
        admin_conf: dict[str, Any],
    ) -> None:
        self.partitions = partitions
        self.flow = flow
        self.pipeline = pipeline
        self.metrics = metrics
        self.pool = pool
        self.admin_conf = admin_conf
        self._admin: AdminClient | None = None  # made when first needed

    def refused(
        self, topic: str, partition: int, offset: int, err: confluent_kafka.KafkaError
    ) -> None:
        """The broker has no message at `offset`, the partition's fetch position, and
        librdkafka stopped fetching it: look its log range up on the open pool and act on
        it in `service`."""
        state = self.partitions.get((topic, partition))
        if state is None or state.out_of_range is not None or state.phase is not Phase.ACTIVE:
            return  # not fetched from there: a refusal that stands comes back on resume
        if state.out_of_range_since is None:  # the first refusal in a row (see below)
            log.warning(
                "offset_out_of_range",
                topic=topic,
                partition=partition,
                offset=offset,
                error=err.str(),
            )
        if offset < 0:
            # A logical start (`START_AT`) the broker could not resolve: asked again after
            # a while, as an offset back in the log is (not at once, in a loop with it).
            now = time.monotonic()
            if state.out_of_range_since is None:
                state.out_of_range_since = now
            state.out_of_range_retry = (offset, now + OUT_OF_RANGE_RETRY_S)
            return
        if self._admin is None:
            self._admin = AdminClient(self.admin_conf)
        lookup = self.pool.submit(log_range, self._admin, topic, partition)
        state.out_of_range = (offset, lookup)

    def idle(self) -> bool:
        """Whether no refused fetch offset waits for its look-up or its retry (a quiet
        loop ticks only now and then: `sink.service.QUIET_TICK_INTERVAL_S`)."""
        return all(
            s.out_of_range is None and s.out_of_range_retry is None
            for s in self.partitions.states()
        )

    def service(self) -> None:
        """Act on the log ranges looked up for refused fetch offsets and fetch again those
        whose wait is over."""
        now = time.monotonic()
        for state in self.partitions.states():
            retry = state.out_of_range_retry
            if retry is not None and now >= retry[1]:
                state.out_of_range_retry = None
                self._fetch_from(state, retry[0])
            pending = state.out_of_range
            if pending is None or not pending[1].done():
                continue
            state.out_of_range = None
            offset, lookup = pending
            try:
                low, high = lookup.result()
            except confluent_kafka.KafkaException as exc:
                # Fetching again asks the broker again; a refusal that stands comes back.
                state.log.warning(
                    "log_range_lookup_failed",
                    error=str(exc),
                )
                state.out_of_range_retry = (offset, now + OUT_OF_RANGE_RETRY_S)
                continue
            self.resolve(state, offset, low, high)

    def resolve(self, state: PartitionState, offset: int, low: int, high: int) -> None:
        """The broker refused `offset` of a partition whose log spans [`low`, `high`)."""
        action = out_of_range_action(offset, low, high)
        where = {"topic": state.topic, "partition": state.partition, "offset": offset}
        if action == "retry":  # asked again after a while: ListOffsets and fetches disagree
            log.info("offset_in_range_again", **where, log_start=low, log_end=high)
            state.out_of_range_retry = (offset, time.monotonic() + OUT_OF_RANGE_RETRY_S)
        elif action == "skip":
            log.error("offsets_deleted_before_read", **where, log_start=low, skipped=low - offset)
            self.metrics.offsets_skipped(state.topic, state.partition, low - offset)
            self.pipeline.skip_offsets(state, offset, low - 1)
            self._fetch_from(state, low)
        else:
            now = time.monotonic()
            if state.out_of_range_since is None:
                state.out_of_range_since = now
                log.warning(
                    "offset_past_log_end", **where, log_end=high, grace_s=OUT_OF_RANGE_GRACE_S
                )
            if now - state.out_of_range_since < OUT_OF_RANGE_GRACE_S:
                state.out_of_range_retry = (offset, now + OUT_OF_RANGE_RETRY_S)
                return
            log.error("partition_stopped_offset_out_of_range", **where, log_end=high)
            self.pipeline.stop(
                state,
                f"offset {offset} is past the log end {high}: the partition's log was "
                "truncated or its topic created again",
            )

    def _fetch_from(self, state: PartitionState, offset: int) -> None:
        if not self.flow.refetch(state, offset):
            state.out_of_range_retry = (offset, time.monotonic() + OUT_OF_RANGE_RETRY_S)


def log_range(admin: AdminClient, topic: str, partition: int) -> tuple[int, int]:
    """A partition's log start and end (high watermark), from ListOffsets through an admin
    client of the sink's own: the consumer's look-up (`get_watermark_offsets`) of a
    partition whose fetch offset it had just been refused took up to 18 s, past its timeout.

    Raises:
        KafkaException: the brokers did not answer within `LOG_RANGE_TIMEOUT_S`.
    """
    tp = TopicPartition(topic, partition)
    specs = (OffsetSpec.earliest(), OffsetSpec.latest())  # type: ignore[no-untyped-call]
    start, end = (
        next(iter(admin.list_offsets({tp: spec}, request_timeout=LOG_RANGE_TIMEOUT_S).values()))
        for spec in specs
    )
    return start.result().offset, end.result().offset


def out_of_range_action(offset: int, low: int, high: int) -> Literal["skip", "stop", "retry"]:
    """What the sink does when the broker refused to fetch `offset` of a partition whose
    log spans [`low`, `high`) (librdkafka's auto.offset.reset is "error", so it never jumps
    silently):

    - "skip": `offset` lies before the log start: its messages were deleted (retention,
      DeleteRecords) before the sink read them. Nothing can bring them back; the sink
      resumes at the log start, counts the skipped offsets
      (``lance_sink_offsets_skipped_total``) and logs ``offsets_deleted_before_read``.
    - "stop": `offset` lies past the log end: the log was truncated (an unclean leader
      election) or the topic deleted and created again, so the offsets now in the log
      are not the ones the sink read. Resuming anywhere could drop rows (offsets below
      the ones already durable are taken for done) or duplicate them: the partition stops
      (``/readyz`` names it, ``lance_sink_partition_stopped`` is 1) until an operator
      resolves it, once the broker has refused the offset for `OUT_OF_RANGE_GRACE_S` (a
      broker that just restarted may report its log end late).
    - "retry": `offset` is in the log now (a transient refusal): fetch it again.
    """
    if offset < low:
        return "skip"
    if offset > high:
        return "stop"
    return "retry"
