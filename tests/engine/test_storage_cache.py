"""A durable WAL entry leaves the page cache (it is read back only by a replay); other objects
(shard manifests, read on every fence probe) stay cached. Checked with mincore(2) on the
real files."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pyarrow as pa
import pytest

from engine.storage import LocalStorage
from engine.wal import SourceRange, Wal, encode_entry

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="Linux only")

PAGE = mmap.PAGESIZE


def resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache: mincore(2) over a private mapping of it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = path.stat().st_size
    pages = (size + PAGE - 1) // PAGE
    vec = ctypes.create_string_buffer(pages)
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        start = ctypes.c_char.from_buffer(m)
        try:
            assert libc.mincore(ctypes.addressof(start), size, vec) == 0, ctypes.get_errno()
        finally:
            del start  # release the buffer export before the mapping closes
    return sum(b & 1 for b in vec.raw)


def test_wal_entries_leave_the_page_cache_manifests_stay(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path, fsync=True)
    storage.put_if_absent("shard/manifest/0001", os.urandom(64 * PAGE))
    assert resident_pages(tmp_path / "shard/manifest/0001") == 64

    wal = Wal(storage, "shard")
    batch = pa.record_batch({"x": pa.array(range(50_000), pa.int64())})
    payload = encode_entry(1, 1, "shard", batch.schema, [batch], [SourceRange("t", 0, 0, 49_999)])
    wal.append(1, payload)
    entry = tmp_path / wal.key(1)
    assert entry.stat().st_size > 64 * PAGE
    assert resident_pages(entry) == 0
    # Still durable and whole: a replay reads it back from disk.
    assert wal.read(1).batches[0].equals(batch)
