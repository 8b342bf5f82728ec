"""`sink.refused.split_refused`: the rows a table refuses leave the batch as
`rejected_by_table` dead letters of their own messages; the rest is kept as it was. The
refusals come from a real `TableSpec.validate` (a table without NaN vectors, fed by a
decoder that allows them)."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRecord
from sink.decode import Decoder
from sink.refused import split_refused
from tests.unit.test_decode import Msg
from tests.unit.test_decode_vector_json import CLEAN, source, spec

NAN = b'{"id": "nan", "vec": [NaN, 1, 2, 3]}'


def test_each_refused_row_is_its_messages_dead_letter_and_the_rest_is_kept() -> None:
    values = [CLEAN, NAN, b"{not json", CLEAN, NAN, None, CLEAN, NAN]
    messages = [Msg(v, 40 + i, key_=b"k%d" % i) for i, v in enumerate(values)]
    decoded = Decoder(spec(allow_nan=True), source()).decode(messages)
    table = spec(allow_nan=False)
    with pytest.raises(InvalidRecord) as refusal:
        table.validate(decoded.batch)
    kept, letters = split_refused(decoded, messages, refusal.value, table.validate)
    assert [(d.offset, d.reason) for d in letters] == [
        (41, "rejected_by_table"),
        (44, "rejected_by_table"),
        (47, "rejected_by_table"),
    ]
    assert all("NaN in vector column 'vec'" in d.detail for d in letters)
    assert [d.value for d in letters] == [NAN] * 3
    assert [d.key for d in letters] == [b"k1", b"k4", b"k7"]
    assert [(d.offset, d.reason) for d in kept.dead_letters] == [
        (41, "rejected_by_table"),
        (42, "invalid_json"),
        (44, "rejected_by_table"),
        (47, "rejected_by_table"),
    ]
    assert kept.batch is not None
    table.validate(kept.batch)  # what is left, the table takes
    assert kept.batch.column("_offset").to_pylist() == [40, 43, 46]
    assert (kept.first_offset, kept.last_offset, kept.skipped_offsets) == (40, 47, [45])


def test_a_refusal_naming_no_row_refuses_every_row() -> None:
    messages = [Msg(CLEAN, 5 + i) for i in range(3)]
    decoded = Decoder(spec(), source()).decode(messages)
    kept, letters = split_refused(
        decoded, messages, InvalidRecord("schema differs"), spec().validate
    )
    assert kept.batch is None
    assert [d.offset for d in letters] == [5, 6, 7]
    assert [d.offset for d in kept.dead_letters] == [5, 6, 7]
