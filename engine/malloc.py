"""How the sink process and its maintenance child use glibc's malloc, which Lance (Rust),
faiss and numpy allocate through (Arrow has its own pool).

Measured with bench/memory (overload, queries at the pool's limit, maintenance building
indexes): with glibc's defaults the sink held 3.3 GiB under a 1.6 GiB limit, 1.1 GiB of it in
per-thread arenas and most of the rest free memory inside the heaps, never returned.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

#: glibc malloc arenas of the sink and of its children (the maintenance process). glibc makes
#: up to 8 per CPU, one per thread that meets contention, each holding up to 64 MiB heaps it
#: rarely returns; Lance's and the query pool's threads each grew their own: 1.1 GiB of the
#: sink's 2.9 GiB under queries (bench/memory). Two keep that bounded.
MALLOC_ARENAS = 2
#: Allocations from this size on get their own mapping, returned to the kernel when freed.
#: glibc's threshold starts at 128 KiB but rises to 32 MiB after large blocks are freed, so
#: query results, vector matrices and Lance's buffers end up in the heaps and stay there.
MALLOC_MMAP_THRESHOLD = 1 << 20
#: Free memory at the top of a heap beyond this is given back to the kernel at once. glibc's
#: 128 KiB (fixed once the mmap threshold is) gave back the top of the heap after every
#: batch: a consumed batch is ~8 MiB of values (each its own block), freed together and
#: allocated again, page faults and zeroed pages each time (copying values out of a shared
#: buffer ran 5.7x slower, bench: 3.2 against 0.56 us per 3.8 KB value). What stays above
#: this is given back by `release_free_memory`, which the sink calls every few seconds.
MALLOC_TRIM_THRESHOLD = 32 << 20
M_TRIM_THRESHOLD = -1  # malloc.h
M_MMAP_THRESHOLD = -3  # malloc.h
M_ARENA_MAX = -8  # malloc.h


def tune_malloc() -> bool:
    """Bound glibc malloc's hold on freed memory: at most `MALLOC_ARENAS` arenas
    (`MALLOC_ARENA_MAX`), a fixed mmap threshold (`MALLOC_MMAP_THRESHOLD_`) and trim
    threshold (`MALLOC_TRIM_THRESHOLD_`). For this process with `mallopt` (glibc reads the
    variables only at start), for child processes (the maintenance child, decode workers)
    through the environment. Call before threads start. Returns whether it took effect
    (False off glibc, or with a bad value in the environment)."""
    os.environ.setdefault("MALLOC_ARENA_MAX", str(MALLOC_ARENAS))
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MALLOC_MMAP_THRESHOLD))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(MALLOC_TRIM_THRESHOLD))
    try:
        arenas = int(os.environ["MALLOC_ARENA_MAX"])
        threshold = int(os.environ["MALLOC_MMAP_THRESHOLD_"])
        trim = int(os.environ["MALLOC_TRIM_THRESHOLD_"])
        libc = ctypes.CDLL(None)
        return bool(
            libc.mallopt(M_ARENA_MAX, arenas) == 1
            and libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1
            and libc.mallopt(M_TRIM_THRESHOLD, trim) == 1
        )
    except (OSError, AttributeError, ValueError):
        return False


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve allocations below `nbytes` from the heaps (`mallopt(M_MMAP_THRESHOLD)`) and
    keep up to `nbytes` free at a heap's top (`M_TRIM_THRESHOLD`), for a process whose
    environment carries `tune_malloc`'s thresholds but which reuses large blocks at a high
    rate (a decode worker: a fresh mapping per batch buffer, or the top of the heap given
    back after each batch, costs page faults on every batch). Returns whether it took
    effect (False off glibc)."""
    try:
        libc = ctypes.CDLL(None)
        return bool(
            libc.mallopt(M_MMAP_THRESHOLD, nbytes) == 1
            and libc.mallopt(M_TRIM_THRESHOLD, nbytes) == 1
        )
    except (OSError, AttributeError):
        return False


def release_free_memory() -> None:
    """Give the kernel back what malloc holds free (`malloc_trim(0)`: the tops of the heaps
    and whole free pages inside them). No-op off glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
