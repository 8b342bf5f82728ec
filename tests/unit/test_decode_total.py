"""`Decoder.decode` is total: whatever a decode path raises for a batch (but the registry
and evolution signals) ends as a ``decode_error`` dead letter of the one message that
raises, found by splitting the batch; every other message decodes as it would have.

The faults are injected into the real decoder's own parse steps (the vector scan, Arrow's
reader, the registry records), as a bug no test foresaw would raise there."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import structlog

from sink import json_parse
from sink.decode import Decoder
from sink.formats import RegistryUnavailable, SchemaEvolution
from tests.unit.test_decode import Msg
from tests.unit.test_decode_vector_json import CLEAN, source, spec

POISON = b'{"id": "BOOM", "vec": [1, 2, 3, 4]}'


def batch(n: int, poison_at: set[int]) -> list[Msg]:
    values = [POISON if i in poison_at else CLEAN.replace(b'"a"', b'"r%d"' % i) for i in range(n)]
    return [Msg(v, 100 + i) for i, v in enumerate(values)]


def raising_on_poison(real: Callable[..., Any], exc: BaseException) -> Callable[..., Any]:
    """`real`, raising `exc` whenever one of its payloads is the poison message."""

    def wrapped(payloads: list[bytes], *args: Any, **kwargs: Any) -> Any:
        if any(b"BOOM" in p for p in payloads):
            raise exc
        return real(payloads, *args, **kwargs)

    return wrapped


@pytest.mark.parametrize(
    "exc",
    [OverflowError("int too large"), KeyError("x"), RecursionError("deep"), MemoryError()],
    ids=lambda e: type(e).__name__,
)
@pytest.mark.parametrize("step", ["scan", "read_json"])
def test_a_message_a_decode_step_raises_on_is_a_decode_error_dead_letter(
    monkeypatch: pytest.MonkeyPatch, step: str, exc: BaseException
) -> None:
    if step == "scan":
        monkeypatch.setattr(json_parse, "scan", raising_on_poison(json_parse.scan, exc))
    else:
        real = json_parse.pj.read_json

        def read_json(source: Any, *args: Any, **kwargs: Any) -> Any:
            if b"BOOM" in source.read():
                raise exc
            source.seek(0)
            return real(source, *args, **kwargs)

        monkeypatch.setattr(json_parse.pj, "read_json", read_json)
    messages = batch(300, {0, 137, 299})
    with structlog.testing.capture_logs() as logs:
        out = Decoder(spec(), source()).decode(messages)
    assert [(d.offset, d.reason) for d in out.dead_letters] == [
        (100, "decode_error"),
        (237, "decode_error"),
        (399, "decode_error"),
    ]
    assert all(type(exc).__name__ in d.detail for d in out.dead_letters)
    assert out.dead_letters[1].value == POISON
    assert out.batch is not None
    want = Decoder(spec(), source()).decode([m for m in messages if m.value() != POISON])
    assert want.batch is not None
    assert out.batch.equals(want.batch)
    assert (out.first_offset, out.last_offset) == (100, 399)
    # Logged with its traceback, once for the three (rate-limited per type and place).
    errors = [e for e in logs if e["event"] == "decode_error"]
    assert len(errors) <= 1
    assert all(e["exc_info"] is not None for e in errors)


def test_every_message_raising_is_every_message_a_dead_letter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(json_parse, "scan", raising_on_poison(json_parse.scan, ValueError("bug")))
    messages = batch(64, set(range(64)))
    out = Decoder(spec(), source()).decode(messages)
    assert out.batch is None
    assert [d.offset for d in out.dead_letters] == [m.offset() for m in messages]
    assert {d.reason for d in out.dead_letters} == {"decode_error"}


@pytest.mark.parametrize(
    "signal",
    [RegistryUnavailable("registry down"), SchemaEvolution("new fields", (7,))],
    ids=lambda e: type(e).__name__,
)
def test_the_registry_and_evolution_signals_still_leave_decode(
    monkeypatch: pytest.MonkeyPatch, signal: Exception
) -> None:
    monkeypatch.setattr(json_parse, "scan", raising_on_poison(json_parse.scan, signal))
    with pytest.raises(type(signal)):
        Decoder(spec(), source()).decode(batch(10, {4}))


def test_a_long_exception_text_is_cut_in_the_detail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        json_parse, "scan", raising_on_poison(json_parse.scan, ValueError("x" * 10_000))
    )
    (letter,) = Decoder(spec(), source()).decode(batch(1, {0})).dead_letters
    assert letter.reason == "decode_error"
    assert len(letter.detail) < 1_200
    assert json.dumps(letter.detail)
