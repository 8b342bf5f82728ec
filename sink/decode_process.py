"""Decoding in worker processes: `source.decode_workers` without the GIL.

The sink's consumer loop, WAL appends and memtable inserts are Python threads of one
process, and so is decoding on `source.decode_workers` threads: on vector JSON the
interpreter lock, not the cores, bounds the sink (bench/results/e2e.txt: its Python
threads together use about one core while cores are left idle). With
``source.decode_processes`` each decode thread hands its batch to a worker process of its
own and waits for the answer without holding the lock; the worker runs the very
`sink.decode.Decoder`, so rows and dead letters are the same. The price is CPU: a copy of
every value in and of every row out, and a decoder per worker.

A batch crosses as its values copied one after another into a shared memory segment,
plus the other columns pickled through a pipe (offsets, timestamps, keys, headers: one
list each); the answer is the pickled `Decoded` without its record batch, which comes back
as an Arrow IPC stream in a second segment. (Pickling the values one by one cost the
sink's process a fifth of its time, and a pipe moves ~1 GB/s, a copy in the kernel on both
sides: ~8 us of CPU per 4 KB vector message.) What the worker raises
(`RegistryUnavailable`, `SchemaEvolution`, a bug) is raised by `decode` in the caller's
thread, as the in-process decoder would (an exception that cannot be pickled arrives as a
`RuntimeError` naming it).

Lifecycle: `ProcessDecoder` starts its workers (spawned: no copy of the parent's threads
or locks) when built and each decode thread takes one at its first batch; a worker that
died (killed, out of memory) is started again and the batch sent once more; `close` stops
them. A worker exits by itself when the sink's process goes away (its pipe closes), so a
SIGKILLed sink leaves none behind. Registry clients are per worker (each keeps its own
schema cache); an in-process ``mock://`` registry is not shared with the workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import pickle
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any, cast

import numpy as np
import pyarrow as pa
import structlog

from config.settings import SourceSettings
from engine.malloc import set_mmap_threshold
from engine.schema import TableSpec
from sink.decode import Decoder, freeze_gc
from sink.decode_total import total
from sink.decoded import Decoded, MessageLike, value_sizes
from sink.formats import SchemaCheckMode
from sink.log import LogConfig, configure_logging

log = structlog.get_logger("lance_sink.sink")

#: First size of each worker's two shared memory segments (grown when a batch needs more).
SEGMENT_BYTES = 8 << 20
#: A decode worker's malloc serves blocks below this from its heaps (see `_serve`).
WORKER_MMAP_THRESHOLD = 64 << 20


@dataclass(frozen=True, slots=True)
class Batch:
    """One topic-partition's messages as columns, but for their values (what crosses to a
    worker pickled; the values cross in a shared memory segment)."""

    topic: str
    partition: int
    offsets: list[int]
    timestamps: list[tuple[int, int]]
    keys: list[bytes | None]
    headers: list[Any]
    #: Each value's length in `values`, -1 for a tombstone (None).
    lengths: np.ndarray

    @classmethod
    def of(cls, messages: Sequence[MessageLike]) -> tuple[Batch, list[bytes]]:
        """The batch of `messages`, and their values (tombstones left out) in order."""
        first = messages[0]
        values = [m.value() for m in messages]
        lengths = value_sizes(values)
        batch = cls(
            first.topic() or "",
            first.partition() or 0,
            [m.offset() or 0 for m in messages],
            [m.timestamp() for m in messages],
            [m.key() for m in messages],
            [m.headers() for m in messages],
            lengths,
        )
        return batch, cast("list[bytes]", [v for v in values if v is not None])

    @property
    def nbytes(self) -> int:
        """The values' size, joined."""
        return int(np.maximum(self.lengths, 0).sum())

    def messages(self, joined: memoryview) -> list[_Message]:
        """The messages again, each value copied out of `joined` (the values joined)."""
        t, p = self.topic, self.partition
        ends = np.cumsum(np.maximum(self.lengths, 0)).tolist()
        starts = [0, *ends[:-1]]
        values = [
            None if n < 0 else bytes(joined[a:b])
            for n, a, b in zip(self.lengths.tolist(), starts, ends, strict=True)
        ]
        return [
            _Message(t, p, o, ts, k, v, h)
            for o, ts, k, v, h in zip(
                self.offsets, self.timestamps, self.keys, values, self.headers, strict=True
            )
        ]


class _Message:
    """A consumed message rebuilt in the worker (the accessors `Decoder` reads)."""

    __slots__ = ("_headers", "_key", "_offset", "_partition", "_timestamp", "_topic", "_value")

    def __init__(
        self,
        topic: str,
        partition: int,
        offset: int,
        timestamp: tuple[int, int],
        key: bytes | None,
        value: bytes | None,
        headers: Any,
    ) -> None:
        self._topic, self._partition, self._offset = topic, partition, offset
        self._timestamp, self._key, self._value, self._headers = timestamp, key, value, headers

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return self._timestamp

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> Any:
        return self._headers


def _serve(
    conn: Connection,
    spec: TableSpec,
    source: SourceSettings,
    schema_check: SchemaCheckMode,
    log_config: LogConfig | None,
) -> None:
    """A worker: decode every batch that arrives until the pipe closes. It logs as the
    sink's process does (`log_config`: level and format), to the same standard error.

    A request is the pickled `Batch` with the names of the request segment (holding its
    values) and of the response segment, and the values' size. The answer is the pickled
    outcome (`Decoded` without its record batch, or the exception raised) with the size of
    the record batch's Arrow IPC stream, written into the response segment, or sent
    through the pipe when it does not fit there.
    """
    # The sink's process bounds malloc (`engine.malloc.tune_malloc`) and its environment
    # carries the 1 MiB mmap threshold here; a worker reuses a few large buffers per batch,
    # which a fresh mapping each time turns into page faults (measured: 12% slower).
    set_mmap_threshold(WORKER_MMAP_THRESHOLD)
    if log_config is not None:
        configure_logging(*log_config)
    decoder = Decoder(spec, source, schema_check=schema_check)
    freeze_gc()  # as the sink's loop does
    segments = Attached()
    try:
        conn.send(("ready", None))
        while True:
            batch, request, size, response = conn.recv()
            conn.send(answer(decoder, segments, batch, request, size, response))
    except (EOFError, OSError):  # the sink is gone (or closed us)
        pass
    finally:
        segments.close()


class Attached:
    """A worker's view of the sink's two segments, by role: attached once, and again only
    when the sink replaced one (a new name: it grew). Made by the worker when it starts;
    `close` when it exits."""

    def __init__(self) -> None:
        self._segments: dict[str, shared_memory.SharedMemory] = {}

    def buf(self, role: str, name: str) -> memoryview:
        """The buffer of the segment called `name` in `role` ("request" or "response")."""
        segment = self._segments.get(role)
        if segment is None or segment.name != name:
            if segment is not None:
                segment.close()
            # (Spawned workers share the sink's resource tracker, which unlinks the
            # segments if the sink's process dies without doing so.)
            segment = self._segments[role] = shared_memory.SharedMemory(name=name)
        buf = segment.buf
        assert buf is not None
        return buf

    def close(self) -> None:
        """Let go of the segments (the sink's process unlinks them)."""
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()


def answer(
    decoder: Decoder,
    segments: Attached,
    batch: Batch,
    request: str,
    size: int,
    response: str,
) -> tuple[tuple[str, Any], int, bytes | pa.Buffer | None]:
    """The worker's side of one batch: decoded by `decoder` from its values in the request
    segment, its rows written into the response segment.

    Args:
        decoder: the worker's decoder.
        segments: the worker's view of the sink's segments.
        batch: the batch but for its values.
        request: the name of the request segment, holding the values joined.
        size: the values' size in it.
        response: the name of the response segment.

    Returns:
        The outcome (``("ok", Decoded without its batch)`` or ``("error", the exception)``:
        one that pickle refuses is a `RuntimeError` naming it, so it can cross), the size
        of the rows' Arrow IPC stream, and that stream itself when it does not fit in the
        response segment (None when it was written there).
    """
    rows: bytes | pa.Buffer = b""
    try:
        decoded = decoder.decode(batch.messages(segments.buf("request", request)[:size]))
        if decoded.batch is not None:
            rows = _ipc(decoded.batch)
        answer: tuple[str, Any] = ("ok", dataclasses.replace(decoded, batch=None))
    except Exception as exc:  # noqa: BLE001 - raised again in the sink's thread
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - any reason it cannot cross: its text does
            exc = RuntimeError(f"{type(exc).__name__} in a decode worker: {exc}")
        answer = ("error", exc)
    if rows and len(rows) <= len(out := segments.buf("response", response)):
        out[: len(rows)] = memoryview(rows).cast("B")
        return answer, len(rows), None
    return answer, len(rows), rows or None


def _ipc(batch: pa.RecordBatch) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


class _Worker:
    """One worker process, the sink's end of its pipe, and two shared memory segments the
    sink's process owns: values go in one, record batches come back in the other (each
    grown, as a new segment, when a batch needs more)."""

    def __init__(self, ctx: Any, args: tuple[Any, ...], name: str) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_serve, args=(child, *args), name=name, daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.request = shared_memory.SharedMemory(create=True, size=SEGMENT_BYTES)
        self.response = shared_memory.SharedMemory(create=True, size=SEGMENT_BYTES)

    def call(self, batch: Batch, values: list[bytes]) -> Decoded:
        if not self.ready:
            kind, error = self.conn.recv()
            if kind != "ready":
                raise RuntimeError(f"decode worker did not start: {error}")
            self.ready = True
        nbytes = batch.nbytes
        if nbytes > self.request.size:
            self.request = _grown(self.request, nbytes)
        buf = self.request.buf
        assert buf is not None
        # Each value straight into the segment: joining them first made a fresh buffer of
        # the batch's size (its own mapping: page faults on every batch) and copied twice.
        end = 0
        for value in values:
            start, end = end, end + len(value)
            buf[start:end] = value
        self.conn.send((batch, self.request.name, nbytes, self.response.name))
        (kind, answer), size, inline = self.conn.recv()
        if kind == "error":
            raise answer
        decoded: Decoded = answer
        if size:
            if inline is None:
                out = self.response.buf
                assert out is not None
                # Copied (the segment is reused by the next batch) into Arrow's pool, which
                # keeps its blocks, rather than a fresh mapping.
                rows = pa.allocate_buffer(size)
                np.frombuffer(rows, np.uint8)[:] = np.frombuffer(out, np.uint8, size)
                inline = rows
            else:  # it did not fit: a larger segment for the next batches
                self.response = _grown(self.response, size)
            reader = pa.ipc.open_stream(pa.py_buffer(inline))
            decoded = dataclasses.replace(decoded, batch=reader.read_next_batch())
        return decoded

    def stop(self, timeout: float) -> None:
        self.conn.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
        for segment in (self.request, self.response):
            segment.close()
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()


def _grown(old: shared_memory.SharedMemory, need: int) -> shared_memory.SharedMemory:
    """A new segment for at least `need` bytes (twice that: room for the next batches);
    the old one is released (the worker lets go of it when it sees the new name)."""
    new = shared_memory.SharedMemory(create=True, size=2 * need)
    old.close()
    with contextlib.suppress(FileNotFoundError):
        old.unlink()
    return new


class _WorkerDied(RuntimeError):
    """A decode worker died twice on one batch."""


class ProcessDecoder:
    """`Decoder.decode` run in `workers` worker processes (see the module docstring).

    Each calling thread uses a worker of its own: call `decode` from at most `workers`
    threads at once (the sink's `source.decode_workers` pool).
    """

    def __init__(
        self,
        spec: TableSpec,
        source: SourceSettings,
        *,
        schema_check: SchemaCheckMode,
        workers: int,
        log_config: LogConfig | None = None,
    ) -> None:
        # Fail here, in the sink's process, on a mapping that can never work.
        Decoder(spec, source, schema_check=schema_check)
        self._ctx = multiprocessing.get_context("spawn")
        self._args = (spec, source, schema_check, log_config)
        self._lock = threading.Lock()
        self._idle = [self._start(i) for i in range(workers)]
        self._all = list(self._idle)
        self._local = threading.local()
        self._closed = False

    def _start(self, i: int) -> _Worker:
        return _Worker(self._ctx, self._args, f"lance-sink-decode-{i}")

    def decode(self, messages: Sequence[MessageLike]) -> Decoded:
        """As `Decoder.decode`, in this thread's worker process.

        A batch a worker dies on twice (a message that crashes the decoder's native code,
        or one that takes more memory than the worker may have) is split in halves, each
        decoded the same way, until the message it dies on is alone: that message is a
        ``decode_error`` dead letter, the others decode as they would have
        (`sink.decode_total.total`, as for what a decoder raises).

        Raises:
            ValueError: `messages` is empty.
            RuntimeError: the decoder is closed.
        """
        if not messages:
            raise ValueError("decode needs at least one message")
        return total(self._decode_once, messages, catch=_WorkerDied)

    def _decode_once(self, messages: Sequence[MessageLike]) -> Decoded:
        """`messages` decoded by this thread's worker, or by a new one if it dies.

        Raises:
            _WorkerDied: the new worker died on the batch too.
        """
        if self._closed:
            raise RuntimeError("the decoder is closed")
        batch, values = Batch.of(messages)
        worker = self._worker()
        try:
            return worker.call(batch, values)
        except (EOFError, OSError) as exc:  # the worker died: once more on a new one
            log.warning("decode_worker_died", worker=worker.process.name, error=repr(exc))
            worker = self._replace(worker)
            try:
                return worker.call(batch, values)
            except (EOFError, OSError) as again:
                log.warning("decode_worker_died", worker=worker.process.name, error=repr(again))
                self._replace(worker)
                raise _WorkerDied(
                    f"the decode worker process died on it twice ({again!r})"
                ) from exc

    def _worker(self) -> _Worker:
        worker: _Worker | None = getattr(self._local, "worker", None)
        if worker is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the decoder is closed")
                worker = self._idle.pop() if self._idle else self._start(len(self._all))
                if worker not in self._all:
                    self._all.append(worker)
            self._local.worker = worker
        return worker

    def _replace(self, dead: _Worker) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the decoder is closed")
            dead.stop(0.1)
            worker = self._start(self._all.index(dead))
            self._all[self._all.index(dead)] = worker
        self._local.worker = worker
        return worker

    def close(self, timeout: float = 2.0) -> None:
        """Stop every worker (idempotent); a batch still being decoded is abandoned."""
        with self._lock:
            self._closed = True
            workers, self._all, self._idle = self._all, [], []
        for worker in workers:
            worker.stop(timeout)
