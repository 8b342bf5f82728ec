"""`ProcessDecoder` (source.decode_processes): the same rows and dead letters as
`Decoder` on the same messages, errors raised in the caller's thread, a killed worker
replaced, and nothing left behind (worker processes, shared memory) after `close` or after
the sink's process is SIGKILLed. Real worker processes and real shared memory."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from config.settings import SourceSettings, TableSettings
from engine.errors import PersistenceError
from engine.schema import TableSpec
from sink import decode_process
from sink.decode import Decoded, Decoder
from sink.decode_process import ProcessDecoder
from sink.formats import RegistryUnavailable, SchemaEvolution
from tests.support.procs import running
from tests.unit.test_decode import Msg

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
DIM = 8


def spec(tmp_path: Path, mode: str = "append") -> TableSpec:
    raw: dict[str, Any] = {
        "uri": str(tmp_path / "t.lance"),
        "mode": mode,
        "columns": [
            {"name": "id", "type": "string", "nullable": False},
            {"name": "n", "type": "int64"},
            {"name": "text", "type": "string"},
        ],
        "vector": {"column": "vec", "dim": DIM, "metric": "l2"},
    }
    if mode == "upsert":
        raw["primary_key"] = ["id"]
    return TableSpec.from_settings(TableSettings.model_validate(raw))


def corpus(n: int, text: int = 40) -> list[Msg]:
    """Good rows with every kind of fault and a tombstone among them."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        body: Any = {
            "id": f"k-{i}",
            "n": i,
            "text": "w" * text,
            "vec": rng.standard_normal(DIM).round(4).tolist(),
        }
        value: bytes | None = json.dumps(body).encode()
        if i % 97 == 5:
            value = b"{not json"
        elif i % 97 == 11:
            body["vec"] = body["vec"][:3]
            value = json.dumps(body).encode()
        elif i % 97 == 17:  # beyond float32: infinity
            body["vec"][0] = 1e39
            value = json.dumps(body).encode()
        elif i % 97 == 23:
            value = None  # a tombstone
        elif i % 97 == 29:
            value = b"x" * 2_000_000  # beyond source.max_message_bytes (1 MiB)
        headers = [("h", str(i).encode()), ("none", None)] if i % 3 else None
        out.append(
            Msg(
                value,
                offset_=1000 + i,
                key_=f"k-{i}".encode(),
                timestamp_=(1, 1_700_000_000_000 + i),
                headers_=headers,
                topic_="t",
                partition_=2,
            )
        )
    return out


def same(a: Decoded, b: Decoded) -> None:
    assert (a.batch is None) == (b.batch is None)
    if a.batch is not None and b.batch is not None:
        assert a.batch.equals(b.batch)
        assert a.batch.schema.equals(b.batch.schema, check_metadata=True)
    assert a.dead_letters == b.dead_letters
    assert (a.skipped_offsets, a.first_offset, a.last_offset) == (
        b.skipped_offsets,
        b.first_offset,
        b.last_offset,
    )


@pytest.fixture
def decoders(tmp_path: Path) -> Iterator[tuple[Decoder, ProcessDecoder]]:
    table = spec(tmp_path)
    processes = ProcessDecoder(table, SourceSettings(), schema_check="off", workers=2)
    try:
        yield Decoder(table, SourceSettings()), processes
    finally:
        processes.close()


def test_rows_and_dead_letters_are_the_decoders(
    decoders: tuple[Decoder, ProcessDecoder],
) -> None:
    local, processes = decoders
    messages = corpus(500)
    want = local.decode(messages)
    assert want.batch is not None
    assert {d.reason for d in want.dead_letters} == {
        "invalid_json",
        "wrong_vector_dimension",
        "nan_in_vector",
        "oversized",
    }
    assert want.skipped_offsets  # the tombstones
    same(want, processes.decode(messages))


def test_batches_larger_than_the_shared_segments(
    decoders: tuple[Decoder, ProcessDecoder],
) -> None:
    """Values beyond the request segment and rows beyond the response segment: both grow
    (the rows come back through the pipe once), and later batches use the grown ones."""
    local, processes = decoders
    big = corpus(3000, text=3000)  # ~9 MB of values, ~9 MB of rows
    assert sum(len(m.value() or b"") for m in big) > decode_process.SEGMENT_BYTES
    for _ in range(3):
        same(local.decode(big), processes.decode(big))
    small = corpus(10)
    same(local.decode(small), processes.decode(small))


def test_several_threads_at_once(decoders: tuple[Decoder, ProcessDecoder]) -> None:
    local, processes = decoders
    batches = [corpus(200 + 50 * i) for i in range(8)]
    with ThreadPoolExecutor(2) as pool:  # the sink's decode_workers pool
        got = list(pool.map(processes.decode, batches))
    for batch, answer in zip(batches, got, strict=True):
        same(local.decode(batch), answer)


def test_an_unreachable_registry_is_raised_in_the_callers_thread(tmp_path: Path) -> None:
    """The partition waits and retries on RegistryUnavailable: it must arrive as itself."""
    source = SourceSettings.model_validate(
        {
            "format": "avro",
            "schema_registry": {"url": "http://127.0.0.1:9"},
        }
    )
    table = spec(tmp_path)
    processes = ProcessDecoder(table, source, schema_check="off", workers=1)
    try:
        framed = b"\x00" + (42).to_bytes(4, "big") + b"\x02"
        with pytest.raises(RegistryUnavailable) as caught:
            processes.decode([Msg(framed, timestamp_=(1, 1), topic_="t", partition_=0)])
        with pytest.raises(RegistryUnavailable) as local:
            Decoder(table, source).decode(
                [Msg(framed, timestamp_=(1, 1), topic_="t", partition_=0)]
            )
        assert str(caught.value) == str(local.value)
    finally:
        processes.close()


def test_lance_sink_errors_cross_processes_whole() -> None:
    evolution = pickle.loads(pickle.dumps(SchemaEvolution("new fields", (3, 4))))  # noqa: S301
    assert isinstance(evolution, SchemaEvolution)
    assert evolution.schema_ids == (3, 4)
    assert str(evolution) == "new fields"
    error = PersistenceError("write failed", shard="s-1", tries=2)
    error = pickle.loads(pickle.dumps(error))  # noqa: S301
    assert isinstance(error, PersistenceError)
    assert error.context == {"shard": "s-1", "tries": 2}
    assert error.message == "write failed"
    assert str(error) == "write failed [shard=s-1 tries=2]"


def test_a_killed_worker_is_replaced(
    decoders: tuple[Decoder, ProcessDecoder], capsys: pytest.CaptureFixture[str]
) -> None:
    local, processes = decoders
    messages = corpus(300)
    same(local.decode(messages), processes.decode(messages))
    worker = processes._local.worker
    os.kill(worker.process.pid, signal.SIGKILL)
    worker.process.join(10)
    same(local.decode(messages), processes.decode(messages))  # on a new worker
    assert processes._local.worker is not worker
    assert "decode_worker_died" in capsys.readouterr().out


def test_a_message_a_worker_dies_on_is_a_decode_error_dead_letter(
    decoders: tuple[Decoder, ProcessDecoder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker process killed whenever its batch holds one offset (as a message that
    crashes native code would kill it): the batch is split until that message is alone, it
    becomes a `decode_error` dead letter, every other message decodes as in-process."""
    local, processes = decoders
    messages = corpus(200)
    poison = messages[77].offset()
    real_call = decode_process._Worker.call
    calls: list[int] = []

    def dies_on_poison(worker: Any, batch: Any, values: list[bytes]) -> Decoded:
        calls.append(len(batch.offsets))
        if poison in batch.offsets:
            os.kill(worker.process.pid, signal.SIGKILL)
            worker.process.join(10)
        return real_call(worker, batch, values)

    monkeypatch.setattr(decode_process._Worker, "call", dies_on_poison)
    got = processes.decode(messages)
    want = local.decode(messages[:77] + messages[78:])
    letters = [d for d in got.dead_letters if d.offset == poison]
    assert [d.reason for d in letters] == ["decode_error"]
    assert "decode worker process died on it twice" in letters[0].detail
    assert [d for d in got.dead_letters if d.offset != poison] == want.dead_letters
    assert got.batch is not None
    assert want.batch is not None
    assert got.batch.equals(want.batch)
    assert (got.first_offset, got.last_offset) == (1000, 1199)
    assert got.skipped_offsets == want.skipped_offsets
    assert len(calls) <= 4 * 8  # two tries per half on the way down, log2(200) halvings


def test_close_stops_the_workers_and_frees_the_shared_memory(tmp_path: Path) -> None:
    processes = ProcessDecoder(spec(tmp_path), SourceSettings(), schema_check="off", workers=2)
    processes.decode(corpus(50))
    workers = list(processes._all)
    names = [s.name for w in workers for s in (w.request, w.response)]
    assert all(Path("/dev/shm", n.lstrip("/")).exists() for n in names)
    processes.close()
    assert all(not w.process.is_alive() for w in workers)
    assert not any(Path("/dev/shm", n.lstrip("/")).exists() for n in names)
    with pytest.raises(RuntimeError, match="closed"):
        ProcessDecoder.decode(processes, corpus(1))


def test_nothing_is_left_when_the_sinks_process_is_sigkilled(tmp_path: Path) -> None:
    """The workers see their pipe close and exit; the resource tracker unlinks the
    segments the dead process owned."""
    script = textwrap.dedent(
        f"""
        import json, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from config.settings import SourceSettings
        from sink.decode_process import ProcessDecoder
        from tests.unit.test_decode_process import corpus, spec

        if __name__ == "__main__":
            table = spec(Path({str(tmp_path)!r}))
            d = ProcessDecoder(table, SourceSettings(), schema_check="off", workers=2)
            d.decode(corpus(50))
            names = [s.name for w in d._all for s in (w.request, w.response)]
            pids = [w.process.pid for w in d._all]
            print(json.dumps({{"pids": pids, "names": names}}), flush=True)
            time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        with proc.stdout:
            started = json.loads(proc.stdout.readline())
        segments = [Path("/dev/shm", n.lstrip("/")) for n in started["names"]]
        assert all(s.exists() for s in segments)
        assert all(Path(f"/proc/{pid}").exists() for pid in started["pids"])
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 20
    while any(running(pid) for pid in started["pids"]) or any(s.exists() for s in segments):
        assert time.monotonic() < deadline, (started, [s.exists() for s in segments])
        time.sleep(0.1)


def test_a_mapping_that_cannot_work_fails_in_the_sinks_process(tmp_path: Path) -> None:
    source = SourceSettings.model_validate({"columns": {"nope": "$.x"}})
    with pytest.raises(ValueError, match="unknown table columns"):
        ProcessDecoder(spec(tmp_path), source, schema_check="off", workers=1)


class _Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


class _Failing:
    def decode(self, messages: Any) -> Decoded:
        raise _Unpicklable


def test_an_error_that_cannot_be_pickled_arrives_by_its_text() -> None:
    """The worker's side of a batch (`answer`, in this process): an exception pickle
    refuses would kill the worker when sent; it is sent as a RuntimeError naming it."""
    request = shared_memory.SharedMemory(create=True, size=1 << 20)
    response = shared_memory.SharedMemory(create=True, size=1 << 20)
    segments = decode_process.Attached()
    try:
        batch, values = decode_process.Batch.of(corpus(3))
        blob = b"".join(values)
        assert request.buf is not None
        request.buf[: len(blob)] = blob
        (kind, error), size, inline = decode_process.answer(
            _Failing(),  # type: ignore[arg-type]
            segments,
            batch,
            request.name,
            len(blob),
            response.name,
        )
        assert (kind, size, inline) == ("error", 0, None)
        assert isinstance(error, RuntimeError)
        assert str(error) == "_Unpicklable in a decode worker: holds a lock"
        pickle.dumps(error)
    finally:
        segments.close()
        for segment in (request, response):
            segment.close()
            segment.unlink()


def test_a_worker_logs_as_the_sinks_process_does(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A warning logged while a worker decodes (here: a writer schema with a field the
    derived table lacks) is a JSON line on the sink's standard error, as the sink's own
    are: workers never set up logging, so it came as console text on standard output."""
    from sink.formats.derive import derive_settings  # noqa: PLC0415
    from tests.support.registry import FakeRegistry  # noqa: PLC0415
    from tests.unit.test_formats_avro import msgs, record_schema, serializer  # noqa: PLC0415
    from tests.unit.test_formats_derive import VEC, create_table, settings  # noqa: PLC0415

    registry = FakeRegistry().start()
    try:
        reg = {"url": registry.url}
        base = [{"name": "id", "type": "string"}, VEC]
        serializer(reg, record_schema(*base))({"id": "a", "vec": bytes(16)})  # registers it
        derived = derive_settings(settings(tmp_path, {"format": "avro", "schema_registry": reg}))
        create_table(derived)
        newer = serializer(
            reg, record_schema(*base, {"name": "coupon", "type": ["null", "string"]})
        )
        processes = ProcessDecoder(
            TableSpec.from_settings(derived.table),
            derived.source,
            schema_check="warn",
            workers=1,
            log_config=("info", "json"),
        )
        try:
            out = processes.decode(msgs(newer({"id": "b", "vec": bytes(16), "coupon": "c"})))
        finally:
            processes.close()
    finally:
        registry.stop()
    assert out.batch is not None
    assert out.batch.column("id").to_pylist() == ["b"]
    captured = capfd.readouterr()
    lines = [json.loads(line) for line in captured.err.splitlines() if line.startswith("{")]
    warned = [e for e in lines if e.get("event") == "schema_fields_not_in_table"]
    assert len(warned) == 1, captured
    assert warned[0]["level"] == "warning"
    assert warned[0]["fields"] == ["coupon (new, string)"]
