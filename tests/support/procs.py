"""Child processes as /proc shows them (Linux): a sink's decode workers, and whether a
process still runs after its parent was killed."""

from __future__ import annotations

import contextlib
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (None: no such process)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(ValueError):
            fields = _stat_fields(int(stat.parent.name))
            if fields is not None and int(fields[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def cmdline(pid: int) -> str:
    """The command line of `pid`, arguments joined by spaces ("" when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def running(pid: int) -> bool:
    """Does `pid` exist and is it not a zombie?"""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"
