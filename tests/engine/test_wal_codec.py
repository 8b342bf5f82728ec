"""The WAL entry codec round-trips every header and batch (Hypothesis)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.wal import (
    MIN_SCRATCH_BYTES,
    EntryEncoder,
    SourceRange,
    decode_entry,
    encode_entry,
    merge_ranges,
)

SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("n", pa.int64()),
        pa.field("vec", pa.list_(pa.float32(), 3)),
        pa.field("_op", pa.int8(), nullable=False),
    ]
)

ranges = st.builds(
    lambda t, p, a, n: SourceRange(t, p, a, a + n),
    st.text(min_size=1, max_size=20),
    st.integers(0, 10_000),
    st.integers(0, 2**62),
    st.integers(0, 1000),
)
rows = st.fixed_dictionaries(
    {
        "id": st.text(max_size=30),
        "n": st.none() | st.integers(-(2**63), 2**63 - 1),
        "vec": st.none()
        | st.lists(
            st.floats(width=32, allow_nan=False, allow_infinity=True), min_size=3, max_size=3
        ),
        "_op": st.sampled_from([0, 1]),
    }
)


@settings(max_examples=200, deadline=None)
@given(
    position=st.integers(1, 2**62),
    epoch=st.integers(1, 2**40),
    shard=st.text(min_size=1, max_size=60),
    sources=st.lists(ranges, max_size=5),
    data=st.lists(rows, max_size=20),
)
def test_entry_round_trip(
    position: int, epoch: int, shard: str, sources: list[SourceRange], data: list[dict[str, object]]
) -> None:
    batch = pa.RecordBatch.from_pylist(data, schema=SCHEMA) if data else None
    payload = encode_entry(position, epoch, shard, SCHEMA, [batch] if batch else [], sources)
    entry = decode_entry(payload.to_pybytes())
    assert (entry.position, entry.epoch, entry.shard) == (position, epoch, shard)
    assert list(entry.sources) == sources
    assert entry.nbytes == payload.size
    if batch is None:
        assert entry.batches == ()
        assert entry.num_rows == 0
    else:
        [decoded] = entry.batches
        assert decoded.schema.equals(SCHEMA)
        assert decoded.to_pylist() == batch.to_pylist()


def test_garbage_is_rejected() -> None:
    with pytest.raises(ValueError, match="not a WAL entry"):
        decode_entry(b"\x00\x01garbage")
    plain = pa.BufferOutputStream()
    with pa.ipc.new_stream(plain, SCHEMA):
        pass
    with pytest.raises(ValueError, match="no header"):
        decode_entry(plain.getvalue())


def test_merge_ranges_covers_each_partition() -> None:
    merged = merge_ranges(
        [SourceRange("a", 0, 5, 9), SourceRange("a", 0, 10, 12), SourceRange("b", 1, 3, 3)]
    )
    assert merged == [SourceRange("a", 0, 5, 12), SourceRange("b", 1, 3, 3)]
    with pytest.raises(ValueError, match="empty source range"):
        SourceRange("a", 0, 5, 4)


def test_an_encoder_holds_a_scratch_the_size_of_its_entries() -> None:
    # Its first scratch was 1 MiB whatever the entry: every shard's open (a fence entry of
    # a few hundred bytes) allocated 1 MiB of Arrow's pool for the shard's life, 3.4 ms an
    # open, 1 GiB of the pool at 1,024 idle shards.
    encoder = EntryEncoder()
    before = pa.total_allocated_bytes()
    fence = encoder.encode(0, 1, "t-0", SCHEMA, [], [])
    assert decode_entry(fence.to_pybytes()).num_rows == 0
    assert pa.total_allocated_bytes() - before <= MIN_SCRATCH_BYTES
    n = 100_000
    big = pa.record_batch(
        [
            pa.array(["x"] * n),
            pa.array(range(n)),
            pa.FixedSizeListArray.from_arrays(pa.array([0.5] * (3 * n), pa.float32()), 3),
            pa.array([0] * n, pa.int8()),
        ],
        schema=SCHEMA,
    )
    before = pa.total_allocated_bytes()  # the batch's own buffers aside
    entry = encoder.encode(1, 1, "t-0", SCHEMA, [big], [])
    assert decode_entry(entry.to_pybytes()).num_rows == 100_000
    held = pa.total_allocated_bytes() - before
    scratch = held + MIN_SCRATCH_BYTES  # the fence's scratch was freed
    assert entry.size <= scratch < 2 * entry.size  # grown to the entry, a power of two
    for position in range(2, 5):  # smaller and equal entries reuse it
        encoder.encode(position, 1, "t-0", SCHEMA, [big.slice(0, 1000)], [])
        encoder.encode(position, 1, "t-0", SCHEMA, [big], [])
        assert pa.total_allocated_bytes() - before == held
