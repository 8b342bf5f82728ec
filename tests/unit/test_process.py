"""`sink.cli.tune_process`: what `lance-sink run` sets on its own process (run in a child
interpreter each, since the settings are process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
