"""Benchmark `sink.decode.Decoder` against two parsing yardsticks on the same data.

Run: ``python -m bench.decode [--runs N] [--small N] [--vectors N] [--batch N] [--only SETS]
[--avro N] [--out FILE]``

Two data sets of real `confluent_kafka.Message` objects (one topic-partition):

- small: ~200-byte JSON objects (string, int, float, bool, epoch-ms timestamp, text);
- vector: 384-dim float32 embeddings as a JSON array (float32 shortest repr, as
  ``orjson.dumps(..., option=OPT_SERIALIZE_NUMPY)`` writes them) plus ~200 chars of text;
- base64: the same vectors with ``vector.encoding = "base64_f32"`` (a base64 string of the
  little-endian float32 bytes).

For each, in one process, the median of ``--runs`` runs of:

- decoder: `Decoder.decode` over all messages in batches of ``--batch`` (what one
  ``consume()`` returns for one partition), values read through the Message accessors,
  output a `RecordBatch` that the engine accepts;
- decoder, 1% bad: the same with one message in 100 invalid (the screening path);
- (a) orjson: ``orjson.loads`` per message and nothing else, results dropped (the naive
  parse ceiling; GC paused, which changes nothing here as nothing stays alive);
- (b) bulk parse: the decoder's bulk path alone: the same chunks (~4 MiB), wrapping, schema
  and block options, one `pyarrow.json.read_json` call per chunk, nothing else;
- (c) naive: orjson per message, then `pa.array` / `np.array` per column, no validation,
  GC paused (not a yardstick of the brief; it shows what the bulk design buys);
- decoder, Arrow only (vector tables): ``Decoder(vector_fast_path=False)``, the path before
  `sink.vector_json` and the reference it is tested against;
- decoder Nw (vector tables): as the sink runs it: batches of ~8 MiB decoded by N threads
  sharing one decoder (``source.decode_workers``); "Arrow only" as above. The vector
  scan (`sink.vector_scan`, simdjson in C++) and Arrow's reader work outside the GIL, so
  on vector JSON a second worker adds a core (before the scan, pysimdjson held the GIL and
  a second worker added nothing);
- decoder 2 processes (vector tables): the same batches from two threads, each handing
  them to a decode worker process of its own (``source.decode_processes``): the decode
  ceiling of the two cores, copies in and out included;
- (d) simdjson as_buffer (vector): pysimdjson per message, the vector copied as doubles
  with ``Array.as_buffer`` and cast to one float32 matrix per batch, scalars read, no
  checks: the parse ceiling of the pysimdjson path (`sink.vector_json`);
- (e) orjson/msgspec->numpy row (vector): the other parsers measured for the fast path,
  each vector's Python floats assigned into a preallocated float32 matrix row.

Avro (``--avro N`` messages per data set, 0 = skip), in the Confluent wire format from
confluent-kafka's `AvroSerializer` into its in-process ``mock://`` registry: small records
(the same fields), and 384-dim vectors as ``array<float>`` and as ``bytes`` holding
little-endian float32. Paths: the decoder (``source.format = "avro"``), (f) fastavro's
``schemaless_reader`` per message after the 5-byte header, results dropped (the per-message
decoding ceiling; the vector-as-bytes form then leaves only a ``numpy.frombuffer``), and (g)
confluent-kafka's ``AvroDeserializer`` per message, results dropped (what the decoder
called per message before it read with fastavro directly).

Runs interleave the paths so drift on a shared machine hits all alike; on the 2-core VM
used so far, threaded paths still vary by up to ~30% between processes.

MB/s counts JSON value bytes. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import confluent_kafka
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.json as pj

from config.settings import SourceSettings, TableSettings
from engine.schema import TableSpec
from sink import json_parse
from sink.decode import Decoder
from sink.decode_process import ProcessDecoder
from sink.decoded import value_sizes

TOPIC = "bench"
DIM = 384


@dataclass
class Dataset:
    name: str
    spec: TableSpec
    messages: list[confluent_kafka.Message]

    @property
    def payload_bytes(self) -> int:
        return sum(len(m.value()) for m in self.messages)


def _spec(columns: list[dict[str, Any]], dim: int | None) -> TableSpec:
    raw: dict[str, Any] = {"uri": "/tmp/bench-unused", "columns": columns}
    if dim is not None:
        raw["vector"] = {"column": "vec", "dim": dim}
    return TableSpec.from_settings(TableSettings.model_validate(raw))


def _message(value: bytes, offset: int) -> confluent_kafka.Message:
    return confluent_kafka.Message(
        topic=TOPIC,
        partition=0,
        offset=offset,
        key=f"k{offset}".encode(),
        value=value,
        timestamp=(1, 1_700_000_000_000 + offset),
    )


def small_dataset(n: int, rng: np.random.Generator) -> Dataset:
    words = ["alpha", "beta", "gamma", "delta", "kafka", "lance", "vector", "sink"]
    spec = _spec(
        [
            {"name": "id", "type": "string", "nullable": False},
            {"name": "n", "type": "int64"},
            {"name": "score", "type": "float64"},
            {"name": "ok", "type": "bool"},
            {"name": "at", "type": "timestamp"},
            {"name": "text", "type": "string"},
        ],
        dim=None,
    )
    messages = []
    for i in range(n):
        text = " ".join(rng.choice(words, 14).tolist())
        value = orjson.dumps(
            {
                "id": f"order-{i:08d}",
                "n": int(rng.integers(0, 1 << 40)),
                "score": float(rng.random()),
                "ok": bool(i % 3),
                "at": 1_700_000_000_000 + i,
                "text": text,
            }
        )
        messages.append(_message(value, i))
    return Dataset("small", spec, messages)


def vector_dataset(n: int, rng: np.random.Generator) -> Dataset:
    spec = _spec(
        [{"name": "id", "type": "string", "nullable": False}, {"name": "text", "type": "string"}],
        dim=DIM,
    )
    vectors = rng.standard_normal((n, DIM), dtype=np.float32)
    text = "lorem ipsum dolor sit amet " * 8  # ~200 chars
    messages = [
        _message(
            orjson.dumps(
                {"id": f"doc-{i:08d}", "text": text, "vec": vectors[i]},
                option=orjson.OPT_SERIALIZE_NUMPY,
            ),
            i,
        )
        for i in range(n)
    ]
    return Dataset("vector", spec, messages)


def _batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def run_decoder(
    data: Dataset,
    batch: int,
    fast: bool = True,
    workers: int = 1,
    processes: bool = False,
) -> Callable[[], int]:
    """`Decoder.decode` over the batches; with `workers` > 1 the batches are decoded by a
    pool of that many threads sharing one decoder, as the sink's ``source.decode_workers``
    do (several batches at once); with `processes` each of those threads hands its batches
    to a worker process of its own (``source.decode_processes``; closed at exit)."""
    decoder: Decoder | ProcessDecoder = (
        ProcessDecoder(data.spec, SourceSettings(), schema_check="off", workers=workers)
        if processes
        else Decoder(data.spec, SourceSettings(), vector_fast_path=fast)
    )
    if isinstance(decoder, ProcessDecoder):
        atexit.register(decoder.close)
    batches = _batches(data.messages, batch)
    pool = ThreadPoolExecutor(workers) if workers > 1 else None

    def one(messages: Sequence[Any]) -> int:
        out = decoder.decode(messages)
        assert out.batch is not None
        assert not out.dead_letters
        return len(out.batch)

    def run() -> int:
        if pool is not None:
            return sum(pool.map(one, batches))
        return sum(map(one, batches))

    # Once outside the timing: the engine must accept what the decoder makes.
    data.spec.validate(decoder.decode(batches[0]).batch)
    return run


def run_decoder_with_bad(data: Dataset, batch: int, every: int = 100) -> Callable[[], int]:
    """The decoder on the same data with 1 message in `every` replaced by a bad one."""
    decoder = Decoder(data.spec, SourceSettings())
    messages = list(data.messages)
    for i in range(every // 2, len(messages), every):
        bad = b"{not json" if i % 2 else b'{"id": 1}'  # invalid_json / wrong_type
        messages[i] = _message(bad, i)
    expected_dead = len(range(every // 2, len(messages), every))
    batches = _batches(messages, batch)

    def run() -> int:
        dead = 0
        rows = 0
        for chunk in batches:
            out = decoder.decode(chunk)
            dead += len(out.dead_letters)
            rows += len(chunk)
        assert dead == expected_dead
        return rows

    return run


def base64_dataset(n: int, rng: np.random.Generator) -> Dataset:
    """The vector data set with ``vector.encoding = "base64_f32"``."""
    raw: dict[str, Any] = {
        "uri": "/tmp/bench-unused",
        "columns": [
            {"name": "id", "type": "string", "nullable": False},
            {"name": "text", "type": "string"},
        ],
        "vector": {"column": "vec", "dim": DIM, "encoding": "base64_f32"},
    }
    spec = TableSpec.from_settings(TableSettings.model_validate(raw))
    vectors = rng.standard_normal((n, DIM), dtype=np.float32)
    text = "lorem ipsum dolor sit amet " * 8
    messages = [
        _message(
            orjson.dumps(
                {
                    "id": f"doc-{i:08d}",
                    "text": text,
                    "vec": base64.b64encode(vectors[i].tobytes()).decode(),
                }
            ),
            i,
        )
        for i in range(n)
    ]
    return Dataset("base64", spec, messages)


def run_simdjson(data: Dataset, batch: int) -> Callable[[], int]:
    """(d) pysimdjson per message, the vector by ``Array.as_buffer`` into one float32 matrix
    per batch, the scalars read; no checks (the fast path's parse ceiling)."""
    import simdjson  # noqa: PLC0415

    batches = _batches([m.value() for m in data.messages], batch)
    parser = simdjson.Parser()
    names = [
        f.name
        for f in data.spec.table_schema
        if f.name not in {"vec", "_topic", "_partition", "_offset"}
    ]

    def run() -> int:
        rows = 0
        for values in batches:
            bufs = []
            for v in values:
                doc: Any = parser.parse(v)
                for name in names:
                    doc.get(name)
                bufs.append(doc["vec"].as_buffer(of_type="d"))
                doc = None
            np.frombuffer(b"".join(bufs), np.float64).astype(np.float32).reshape(len(values), DIM)
            rows += len(values)
        return rows

    return run


def run_into_numpy(data: Dataset, batch: int, parser: str) -> Callable[[], int]:
    """(e) orjson or msgspec per message, the vector's Python floats assigned into a
    preallocated float32 matrix row."""
    batches = _batches([m.value() for m in data.messages], batch)
    if parser == "msgspec":
        import msgspec  # noqa: PLC0415

        loads: Callable[[bytes], Any] = msgspec.json.Decoder().decode
    else:
        loads = orjson.loads

    def run() -> int:
        rows = 0
        for values in batches:
            matrix = np.empty((len(values), DIM), np.float32)
            for i, v in enumerate(values):
                matrix[i] = loads(v)["vec"]
            rows += len(values)
        return rows

    return run


def _msgspec_available() -> bool:
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec("msgspec") is not None


def run_orjson(data: Dataset, batch: int) -> Callable[[], int]:
    values = [m.value() for m in data.messages]

    def run() -> int:
        gc.disable()
        try:
            for v in values:
                orjson.loads(v)
        finally:
            gc.enable()
        return len(values)

    return run


def run_naive(data: Dataset, batch: int) -> Callable[[], int]:
    """(c) A naive decoder: orjson per message, then pa.array / np.array per column.

    No validation at all (a wrong type raises), GC paused (with GC on it is ~25% slower on
    vectors: it keeps every parsed object alive until the batch is built).
    """
    fields = [f for f in data.spec.table_schema if not f.name.startswith("_")]
    batches = _batches([m.value() for m in data.messages], batch)

    def run() -> int:
        rows = 0
        gc.disable()
        try:
            for values in batches:
                objs = [orjson.loads(v) for v in values]
                for f in fields:
                    if pa.types.is_fixed_size_list(f.type):
                        matrix = np.array([o[f.name] for o in objs], dtype=np.float32)
                        pa.FixedSizeListArray.from_arrays(pa.array(matrix.ravel()), type=f.type)
                    elif pa.types.is_timestamp(f.type):
                        pa.array([o.get(f.name) for o in objs], pa.int64()).cast(f.type)
                    else:
                        pa.array([o.get(f.name) for o in objs], f.type)
                rows += len(objs)
        finally:
            gc.enable()
        return rows

    return run


def run_bulk_parse(data: Dataset, batch: int) -> Callable[[], int]:
    decoder = Decoder(data.spec, SourceSettings())
    parse_options = pj.ParseOptions(
        explicit_schema=decoder._parser._read_schemas[False], unexpected_field_behavior="ignore"
    )
    batches = _batches([m.value() for m in data.messages], batch)
    d = json_parse  # the decoder's own chunking, wrapping and reader options

    def run() -> int:
        rows = 0
        for values in batches:
            sizes = value_sizes(values)
            for lo, hi in d._chunks(sizes, d._PARSE_CHUNK_BYTES):
                chunk = values[lo:hi]
                buf, _ = d._wrap(chunk, False)  # as the decoder's first parse of a batch
                table = pj.read_json(
                    pa.BufferReader(buf),
                    read_options=d._read_options(len(buf), max(map(len, chunk))),
                    parse_options=parse_options,
                )
                rows += table.num_rows
        return rows

    return run


def measure(paths: dict[str, Callable[[], int]], runs: int) -> dict[str, tuple[float, int]]:
    """Median seconds and rows per path; runs interleave the paths so drift hits all alike."""
    for run in paths.values():
        run()  # warm-up
    times: dict[str, list[float]] = {label: [] for label in paths}
    rows: dict[str, int] = {}
    for _ in range(runs):
        for label, run in paths.items():
            start = time.perf_counter()
            rows[label] = run()
            times[label].append(time.perf_counter() - start)
    return {label: (statistics.median(times[label]), rows[label]) for label in paths}


def avro_datasets(n: int, rng: np.random.Generator) -> list[tuple[Dataset, SourceSettings, str]]:
    """Avro data sets (small, vector array, vector bytes) with their source settings and
    writer schema, produced with confluent-kafka's AvroSerializer into a mock registry."""
    import json  # noqa: PLC0415 - Avro only

    from confluent_kafka.schema_registry.avro import AvroSerializer  # noqa: PLC0415
    from confluent_kafka.serialization import MessageField, SerializationContext  # noqa: PLC0415

    from config.settings import SchemaRegistrySettings  # noqa: PLC0415
    from sink.formats.registry import build_client  # noqa: PLC0415

    small, vector = small_dataset(n, rng), vector_dataset(min(n, 1), rng)
    registry = SchemaRegistrySettings(url="mock://bench")
    ctx = SerializationContext(TOPIC, MessageField.VALUE)
    ts = {"type": "long", "logicalType": "timestamp-millis"}
    schemas = {
        "small": [("id", "string"), ("n", "long"), ("score", "double"), ("ok", "boolean"),
                  ("at", ts), ("text", "string")],
        "vec-array": [("id", "string"), ("text", "string"),
                      ("vec", {"type": "array", "items": "float"})],
        "vec-bytes": [("id", "string"), ("text", "string"), ("vec", "bytes")],
    }  # fmt: skip
    vectors = rng.standard_normal((n, DIM), dtype=np.float32)
    text = "lorem ipsum dolor sit amet " * 8
    out = []
    for name, fields in schemas.items():
        schema = json.dumps(
            {"type": "record", "name": name.replace("-", "_"),
             "fields": [{"name": f, "type": t} for f, t in fields]}
        )  # fmt: skip
        ser = AvroSerializer(build_client(registry), schema)
        messages = []
        for i in range(n):
            if name == "small":
                record: dict[str, Any] = orjson.loads(small.messages[i].value())
                record["at"] = _EPOCH_MS_DT(record["at"])
            else:
                vec = vectors[i].tobytes() if name == "vec-bytes" else vectors[i].tolist()
                record = {"id": f"doc-{i:08d}", "text": text, "vec": vec}
            messages.append(_message(ser(record, ctx), i))
        spec = small.spec if name == "small" else vector.spec
        source = SourceSettings(format="avro", schema_registry=registry)
        out.append((Dataset(f"avro {name}", spec, messages), source, schema))
    return out


def _EPOCH_MS_DT(ms: int) -> Any:  # noqa: N802 - a converter, named for what it makes
    import datetime as dt  # noqa: PLC0415

    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC)


def run_avro_decoder(data: Dataset, source: SourceSettings, batch: int) -> Callable[[], int]:
    decoder = Decoder(data.spec, source)
    batches = _batches(data.messages, batch)

    def run() -> int:
        rows = 0
        for messages in batches:
            out = decoder.decode(messages)
            assert out.batch is not None
            assert not out.dead_letters, out.dead_letters[:1]
            rows += len(out.batch)
        return rows

    data.spec.validate(decoder.decode(batches[0]).batch)
    return run


def run_fastavro(data: Dataset, schema: str) -> Callable[[], int]:
    import io  # noqa: PLC0415
    import json  # noqa: PLC0415

    from fastavro import parse_schema, schemaless_reader  # noqa: PLC0415

    parsed = parse_schema(json.loads(schema))
    values = [m.value() for m in data.messages]

    def run() -> int:
        for v in values:
            schemaless_reader(io.BytesIO(v[5:]), parsed, None)
        return len(values)

    return run


def run_avro_deserializer(data: Dataset, source: SourceSettings) -> Callable[[], int]:
    from confluent_kafka.schema_registry.avro import AvroDeserializer  # noqa: PLC0415

    from sink.formats.registry import build_client  # noqa: PLC0415

    assert source.schema_registry is not None
    deserializer = AvroDeserializer(build_client(source.schema_registry))
    values = [m.value() for m in data.messages]

    def run() -> int:
        for v in values:
            deserializer(v, None)
        return len(values)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--small", type=int, default=100_000)
    parser.add_argument("--vectors", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--avro", type=int, default=20_000, help="messages per Avro data set")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument(
        "--only", nargs="*", default=None, help="JSON data sets to run (small, vector, base64)"
    )
    args = parser.parse_args(argv)

    rng = np.random.default_rng(7)
    header = (
        f"decode benchmark: {args.runs} runs (median), batches of {args.batch}, "
        f"{json_parse._CORES} cores, pyarrow {pa.__version__}, "
        f"orjson {orjson.__version__}, python {sys.version.split()[0]}"
    )
    lines = [
        header,
        "",
        f"{'data':<8} {'path':<24} {'rows/s':>12} {'MB/s':>8} {'s':>8} {'vs (a)':>7} {'vs (b)':>7}",
    ]
    datasets = [
        small_dataset(args.small, rng),
        vector_dataset(args.vectors, rng),
        base64_dataset(args.vectors, rng),
    ]
    for data in datasets if not args.only else [d for d in datasets if d.name in args.only]:
        mb = data.payload_bytes / 1e6
        paths = {
            "(a) orjson.loads/msg": run_orjson(data, args.batch),
            "(b) bulk parse only": run_bulk_parse(data, args.batch),
            "decoder": run_decoder(data, args.batch),
            "decoder, 1% bad msgs": run_decoder_with_bad(data, args.batch),
        }
        if data.name != "base64":
            paths["(c) naive orjson+pa.array"] = run_naive(data, args.batch)
        if data.spec.vector is not None:
            paths["decoder, Arrow only"] = run_decoder(data, args.batch, fast=False)
            # As the sink runs it: batches of ~8 MiB (CONSUME_TARGET_BYTES) decoded by
            # source.decode_workers threads sharing one decoder.
            sink_batch = max(
                1, min(args.batch, (8 << 20) // (data.payload_bytes // len(data.messages)))
            )
            for workers in (1, 2):
                w = f"{workers}w"
                paths[f"decoder {w}"] = run_decoder(data, sink_batch, workers=workers)
                paths[f"decoder {w} Arrow only"] = run_decoder(
                    data, sink_batch, fast=False, workers=workers
                )
            paths["decoder 2 processes"] = run_decoder(data, sink_batch, workers=2, processes=True)
        if data.name == "vector":
            paths["(d) simdjson as_buffer"] = run_simdjson(data, args.batch)
            paths["(e) orjson->numpy row"] = run_into_numpy(data, args.batch, "orjson")
            if _msgspec_available():
                paths["(e) msgspec->numpy row"] = run_into_numpy(data, args.batch, "msgspec")
        results = measure(paths, args.runs)
        base_a = results["(a) orjson.loads/msg"][0]
        base_b = results["(b) bulk parse only"][0]
        for label, (seconds, rows) in results.items():
            lines.append(
                f"{data.name:<8} {label:<24} {rows / seconds:>12,.0f} {mb / seconds:>8.1f} "
                f"{seconds:>8.3f} {base_a / seconds:>6.2f}x {base_b / seconds:>6.2f}x"
            )
        avg = data.payload_bytes / len(data.messages)
        lines.append(f"{data.name:<8} ({len(data.messages)} messages, {avg:.0f} bytes each)")
        lines.append("")
    for data, source, schema in avro_datasets(args.avro, rng) if args.avro else []:
        mb = data.payload_bytes / 1e6
        results = measure(
            {
                "(f) fastavro/msg": run_fastavro(data, schema),
                "(g) AvroDeserializer/msg": run_avro_deserializer(data, source),
                "decoder": run_avro_decoder(data, source, args.batch),
            },
            args.runs,
        )
        base_f = results["(f) fastavro/msg"][0]
        for label, (seconds, rows) in results.items():
            lines.append(
                f"{data.name:<14} {label:<24} {rows / seconds:>12,.0f} {mb / seconds:>8.1f} "
                f"{seconds:>8.3f} {base_f / seconds:>6.2f}x (vs f)"
            )
        avg = data.payload_bytes / len(data.messages)
        lines.append(f"{data.name:<14} ({len(data.messages)} messages, {avg:.0f} bytes each)")
        lines.append("")
    lines.append("vs (a) / vs (b): throughput relative to the yardstick (>1 = faster).")
    lines.append(
        "'1% bad msgs': 1 message in 100 is invalid JSON or mistyped; rows/s counts all "
        "messages (good and dead-lettered); the yardsticks ran on the clean data."
    )
    report = "\n".join(lines)
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
