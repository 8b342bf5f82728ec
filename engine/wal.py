"""The write-ahead log of one shard: numbered entries, each an Arrow IPC stream.

Layout under the shard's folder of the WAL storage:

    <shard>/wal/<position:020d>.arrow     one entry per group commit, positions 1, 2, 3, ...

An entry holds the rows of every put in its group-commit window (their record batches, or
none for a fence entry) and, in the schema metadata, a header: the entry position, the writer
epoch, the shard id, and the source offset range of each (topic, partition) whose rows it
carries. Entries are written with a create-only put: a writer never skips a position, so
finding a position taken means a newer writer fenced this one (see `ShardWriter.open`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final

import pyarrow as pa

from engine.storage import AlreadyExists, Storage

HEADER_KEY = b"lance_sink.wal_entry"
CODEC_VERSION = 1


@dataclass(frozen=True, slots=True)
class SourceRange:
    """A contiguous range of source offsets of one topic-partition, both ends inclusive."""

    topic: str
    partition: int
    first: int
    last: int

    def __post_init__(self) -> None:
        if self.first > self.last:
            raise ValueError(f"empty source range {self}")


def merge_ranges(ranges: list[SourceRange]) -> list[SourceRange]:
    """Collapse ranges per (topic, partition) into the covering range, ordered by key."""
    spans: dict[tuple[str, int], tuple[int, int]] = {}
    for r in ranges:
        key = (r.topic, r.partition)
        lo, hi = spans.get(key, (r.first, r.last))
        spans[key] = (min(lo, r.first), max(hi, r.last))
    return [SourceRange(t, p, lo, hi) for (t, p), (lo, hi) in sorted(spans.items())]


@dataclass(frozen=True, slots=True)
class WalEntry:
    """One decoded WAL entry."""

    position: int
    epoch: int
    shard: str
    sources: tuple[SourceRange, ...] = ()
    batches: tuple[pa.RecordBatch, ...] = ()
    nbytes: int = 0

    @property
    def num_rows(self) -> int:
        return sum(b.num_rows for b in self.batches)


#: The smallest scratch buffer of an `EntryEncoder` (a fence entry fits).
MIN_SCRATCH_BYTES: Final = 4096


class EntryEncoder:
    """Serialises entries as Arrow IPC streams whose schema metadata carries the header.

    Serialising into a fresh buffer page-faults on every entry (the kernel zeroes each new
    page), which costs more than the copy itself; the encoder keeps one scratch buffer and
    reuses it. The returned buffer is valid until the next `encode` call, so one encoder
    belongs to one shard writer, whose WAL steps (never two at once) write each entry
    before encoding the next.

    The scratch grows to the largest entry so far (a power of two, `MIN_SCRATCH_BYTES` at
    least). A first scratch of 1 MiB was half of a shard's open (its fence entry, a few
    hundred bytes: allocating 1 MiB from Arrow's pool took 3.4 ms when each shard kept its
    own), and held 1 GiB of the pool at 1,024 idle shards.
    """

    def __init__(self) -> None:
        self._scratch: pa.Buffer | None = None

    def encode(
        self,
        position: int,
        epoch: int,
        shard: str,
        schema: pa.Schema,
        batches: list[pa.RecordBatch] | tuple[pa.RecordBatch, ...],
        sources: list[SourceRange] | tuple[SourceRange, ...],
    ) -> pa.Buffer:
        header = {
            "v": CODEC_VERSION,
            "position": position,
            "epoch": epoch,
            "shard": shard,
            "sources": [[s.topic, s.partition, s.first, s.last] for s in sources],
        }
        meta = dict(schema.metadata or {})
        meta[HEADER_KEY] = json.dumps(header, separators=(",", ":")).encode()
        schema = schema.with_metadata(meta)
        rows = [pa.RecordBatch.from_arrays(b.columns, schema=schema) for b in batches if b.num_rows]
        # Measure first, then serialise into one buffer of the exact size: a growing output
        # stream would re-copy the entry as it grows.
        mock = pa.MockOutputStream()
        with pa.ipc.new_stream(mock, schema) as writer:
            for b in rows:
                writer.write_batch(b)
        size = mock.size()
        if self._scratch is None or self._scratch.size < size:
            self._scratch = pa.allocate_buffer(max(MIN_SCRATCH_BYTES, 1 << (size - 1).bit_length()))
        with pa.ipc.new_stream(pa.FixedSizeBufferWriter(self._scratch), schema) as writer:
            for b in rows:
                writer.write_batch(b)
        return self._scratch.slice(0, size)


def encode_entry(
    position: int,
    epoch: int,
    shard: str,
    schema: pa.Schema,
    batches: list[pa.RecordBatch] | tuple[pa.RecordBatch, ...],
    sources: list[SourceRange] | tuple[SourceRange, ...],
) -> pa.Buffer:
    """Serialise one entry into a buffer of its own (see `EntryEncoder` for the hot path)."""
    encoded = EntryEncoder().encode(position, epoch, shard, schema, batches, sources)
    return pa.py_buffer(encoded.to_pybytes())


def decode_entry(data: bytes | pa.Buffer) -> WalEntry:
    """Parse an entry written by `encode_entry` or `EntryEncoder`.

    The batches are zero-copy views of `data`.

    Raises:
        ValueError: the bytes are not a WAL entry of a known codec version.
    """
    buf = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    try:
        reader = pa.ipc.open_stream(buf)
        batches = list(reader)
    except pa.ArrowInvalid as exc:
        raise ValueError(f"not a WAL entry: {exc}") from exc
    meta = reader.schema.metadata or {}
    if HEADER_KEY not in meta:
        raise ValueError("not a WAL entry: no header")
    header = json.loads(meta[HEADER_KEY])
    if header.get("v") != CODEC_VERSION:
        raise ValueError(f"unknown WAL codec version {header.get('v')}")
    rest = {k: v for k, v in meta.items() if k != HEADER_KEY}
    schema = reader.schema.with_metadata(rest or None)
    return WalEntry(
        position=int(header["position"]),
        epoch=int(header["epoch"]),
        shard=str(header["shard"]),
        sources=tuple(SourceRange(t, int(p), int(a), int(b)) for t, p, a, b in header["sources"]),
        batches=tuple(pa.RecordBatch.from_arrays(b.columns, schema=schema) for b in batches),
        nbytes=buf.size,
    )


class Wal:
    """The WAL folder of one shard on a `Storage`.

    Used by exactly one `ShardWriter` at a time (the one holding the newest epoch); every
    method may raise the storage's I/O errors, which the writer turns into a poison.
    """

    def __init__(self, storage: Storage, shard: str) -> None:
        self.storage = storage
        self.shard = shard
        self.folder = f"{shard}/wal"

    def key(self, position: int) -> str:
        return f"{self.folder}/{position:020d}.arrow"

    def append(self, position: int, payload: pa.Buffer | bytes) -> None:
        """Write the entry at `position`, create-only.

        Raises:
            AlreadyExists: the position is taken (a newer writer fenced this one).
        """
        self.storage.put_if_absent(self.key(position), memoryview(payload), cached=False)

    def positions(self) -> list[int]:
        """Every entry position present, ascending."""
        out = []
        for key in self.storage.list(self.folder):
            name = key.rsplit("/", 1)[-1]
            if name.endswith(".arrow") and name[:-6].isdigit():
                out.append(int(name[:-6]))
        return sorted(out)

    def read(self, position: int) -> WalEntry:
        """Read and decode one entry (raises FileNotFoundError if absent)."""
        return decode_entry(self.storage.get(self.key(position)))

    def delete_through(self, position: int) -> int:
        """Delete entries at or below `position` (after a flush covered them); returns count."""
        doomed = [p for p in self.positions() if p <= position]
        self.storage.delete_many([self.key(p) for p in doomed])  # one request on S3
        return len(doomed)


__all__ = [
    "AlreadyExists",
    "EntryEncoder",
    "SourceRange",
    "Wal",
    "WalEntry",
    "decode_entry",
    "encode_entry",
    "merge_ranges",
]
