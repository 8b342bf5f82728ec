"""`sink.cli.tune_process`: what `lance-sink run` sets on its own process (run in a child
interpreter each, since the settings are process-wide); malloc; OS thread names."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.threads import name_os_thread
from sink.cli import available_cpus

PROBE = """
import os, sys
from sink.cli import tune_process
tune_process({arg})
print(os.environ["LANCE_CPU_THREADS"], sys.getswitchinterval())
"""


def probe(arg: str, env_value: str | None) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "LANCE_CPU_THREADS"}
    if env_value is not None:
        env["LANCE_CPU_THREADS"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(arg=arg)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    return out[0], float(out[1])


@pytest.mark.parametrize(
    ("arg", "env_value", "want"),
    [
        ("3", None, "3"),  # query.lance_cpu_threads wins
        ("3", "5", "3"),
        ("None", "5", "5"),  # else the variable as the operator set it
        ("None", None, str(max(1, available_cpus() // 2))),  # else half the CPUs
    ],
)
def test_lance_cpu_pool_size(arg: str, env_value: str | None, want: str) -> None:
    threads, switch = probe(arg, env_value)
    assert threads == want
    assert switch == pytest.approx(0.001)


def test_available_cpus_is_within_the_affinity() -> None:
    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))


MALLOC_PROBE = """
import ctypes, os, subprocess, sys
from engine.malloc import release_free_memory, tune_malloc
ok = tune_malloc()

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

# 64 MiB in 16 KiB blocks, each followed by a small block that stays: freed, they are holes
# inside the heap (below the mmap threshold), which only a trim gives back.
big, small = [], []
for _ in range(4096):
    big.append(ctypes.create_string_buffer(16384))
    small.append(ctypes.create_string_buffer(600))
for b in big:
    ctypes.memset(b, 1, 16384)
del big
before = rss()
release_free_memory()
freed = before - rss()
child = subprocess.run(
    [sys.executable, "-c", "import os; print(os.environ['MALLOC_ARENA_MAX'], "
     "os.environ['MALLOC_MMAP_THRESHOLD_'], os.environ['MALLOC_TRIM_THRESHOLD_'])"],
    capture_output=True, text=True, check=True,
).stdout.split()
print(ok, freed > 32 << 20, *child)
"""


def test_malloc_is_tuned_for_the_process_and_its_children() -> None:
    """`tune_malloc` takes effect here (mallopt) and reaches child processes (the maintenance
    child, decode workers) through the environment, the operator's own values winning;
    and `release_free_memory` gives back free memory inside the heap."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", MALLOC_PROBE], env=env, capture_output=True, text=True,
        check=True, timeout=60,
    ).stdout.split()  # fmt: skip
    assert out == ["True", "True", "2", str(1 << 20), str(32 << 20)]
    env["MALLOC_ARENA_MAX"] = "4"
    out = subprocess.run(
        [sys.executable, "-c", MALLOC_PROBE], env=env, capture_output=True, text=True,
        check=True, timeout=60,
    ).stdout.split()  # fmt: skip
    assert out == ["True", "True", "4", str(1 << 20), str(32 << 20)]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux: OS thread names")
def test_threads_name_themselves_for_the_os() -> None:
    """A pool's workers take their Python names (as the sink's decode pool does), a thread
    a name of its own, cut to the kernel's 15 bytes."""

    def os_name() -> str:
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    with ThreadPoolExecutor(1, thread_name_prefix="decode", initializer=name_os_thread) as pool:
        assert pool.submit(os_name).result() == "decode_0"
    with ThreadPoolExecutor(1) as pool:
        named = pool.submit(lambda: (name_os_thread("wal-a-very-long-shard-name"), os_name()))
        assert named.result() == (True, "wal-a-very-long")
