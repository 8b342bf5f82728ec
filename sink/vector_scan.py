"""Vector JSON outside the interpreter lock: simdjson's On-Demand reader, in C++.

`sink.decode.Decoder` hands `scan` the JSON values of a batch when its table keeps the
vector as a JSON array. For each value, `sink._vector_scan` (sink/_vector_scan.cpp,
compiled against the simdjson release pysimdjson ships) walks the mapped path to the
vector, reads its numbers into the next row of one float32 matrix, and gives back the
value with the vector's text replaced by ``null``. The whole batch runs without the
interpreter lock, so the sink's decode threads parse vectors on every core, and no Python
object is made per component or per value but the stripped text.

The decoder parses the stripped texts with Arrow's reader, as it parses every other value,
so every scalar leaf, fault and reason comes from the one reader; only the vector comes
from here. The contract is identity with Arrow's path: a value is scanned only when its
vector reads exactly as Arrow's reader reads it (bit-exact float32), otherwise it is left
out and the decoder parses it whole as before. A value is left out when:

- simdjson refuses it or the part of it read here (the objects on the vector's path and the
  vector), it starts with a byte order mark (simdjson skips one, Arrow refuses it), or it
  is not an object;
- an object on the path has the path's key twice (Arrow's reader takes the last, and the
  stripped text would keep the other), or a parent on the path is not an object, null or
  missing;
- the vector is not an array of exactly ``dim`` numbers (null, missing, another length,
  nested arrays, strings);
- a component may round differently: Arrow rounds the decimal text straight to float32,
  simdjson reads the nearest double, cast here. The two agree unless the double lies
  exactly halfway between two float32 values, so such components are left to Arrow, as are
  those beyond float32's range (Arrow's reader names them), the integer ``-0`` (the
  decoder's own paths disagree on its sign: Arrow's bulk read gives -0.0, its screening of
  a value the bulk read refused +0) and, when simdjson's reader reads the vector (below),
  every negative zero (it reads ``-0`` as +0).

A vector that is a flat array of plain decimals (``-?(0|[1-9][0-9]*)(.[0-9]+)?`` with
optional exponent, at most 19 digits) is read in one pass over its text, each component
by one exact IEEE operation (Clinger's fast path: a significand of at most 2^53 and a
power of ten up to 10^22, so the double is the correctly rounded one simdjson's reader
gives); on x86-64 CPUs with SSSE3 a component of at most 15 characters is read in one
SIMD step; these readers give any other negative zero (``-0.0``, ``-0e0``) -0.0, as both
of the decoder's paths do. Any other vector is read by simdjson's reader, which decides it.

`scan_base64` does the same for a vector kept as a base64 string (``vector.encoding =
"base64_f32"``): it scans a value only when the string is exactly the base64 text of
``4 * dim`` bytes in the standard alphabet (with the padding that length needs, and no
escape, not even ``\\/``), and gives the texts back as they stand, in one Arrow string
array whose buffer holds them end to end. The decoder decodes them as it decodes the base64
texts Arrow's reader gives it (in one pybase64 call when no text has padding), so every
fault and reason of a base64 vector (NaN, infinities) stays the decoder's.

The rest of each value is read by Arrow's reader from the stripped text (which is the
value, byte for byte, but the vector), so what simdjson skips here unchecked is checked
there; a stripped text Arrow refuses goes back whole to the decoder's other path. Identity
with Arrow's path is proven by the property test in tests/unit/test_decode_vector_json.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from sink import _vector_scan

__all__ = ["scan", "scan_base64"]


def scan(
    payloads: list[bytes], path: Sequence[str], dim: int, simd: bool = True
) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    """Scan `payloads` for the vector at `path`, a JSON array of `dim` numbers.

    Args:
        simd: read short decimals with the SSSE3 reader when the CPU has one; False keeps
            to the portable reader (the same results: the tests compare the two).

    Returns:
        The positions (ascending, in `payloads`) of the values scanned, their vectors as a
        ``(len(positions), dim)`` float32 matrix, and their stripped texts.
    """
    matrix, where, stripped = _vector_scan.scan(payloads, tuple(path), dim, False, simd)
    positions = np.frombuffer(where, np.int64)
    rows = np.frombuffer(matrix, np.float32, count=len(positions) * dim)
    return positions, rows.reshape(len(positions), dim), stripped


def scan_base64(
    payloads: list[bytes], path: Sequence[str], dim: int
) -> tuple[np.ndarray, pa.Array, list[bytes]]:
    """Scan `payloads` for the vector at `path`, the base64 text of `dim` float32.

    Returns:
        The positions (ascending, in `payloads`) of the values scanned, their base64 texts
        (an Arrow string array, undecoded), and their stripped texts.
    """
    matrix, where, stripped = _vector_scan.scan(payloads, tuple(path), dim, True)
    positions = np.frombuffer(where, np.int64)
    chars = (4 * dim + 2) // 3 * 4
    offsets = np.arange(0, (len(positions) + 1) * chars, chars, dtype=np.int32)
    texts = pa.StringArray.from_buffers(len(positions), pa.py_buffer(offsets), pa.py_buffer(matrix))
    return positions, texts, stripped
