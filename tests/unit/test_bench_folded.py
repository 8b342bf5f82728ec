"""bench.folded: the summary of py-spy's folded stacks that bench/e2e's --profile records."""

from __future__ import annotations

import pytest

from bench.folded import read, summary, thread_group

PROFILE = """\
thread (11): MainThread;run (sink/service.py:418);consume (x.py:1) 3
thread (12): decode_1;decode (sink/decode.py:603);parse (sink/vector_json.py:180) 4
thread (13): decode_2;decode (sink/decode.py:611);parse (sink/vector_json.py:190) 2

thread (14): wal-shard-0-ab12;_wal_loop (engine/shard.py:540) 1
"""


def test_stacks_lose_their_line_numbers_and_keep_counts() -> None:
    stacks = read(PROFILE.splitlines(keepends=True))
    assert [s.thread for s in stacks] == ["MainThread", "decode_1", "decode_2", "wal-shard-0-ab12"]
    assert stacks[1].frames == ("decode (sink/decode.py)", "parse (sink/vector_json.py)")
    assert [s.count for s in stacks] == [3, 4, 2, 1]


def test_summary_adds_up_lines_of_one_function_and_threads_of_one_group() -> None:
    lines = summary(read(PROFILE.splitlines()), top=5, callers=1)
    assert lines[0] == "10 samples"
    assert " 60.0%  decode" in lines  # decode_1 and decode_2
    assert " 30.0%  MainThread" in lines
    assert " 10.0%  wal" in lines
    # Two lines of `parse`, one own frame with its caller; `decode` is inclusive in 60%.
    assert " 60.0%  parse (sink/vector_json.py) <- decode (sink/decode.py)" in lines
    inclusive = lines[lines.index("-- inclusive") :]
    assert " 60.0%  decode (sink/decode.py)" in inclusive


def test_thread_groups_are_the_leading_letters() -> None:
    assert thread_group("decode_3") == "decode"
    assert thread_group("wal-bench-1-3e77") == "wal"
    assert thread_group("0weird") == "0weird"


def test_a_line_that_is_not_a_folded_stack_is_refused() -> None:
    with pytest.raises(ValueError, match="line 2"):
        read(["thread (1): a;b 1\n", "garbage\n"])
    assert summary([]) == ["no samples"]
