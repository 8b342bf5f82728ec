"""The filter language: the same predicate selects the same rows in a memtable and in the
base table, and bad filters fail with typed errors that say where."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pytest

from engine.filters import FilterSyntaxError, QueryError, UnknownColumn, parse_filter
from tests.reads.conftest import ReadHarness, read_spec, rows_batch

pytestmark = pytest.mark.timeout(120)

PREDICATES = [
    "n = 18",
    "n == 18",
    "n != 18",
    "n <> 18",
    "n < 40",
    "n <= 40",
    "n > 40",
    "n >= 40",
    "f > 10.5",
    "n > 10 AND n < 50",
    "n < 10 OR n > 90",
    "NOT n < 50",
    "NOT (n > 10 AND f < 20)",
    "(n < 5 OR n > 95) AND NOT flag",
    "id IN ('k1', 'k2', 'k50', 'nope')",
    "id NOT IN ('k1', 'k2')",
    "n IN (1, 2, 3, 10)",
    "n NOT IN (1, 2, 3)",
    "n IS NULL",
    "n IS NOT NULL",
    "text IS NULL",
    "NOT n IS NULL AND flag",
    "text LIKE 'alpha%'",
    "text LIKE '%v0'",
    "text LIKE '%delta%'",
    "NOT text LIKE 'alpha%'",
    "id LIKE 'k1'",
    "id LIKE 'k1%'",
    "ts >= '2026-01-01T01:00:00Z'",
    "ts < TIMESTAMP '2026-01-01T00:30:00+00:00'",
    "ts BETWEEN '2026-01-01T00:10:00Z' AND '2026-01-01T00:20:00Z'",
    "flag",
    "NOT flag",
    "flag = false",
    "flag != true",
    "n BETWEEN 20 AND 30",
    "n NOT BETWEEN 20 AND 30",
    "`n` > 3 and `id` < 'k5' or flag = TRUE",
]


@pytest.fixture
def tiers(make_harness: Callable[..., ReadHarness]) -> tuple[ReadHarness, ReadHarness]:
    """The same 100 rows: in the memtables of one table and in the base of another."""
    fresh = make_harness("fresh")
    flushed = make_harness("flushed")
    w1, w2 = fresh.open(), flushed.open()
    for first in range(0, 100, 25):  # several batches per memtable
        fresh.put(w1, range(first, first + 25))
        flushed.put(w2, range(first, first + 25))
    flushed.flush(w2)
    assert flushed.table.dataset().count_rows() == 100
    assert fresh.table.dataset().count_rows() == 0
    return fresh, flushed


@pytest.mark.parametrize("text", PREDICATES)
def test_same_rows_in_every_tier(tiers: tuple[ReadHarness, ReadHarness], text: str) -> None:
    fresh, flushed = tiers
    in_memtable = fresh.reader.scan(filter=text, columns=["_offset"]).column("_offset")
    in_base = flushed.reader.scan(filter=text, columns=["_offset"]).column("_offset")
    # A third opinion: pyarrow's own evaluation of the Expression handed to Lance.
    table = pa.Table.from_batches([rows_batch(fresh.spec, list(range(100)))])
    oracle = table.filter(parse_filter(text, fresh.spec.table_schema).expression)
    want = sorted(oracle.column("_offset").to_pylist())
    assert sorted(in_memtable.to_pylist()) == want
    assert sorted(in_base.to_pylist()) == want


def test_predicates_are_not_trivial(tiers: tuple[ReadHarness, ReadHarness]) -> None:
    """Each predicate keeps some rows and drops some (otherwise the comparison proves little)."""
    fresh, _ = tiers
    for text in PREDICATES:
        count = fresh.reader.scan(filter=text, columns=["_offset"]).num_rows
        assert 0 < count < 100, text


SCHEMA = read_spec("/tmp/unused.lance").table_schema


@pytest.mark.parametrize(
    ("text", "error", "position"),
    [
        ("n = ", FilterSyntaxError, 4),
        ("n >> 3", FilterSyntaxError, 3),
        ("(n = 3", FilterSyntaxError, 6),
        ("n = 3 AND", FilterSyntaxError, 9),
        ("n = 3 n", FilterSyntaxError, 6),
        ("n = NULL", FilterSyntaxError, 4),
        ("n = 3 ; drop", FilterSyntaxError, 6),
        ("f", FilterSyntaxError, 1),
        ("", FilterSyntaxError, 0),
        ("id IN ()", FilterSyntaxError, 7),
        ("n NOT = 3", FilterSyntaxError, 6),
    ],
)
def test_syntax_errors_say_where(text: str, error: type[Exception], position: int) -> None:
    with pytest.raises(error) as info:
        parse_filter(text, SCHEMA)
    assert isinstance(info.value, FilterSyntaxError)
    assert info.value.position == position
    assert f"position {position}" in str(info.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("nope = 3", "unknown column 'nope'"),
        ("vec = 3", "cannot be used in a filter"),
        ("_op = 1", "unknown column '_op'"),
    ],
)
def test_unknown_columns(text: str, fragment: str) -> None:
    with pytest.raises(UnknownColumn, match=fragment):
        parse_filter(text, SCHEMA)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("n = 'x'", "does not compare"),
        ("n = 3.5", "non-integer"),
        ("flag > true", "bool columns"),
        ("id = 3", "does not compare"),
        ("ts > 'yesterday'", "invalid timestamp"),
        ("id LIKE 'a_b'", "unsupported LIKE"),
        ("id LIKE 'a%b'", "unsupported LIKE"),
        ("n LIKE 'a%'", "LIKE needs a string"),
        ("n = 99999999999999999999999", "does not fit"),
        ("n = TIMESTAMP '2026-01-01'", "does not compare"),
    ],
)
def test_type_errors(text: str, fragment: str) -> None:
    with pytest.raises(QueryError, match=fragment):
        parse_filter(text, SCHEMA)


def test_deep_nesting_is_refused() -> None:
    with pytest.raises(FilterSyntaxError, match="nested deeper"):
        parse_filter("NOT " * 100 + "flag", SCHEMA)


def test_a_memtable_of_many_batches_is_filtered_in_one_pass_with_the_same_rows(
    make_harness: Callable[..., ReadHarness],
) -> None:
    h = make_harness()
    w = h.open()
    for first in range(0, 1000, 50):  # 20 puts: 20 batches in the active memtable
        h.put(w, range(first, first + 50))
    tier = h.reader.snapshot().tiers[0]
    assert len(tier.view.batches) == 20
    for text in ["n < 420 AND flag", "text IS NULL OR f >= 200", "id IN ('k3', 'k977')"]:
        predicate = h.reader.parse_filter(text)
        assert predicate is not None
        for i, batch in enumerate(tier.view.batches):
            np.testing.assert_array_equal(tier.matched(predicate, i), predicate.mask(batch))
