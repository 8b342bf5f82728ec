"""Where a profiled sink's samples went: a summary of py-spy's folded stacks.

    python -m bench.folded FILE [--thread REGEX] [--top N] [--callers K]

Reads what ``bench.e2e --profile DIR`` records (py-spy ``--format raw``: one line per
distinct stack, ``thread (id): name;frame;frame... count``) and prints the share of the
samples by thread group (a thread's name up to its first non-letter: ``decode_1`` and
``decode_2`` are ``decode``), by own frame (the innermost, with `callers` frames above
it), and by inclusive frame. Line numbers are dropped, so a function's lines add up. With
``--profile-gil`` the samples are those of the thread holding the interpreter lock only.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r":\d+\)$")
_GROUP = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True, slots=True)
class Stack:
    """One line of a folded profile: the thread's name, its frames (outermost first,
    without line numbers) and how many samples had them."""

    thread: str
    frames: tuple[str, ...]
    count: int


def read(lines: Iterable[str]) -> list[Stack]:
    """The stacks of a folded profile's lines (blank lines skipped).

    Raises:
        ValueError: a line is not ``thread (id): name;frames... count``.
    """
    stacks = []
    for number, line in enumerate(lines, 1):
        text = line.rstrip("\n")
        if not text.strip():
            continue
        stack, _, count = text.rpartition(" ")
        head, *frames = stack.split(";")
        _, sep, name = head.partition("): ")
        if not sep or not count.isdigit():
            raise ValueError(f"line {number} is not a folded stack: {text[:80]!r}")
        stacks.append(Stack(name, tuple(_LINE.sub(")", f) for f in frames), int(count)))
    return stacks


def thread_group(name: str) -> str:
    """The group a thread's name belongs to: its leading letters (the whole name when it
    starts with something else)."""
    match = _GROUP.match(name)
    return match.group(0) if match else name


def summary(stacks: list[Stack], *, top: int = 20, callers: int = 2) -> list[str]:
    """The report's lines: samples by thread group, own frame and inclusive frame."""
    total = sum(s.count for s in stacks)
    if not total:
        return ["no samples"]
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for s in stacks:
        threads[thread_group(s.thread)] += s.count
        if s.frames:
            own[" <- ".join(reversed(s.frames[-1 - callers :]))] += s.count
        for frame in set(s.frames):
            inclusive[frame] += s.count

    def shares(counter: Counter[str], n: int) -> list[str]:
        return [f"{count / total:6.1%}  {what}" for what, count in counter.most_common(n)]

    return [
        f"{total} samples",
        "-- by thread group",
        *shares(threads, len(threads)),
        f"-- own (innermost frame <- {callers} callers)",
        *shares(own, top),
        "-- inclusive",
        *shares(inclusive, top),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--thread", default=None, help="only threads whose name matches")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--callers", type=int, default=2)
    args = parser.parse_args()
    with args.file.open() as lines:
        stacks = read(lines)
    if args.thread is not None:
        pattern = re.compile(args.thread)
        stacks = [s for s in stacks if pattern.search(s.thread)]
    print("\n".join(summary(stacks, top=args.top, callers=args.callers)))


if __name__ == "__main__":
    main()
