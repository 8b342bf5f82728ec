"""A test plugin for sink processes: slows flushes or stalls the WAL of a real sink.

Loaded by the sink itself through `backpressure.controller = "tests.support.slow:controller"`
(the documented injection point), it wraps two real storage operations with delays and
returns the ordinary budget controller. Nothing is mocked: Lance commits and WAL appends
still happen, only later.

    LANCE_SINK_TEST_FLUSH_DELAY_S   sleep before every flush commit
    LANCE_SINK_TEST_WAL_STALL_S     one stall of the WAL (after LANCE_SINK_TEST_WAL_STALL_AFTER
                                    appends, default 5)
    LANCE_SINK_TEST_REPLAY_DELAY_S  sleep in every shard open (claim + replay), or only in
                                    those of LANCE_SINK_TEST_REPLAY_DELAY_PARTITIONS
                                    (comma-separated partition numbers) if set
    LANCE_SINK_TEST_DECODE_JITTER_S a random sleep of up to this long in every decode, so
                                    decode workers finish batches out of order
    LANCE_SINK_TEST_LOOKUP_DELAY_S  sleep in every key lookup (a query still running when
                                    the sink stops)
    LANCE_SINK_TEST_REFUSE_ID       the table refuses every row whose ``id`` is this value
                                    (`TableSpec.validate` raises `InvalidRecord` naming the
                                    row, as for a value the decoder passed and Lance cannot
                                    store)
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import pyarrow as pa

from engine.backpressure import BudgetController
from engine.engine import Engine
from engine.errors import InvalidRecord
from engine.reader import Reader
from engine.schema import TableSpec
from engine.shard import ShardWriter
from engine.storage import LocalStorage
from engine.table import BaseTable
from sink.decode import Decoded, Decoder


def controller(*, process_budget_bytes: int, max_unflushed_memtable_bytes: int) -> BudgetController:
    flush_delay = float(os.environ.get("LANCE_SINK_TEST_FLUSH_DELAY_S", "0"))
    wal_stall = float(os.environ.get("LANCE_SINK_TEST_WAL_STALL_S", "0"))
    stall_after = int(os.environ.get("LANCE_SINK_TEST_WAL_STALL_AFTER", "5"))
    replay_delay = float(os.environ.get("LANCE_SINK_TEST_REPLAY_DELAY_S", "0"))
    decode_jitter = float(os.environ.get("LANCE_SINK_TEST_DECODE_JITTER_S", "0"))
    lookup_delay = float(os.environ.get("LANCE_SINK_TEST_LOOKUP_DELAY_S", "0"))
    refuse_id = os.environ.get("LANCE_SINK_TEST_REFUSE_ID")
    if refuse_id:
        validate = TableSpec.validate

        def refusing_validate(self: TableSpec, batch: pa.RecordBatch) -> pa.RecordBatch:
            ids = batch.column("id").to_pylist()
            if refuse_id in ids:
                raise InvalidRecord(
                    "the test refuses this id", column="id", row=ids.index(refuse_id)
                )
            return validate(self, batch)

        TableSpec.validate = refusing_validate  # type: ignore[method-assign]
    if lookup_delay:
        lookup = Reader.lookup

        def slow_lookup(self: Reader, *args: Any, **kwargs: Any) -> Any:
            print("TEST_LOOKUP_STARTED", flush=True)
            time.sleep(lookup_delay)
            return lookup(self, *args, **kwargs)

        Reader.lookup = slow_lookup  # type: ignore[method-assign]
    if decode_jitter:
        decode = Decoder.decode
        rng = random.Random(7)

        def jittery_decode(self: Decoder, messages: Any) -> Decoded:
            time.sleep(rng.uniform(0, decode_jitter))
            return decode(self, messages)

        Decoder.decode = jittery_decode  # type: ignore[method-assign]
    slow_partitions = {
        int(p)
        for p in os.environ.get("LANCE_SINK_TEST_REPLAY_DELAY_PARTITIONS", "").split(",")
        if p
    }
    if replay_delay and slow_partitions:
        open_shard = Engine.open_shard

        def slow_open(
            self: Engine, topic: str, partition: int, *, assigned_at: float | None = None
        ) -> ShardWriter:
            if partition in slow_partitions:
                time.sleep(replay_delay)
            return open_shard(self, topic, partition, assigned_at=assigned_at)

        Engine.open_shard = slow_open  # type: ignore[method-assign]
    elif replay_delay:
        open_writer = ShardWriter.open  # bound to the class: called as ShardWriter.open(...)

        def slow_open_writer(*args: Any, **kwargs: Any) -> ShardWriter:
            time.sleep(replay_delay)
            return open_writer(*args, **kwargs)

        ShardWriter.open = slow_open_writer  # type: ignore[method-assign]
    if flush_delay:
        commit = BaseTable.commit_flush

        def slow_commit(self: BaseTable, *args: Any, **kwargs: Any) -> int:
            time.sleep(flush_delay)
            return commit(self, *args, **kwargs)

        BaseTable.commit_flush = slow_commit  # type: ignore[method-assign]
    if wal_stall:
        put = LocalStorage.put_if_absent
        lock = threading.Lock()
        state = {"appends": 0, "stalled": False}

        def stalling_put(self: LocalStorage, key: str, data: Any, **kwargs: Any) -> None:
            if "/wal/" in key:
                with lock:
                    state["appends"] += 1
                    stall = not state["stalled"] and state["appends"] > stall_after
                    if stall:
                        state["stalled"] = True
                if stall:
                    print(f"TEST_WAL_STALL {wal_stall}", flush=True)
                    time.sleep(wal_stall)
            put(self, key, data, **kwargs)

        LocalStorage.put_if_absent = stalling_put  # type: ignore[method-assign]
    return BudgetController(process_budget_bytes)
