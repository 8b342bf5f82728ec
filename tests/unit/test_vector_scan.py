"""sink.vector_scan: which values it reads, what it reads, and the stripped texts it gives
(vectors as JSON arrays, and as base64 strings).

Identity of whole decoded batches with Arrow's path is proven in
tests/unit/test_decode_vector_json.py; these tests pin the scan's own rules.
"""

from __future__ import annotations

import base64
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pj
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sink import json_parse
from sink.decode import Decoder
from sink.vector_json import float32_ties
from sink.vector_scan import scan, scan_base64
from tests.unit.test_decode import Msg
from tests.unit.test_decode_vector_json import (
    CLEAN,
    DIM,
    assert_same,
    number_text,
    source,
    spec,
)


def _arrow_float32(texts: list[str]) -> np.ndarray:
    """The float32 values Arrow's JSON reader makes of number texts (the reference)."""
    body = "\n".join(f'{{"x":{t}}}' for t in texts).encode()
    schema = pa.schema([("x", pa.float32())])
    table = pj.read_json(
        pa.BufferReader(body), parse_options=pj.ParseOptions(explicit_schema=schema)
    )
    return table.column("x").to_numpy()


def test_vectors_are_read_bit_exactly_and_the_rest_is_kept_byte_for_byte() -> None:
    rng = np.random.default_rng(7)
    texts = [
        [repr(float(x)) for x in rng.standard_normal(4).astype(np.float32)],
        ["1e-3", "-2.5E+2", "3", "0.1"],
        ["123456789012345678", "1.17549435e-38", "1e-45", "3.4028234e38"],
    ]
    payloads = [('{"id": "a", "vec": [' + ", ".join(t) + '], "n": 1}').encode() for t in texts]
    positions, matrix, stripped = scan(payloads, ("vec",), 4)
    assert positions.tolist() == [0, 1, 2]
    for row, t in zip(matrix, texts, strict=True):
        assert row.view(np.uint32).tolist() == _arrow_float32(t).view(np.uint32).tolist()
    assert stripped == [b'{"id": "a", "vec": null, "n": 1}'] * 3


def test_negative_zeros_read_in_one_pass_are_kept_as_arrow_reads_them() -> None:
    """Every negative zero text the one-pass readers take is -0.0 (Arrow's reader gives
    -0.0 for each, in bulk and when the decoder screens a value); on both readers. The
    integer -0 is left out (test_values_it_is_not_sure_of_are_left_out)."""
    texts = ["-0.0", "-0.000", "-0e0", "-0E+5", "-0.0e-3", "-0.00000000000000"]
    payloads = [f'{{"vec": [{t}, 0, 1]}}'.encode() for t in texts]
    positions, matrix = _both_readers(payloads, 3)
    assert positions.tolist() == list(range(len(texts)))
    assert np.signbit(matrix[:, 0]).all()
    assert not np.signbit(matrix[:, 1]).any()
    assert _assert_rows_as_arrow_reads_them([[t, "0", "1"] for t in texts], 3) == len(texts)


def test_a_nested_path_with_whitespace_and_an_escaped_key() -> None:
    payloads = [
        b'{"emb": {"model": "m", "v\\u0065c" :\n[ 1 ,\t2\r\n, 3 ] , "k": [[1]]}, "id": 1}',
    ]
    positions, matrix, stripped = scan(payloads, ("emb", "vec"), 3)
    assert positions.tolist() == [0]
    assert matrix.tolist() == [[1.0, 2.0, 3.0]]
    assert stripped == [b'{"emb": {"model": "m", "v\\u0065c" :\nnull , "k": [[1]]}, "id": 1}']


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b'{"vec": [1, 2], "vec": [3, 4]}', id="duplicate-vector-key"),
        pytest.param(b'{"e": {"vec": [1, 2]}, "e": {}}', id="duplicate-parent-key"),
        pytest.param(b'\xef\xbb\xbf{"vec": [1, 2]}', id="byte-order-mark"),
        pytest.param(b'[{"vec": [1, 2]}]', id="not-an-object"),
        pytest.param(b'{"vec": [1, 2, 3]}', id="too-long"),
        pytest.param(b'{"vec": [1]}', id="too-short"),
        pytest.param(b'{"vec": [1, [2]]}', id="nested-array"),
        pytest.param(b'{"vec": [1, "2"]}', id="string-component"),
        pytest.param(b'{"vec": null}', id="null-vector"),
        pytest.param(b'{"id": 1}', id="missing-vector"),
        # The decoder's Arrow paths disagree on the integer -0's sign.
        pytest.param(b'{"vec": [1, -0]}', id="integer-negative-zero"),
        # simdjson's reader (here for the 22-digit number) reads -0 as +0.
        pytest.param(b'{"vec": [-0.0, 1.000000000000000000001]}', id="negative-zero-simdjson"),
        # 1 + 2**-24 exactly: halfway between two float32 values.
        pytest.param(b'{"vec": [1, 1.000000059604644775390625]}', id="float32-tie"),
        pytest.param(b'{"vec": [1, 1e39]}', id="beyond-float32"),
        pytest.param(b'{"vec": [1, 1e400]}', id="beyond-double"),
        pytest.param(b'{"vec": [1, NaN]}', id="nan"),
        pytest.param(b'{"vec": [1,, 2]}', id="invalid-array"),
        pytest.param(b'{"vec": [1, 2]', id="truncated"),
        pytest.param(b'{"vec": [1, 01]}', id="leading-zero"),
        pytest.param(b"", id="empty"),
    ],
)
def test_values_it_is_not_sure_of_are_left_out(payload: bytes) -> None:
    good = b'{"vec": [5, 6]}'
    positions, matrix, stripped = scan([good, payload, good], ("vec",), 2)
    assert positions.tolist() == [0, 2]
    assert matrix.tolist() == [[5.0, 6.0], [5.0, 6.0]]
    assert stripped == [b'{"vec": null}'] * 2


def _both_readers(payloads: list[bytes], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The scan with the SSSE3 component reader and with the portable one: they must agree
    on every value, bit for bit. Returns the positions and matrix."""
    fast = scan(payloads, ("vec",), dim)
    portable = scan(payloads, ("vec",), dim, simd=False)
    assert fast[0].tolist() == portable[0].tolist()
    assert fast[1].view(np.uint32).tolist() == portable[1].view(np.uint32).tolist()
    assert fast[2] == portable[2]
    return fast[0], fast[1]


def _assert_rows_as_arrow_reads_them(rows: list[list[str]], dim: int) -> int:
    """Each row of number texts as a vector payload: the rows scanned read exactly as
    Arrow's reader reads their texts. Returns how many were scanned."""
    payloads = [("{" + f'"vec": [{", ".join(r)}]' + "}").encode() for r in rows]
    positions, matrix = _both_readers(payloads, dim)
    for pos, row in zip(positions.tolist(), matrix, strict=True):
        expected = _arrow_float32(rows[pos]).view(np.uint32)
        assert row.view(np.uint32).tolist() == expected.tolist(), rows[pos]
    return len(positions)


def test_short_decimals_of_every_length_and_point_read_as_arrow_does() -> None:
    """Every length the one-step reader takes (1-15 characters after the sign) with the
    point at every place, and the lengths just beyond it, read bit-exactly; the malformed
    ones next to them are left out by both readers."""
    rng = np.random.default_rng(11)
    good: list[str] = []
    for length in range(1, 19):
        for point in [None, *range(1, length - 1)]:
            for _ in range(3):
                digits = [str(d) for d in rng.integers(0, 10, length - (point is not None))]
                if point != 1 or rng.integers(0, 2):
                    digits[0] = str(rng.integers(1, 10))  # no leading zero but "0."
                else:
                    digits[0] = "0"
                if point is not None:
                    digits.insert(point, ".")
                sign = "-" if rng.integers(0, 2) else ""
                good.append(sign + "".join(digits))
    # Left out on purpose: float32 ties (Arrow's reader decides them).
    good = [t for t in good if not float32_ties(np.array([float(t)]))[0]]
    rows = [good[i : i + 4] for i in range(0, len(good) - 3, 4)]
    assert len(rows) > 100
    assert _assert_rows_as_arrow_reads_them(rows, 4) == len(rows)
    bad = ["01", "-01.5", "1.", ".5", "-", "1.2.3", "1..2", "--1", "+1", "1-", "0x1", "1 2"]
    for text in bad:
        positions, _ = _both_readers([f'{{"vec": [1, {text}, 2]}}'.encode()], 3)
        assert positions.tolist() == [], text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.lists(
            st.one_of(
                number_text(),
                st.builds(
                    lambda sign, whole, frac: f"{sign}{whole}.{frac}",
                    st.sampled_from(["", "-"]),
                    st.integers(0, 10**6),
                    st.text("0123456789", min_size=1, max_size=14),
                ),
            ),
            min_size=DIM,
            max_size=DIM,
        ),
        min_size=1,
        max_size=20,
    ),
    st.sampled_from(["", " ", "\n "]),
)
def test_generated_components_decode_as_arrow_does_on_both_readers(
    rows: list[list[str]], ws: str
) -> None:
    """Both component readers scan the same values the same way, and the decoder (which
    scans with the SSSE3 one) gives the rows and dead letters of Arrow's reader alone."""
    payloads = [
        ("{" + f'"id": "a", "vec":[{ws}{("," + ws).join(r)}{ws}]' + "}").encode() for r in rows
    ]
    _both_readers(payloads, DIM)
    assert_same(payloads)


def test_scans_run_on_several_threads_at_once() -> None:
    """The scan lets go of the interpreter lock; concurrent scans give the same results."""
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((200, 16)).astype(np.float32)
    payloads = [f'{{"vec": {v.tolist()}}}'.encode() for v in vectors]
    expected = scan(payloads, ("vec",), 16)[1]
    results: list[np.ndarray] = []
    threads = [
        threading.Thread(target=lambda: results.append(scan(payloads, ("vec",), 16)[1]))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for got in results:
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert np.array_equal(expected, vectors.astype(np.float64).astype(np.float32))


def test_bad_arguments_are_refused_and_values_not_bytes_left_out() -> None:
    with pytest.raises(ValueError, match="positive dim"):
        scan([b"{}"], ("vec",), 0)
    with pytest.raises(ValueError, match="non-empty path"):
        scan([b"{}"], (), 2)
    with pytest.raises(TypeError):
        scan((b"{}",), ("vec",), 2)  # type: ignore[arg-type]
    positions, _, stripped = scan(
        ['{"vec": [1, 2]}', None, b'{"vec": [1, 2]}'],  # type: ignore[list-item]
        ("vec",),
        2,
    )
    assert positions.tolist() == [2]
    assert stripped == [b'{"vec": null}']


def test_the_decoder_scans_clean_values_and_parses_the_others_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Clean values never reach the decoder's other path; a value the scan leaves out, or
    whose stripped text Arrow refuses, does, whole (its dead letter names what was sent)."""
    whole: list[list[bytes]] = []
    parse_whole = json_parse.JsonParser._parse_simdjson

    def spy(self: json_parse.JsonParser, payloads: list[bytes], sizes: np.ndarray) -> Any:
        whole.append(payloads)
        return parse_whole(self, payloads, sizes)

    monkeypatch.setattr(json_parse.JsonParser, "_parse_simdjson", spy)
    decoder = Decoder(spec(), source())
    clean = [Msg(CLEAN, i) for i in range(50)]
    out = decoder.decode(clean)
    assert out.batch is not None
    assert len(out.batch) == 50
    assert whole == []

    left_out = b'{"id": "x", "vec": [1, 2, 3]}'
    bad_elsewhere = b'{"id": "x", "vec": [1, 2, 3, 4], "n": tru}'
    out = decoder.decode([Msg(CLEAN, 0), Msg(left_out, 1), Msg(bad_elsewhere, 2)])
    assert whole == [[left_out, bad_elsewhere]]
    assert out.batch is not None
    assert len(out.batch) == 1
    assert [d.reason for d in out.dead_letters] == ["wrong_vector_dimension", "invalid_json"]
    arrow = Decoder(spec(), source(), vector_fast_path=False)
    expected = arrow.decode([Msg(CLEAN, 0), Msg(left_out, 1), Msg(bad_elsewhere, 2)])
    assert [(d.reason, d.detail) for d in out.dead_letters] == [
        (d.reason, d.detail) for d in expected.dead_letters
    ]


def test_a_scan_lets_other_threads_run() -> None:
    """The scan lets go of the interpreter lock for the whole batch: a Python loop on
    another thread keeps running meanwhile (with the lock held, it would stand still for
    the scan's whole duration)."""
    rng = np.random.default_rng(5)
    row = ", ".join(repr(float(x)) for x in rng.standard_normal(384).astype(np.float32))
    payloads = [f'{{"id": "{i}", "vec": [{row}]}}'.encode() for i in range(4000)]
    started = time.perf_counter()
    scan(payloads, ("vec",), 384)
    alone = time.perf_counter() - started
    payloads *= max(1, round(0.5 / alone))  # about half a second of scanning
    done = threading.Event()

    def scan_all() -> None:
        scan(payloads, ("vec",), 384)
        done.set()

    worker = threading.Thread(target=scan_all)
    last = time.perf_counter()
    gaps = []
    worker.start()
    began = last
    while not done.is_set():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    took = last - began
    worker.join()
    assert took > 0.2, took  # the scan did take long enough to tell
    assert max(gaps) < took / 3, (max(gaps), took)


# -- base64 vectors (vector.encoding = "base64_f32") --------------------------------


def _b64(floats: list[float]) -> str:
    return base64.b64encode(np.array(floats, "<f4").tobytes()).decode()


@pytest.mark.parametrize("dim", [3, 4, 5])  # no padding, "==" and "="
def test_base64_texts_are_given_back_as_they_stand_and_the_rest_byte_for_byte(dim: int) -> None:
    vectors = [[float(i + k) for k in range(dim)] for i in range(3)]
    payloads = [f'{{"id": "a", "vec": "{_b64(v)}" , "n": 1}}'.encode() for v in vectors]
    payloads.append(f'{{"e": {{"vec":"{_b64(vectors[0])}"}}, "x": [1]}}'.encode())
    positions, texts, stripped = scan_base64(payloads[:3], ("vec",), dim)
    assert positions.tolist() == [0, 1, 2]
    assert texts.to_pylist() == [_b64(v) for v in vectors]
    assert stripped == [b'{"id": "a", "vec": null , "n": 1}'] * 3
    positions, texts, stripped = scan_base64(payloads[3:], ("e", "vec"), dim)
    assert texts.to_pylist() == [_b64(vectors[0])]
    assert stripped == [b'{"e": {"vec":null}, "x": [1]}']


GOOD4 = _b64([1, 2, 3, 4])  # 16 bytes: 22 letters and "=="


@pytest.mark.parametrize(
    "vec",
    [
        pytest.param('"' + GOOD4[:-2] + '"', id="padding-missing"),
        pytest.param('"' + GOOD4[:-1] + '"', id="padding-short"),
        pytest.param('"' + GOOD4 + '="', id="padding-long"),
        pytest.param('"' + GOOD4 + 'AAAA"', id="too-long"),
        pytest.param('"' + _b64([1, 2, 3]) + '"', id="too-short"),
        pytest.param('"' + GOOD4[:5] + "=" + GOOD4[6:] + '"', id="padding-inside"),
        pytest.param('"' + GOOD4.replace("A", "-", 1) + '"', id="url-safe-alphabet"),
        pytest.param('"' + GOOD4[:8] + " " + GOOD4[9:] + '"', id="space-inside"),
        pytest.param('"' + GOOD4[:8] + "\\n" + GOOD4[10:] + '"', id="escaped-newline"),
        pytest.param('"' + GOOD4[:8] + "\\/" + GOOD4[9:] + '"', id="escaped-slash"),
        pytest.param('"' + GOOD4[:8] + "\\u0041" + GOOD4[9:] + '"', id="unicode-escape"),
        pytest.param("[1, 2, 3, 4]", id="an-array"),
        pytest.param("null", id="null"),
        pytest.param("1234", id="a-number"),
    ],
)
def test_base64_values_it_is_not_sure_of_are_left_out(vec: str) -> None:
    good = f'{{"vec": "{GOOD4}"}}'.encode()
    payload = f'{{"vec": {vec}}}'.encode()
    positions, texts, stripped = scan_base64([good, payload, good], ("vec",), 4)
    assert positions.tolist() == [0, 2]
    assert texts.to_pylist() == [GOOD4, GOOD4]
    assert stripped == [b'{"vec": null}'] * 2


def test_the_decoder_scans_large_batches_of_base64_vectors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Above `_SIMDJSON_BASE64_MAX` values the decoder scans base64 vectors; what the scan
    leaves out (a bad text, an escaped slash in a good one) takes the simdjson path, and
    rows and dead letters are those of Arrow's reader alone. A small batch is not scanned."""
    scanned: list[int] = []
    whole: list[list[bytes]] = []
    scan_b64 = json_parse.scan_base64
    parse_whole = json_parse.JsonParser._parse_simdjson

    def spy_scan(payloads: list[bytes], path: tuple[str, ...], dim: int) -> Any:
        result = scan_b64(payloads, path, dim)
        scanned.append(len(result[0]))
        return result

    def spy_whole(self: json_parse.JsonParser, payloads: list[bytes], sizes: np.ndarray) -> Any:
        whole.append(payloads)
        return parse_whole(self, payloads, sizes)

    monkeypatch.setattr(json_parse, "scan_base64", spy_scan)
    monkeypatch.setattr(json_parse.JsonParser, "_parse_simdjson", spy_whole)
    n = json_parse._SIMDJSON_BASE64_MAX + 1
    values = [f'{{"id": "{i}", "vec": "{_b64([i, 2, 3, 4])}"}}'.encode() for i in range(n)]
    slash = '{"id": "s", "vec": "' + _b64([47.75, 2, 3, 4]).replace("/", "\\/") + '"}'
    assert "\\/" in slash
    values[3] = slash.encode()
    values[5] = b'{"id": "x", "vec": "not base64!"}'
    messages = [Msg(v, i) for i, v in enumerate(values)]
    out = Decoder(spec("base64_f32"), source()).decode(messages)
    assert scanned == [n - 2]
    assert whole == [[values[3], values[5]]]
    arrow = Decoder(spec("base64_f32"), source(), vector_fast_path=False).decode(messages)
    assert out.batch is not None
    assert arrow.batch is not None
    assert out.batch.equals(arrow.batch)
    assert [(d.offset, d.reason) for d in out.dead_letters] == [(5, "wrong_type")]
    assert out.batch.column("vec").to_pylist()[3] == [47.75, 2, 3, 4]
    scanned.clear()
    whole.clear()
    out = Decoder(spec("base64_f32"), source()).decode(messages[: n - 1])
    assert scanned == []
    assert whole == [values[: n - 1]]
