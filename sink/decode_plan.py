"""The decoder's plan: what each output column is made from (`ColumnPlan`), fixed when a
`sink.decode.Decoder` is built, and the canonical Arrow types its columns are checked in
before the final cast; with the Arrow helpers the decoding stages share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.schema import arrow_type
from sink.decoded import Reason

__all__ = [
    "CANONICAL",
    "TS_PARSE_TYPE",
    "TS_TYPE",
    "TYPE_NAMES",
    "ColumnPlan",
    "Fault",
    "Kind",
    "Path",
    "concat",
    "take",
    "to_ms_timestamp",
    "type_name_of",
]

TS_TYPE: Final = pa.timestamp("ms", tz="UTC")

#: ISO strings are parsed at microsecond resolution, then truncated to the column's ms.
TS_PARSE_TYPE: Final = pa.timestamp("us", tz="UTC")

Kind: TypeAlias = Literal[
    "json", "bytes", "key", "topic", "partition", "offset", "timestamp", "none"
]  # fmt: skip

Fault: TypeAlias = tuple[Reason, str]

Path: TypeAlias = tuple[str, ...]

#: The canonical Arrow type of each column type while rows are checked (before the final
#: cast): binary JSON columns are still base64 text, vectors are still variable lists.
CANONICAL: Final[dict[str, pa.DataType]] = {
    "string": pa.string(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "binary": pa.string(),
    "timestamp": TS_TYPE,
    "vector": pa.list_(pa.float32()),
    "base64_f32": pa.string(),  # the vector with vector.encoding = "base64_f32"
}

#: The scalar column type names of `config.settings.ColumnSpec`.
TYPE_NAMES: Final = (
    "string", "int32", "int64", "float32", "float64", "bool", "binary", "timestamp",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ColumnPlan:
    """One output column (not a source column, not `_op`) and where its values come from."""

    name: str
    type_name: str  # a ColumnSpec type name, or "vector"
    arrow_type: pa.DataType
    kind: Kind
    path: Path = ()  # json: the JSON path; bytes: ("@key",), ("@value",) or ("@headers", NAME)
    required: bool = False  # null is a fault in a live row
    primary_key: bool = False

    @property
    def where(self) -> str:
        """The source as the user wrote it, for dead-letter details."""
        if self.kind == "json":
            return "$." + ".".join(self.path)
        if self.kind == "bytes":
            return ".".join(self.path)
        if self.kind == "key":
            return ".".join(("@key", *self.path))
        return "" if self.kind == "none" else "@" + self.kind


def type_name_of(type_: pa.DataType) -> str:
    """The column type name of a table field's Arrow type ("vector" for the vector)."""
    if pa.types.is_fixed_size_list(type_):
        return "vector"
    for name in TYPE_NAMES:
        if arrow_type(name).equals(type_):
            return name
    raise ValueError(f"unsupported column type {type_}")


def concat(arrays: list[pa.Array]) -> pa.Array:
    return arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)


#: Above this many runs of consecutive rows, `take` leaves a list array to Arrow's take
#: (measured on 10,000 384-dim vectors: joining runs 8 ms at 2,000 runs, as fast as Arrow's
#: take, ~13 ms, at 4,000, slower beyond).
_TAKE_RUNS_MAX: Final = 3_000


def take(arr: pa.Array, rows: np.ndarray) -> pa.Array:
    """``arr.take(rows)``; for a list array (a vector column) with few runs of consecutive
    rows, the runs' slices joined, one copy each: Arrow's take and filter of a list array
    go row by row (15-20 ms per 10,000 384-dim vectors, for one row left out as for a
    thousand), the runs joined 3-8 ms up to 2,000 runs."""
    if not pa.types.is_list(arr.type):
        return arr.take(pa.array(rows))
    if len(rows) == 0:
        return arr.slice(0, 0)
    bounds = np.concatenate(([0], np.flatnonzero(np.diff(rows) != 1) + 1, [len(rows)]))
    if len(bounds) - 1 > _TAKE_RUNS_MAX:
        return arr.take(pa.array(rows))
    runs = [
        arr.slice(int(rows[start]), int(end - start))
        for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
    ]
    return concat(runs)


def to_ms_timestamp(arr: pa.Array) -> pa.Array:
    """Epoch-ms integers (a zero-copy view) or parsed ISO text (floored to the ms) as ms."""
    if pa.types.is_integer(arr.type):
        return arr.cast(TS_TYPE)
    # Flooring drops sub-millisecond digits the way cutting them from the text would, also
    # before 1970 (a plain cast truncates toward zero, i.e. rounds those up).
    return pc.floor_temporal(arr, unit="millisecond").cast(TS_TYPE)
