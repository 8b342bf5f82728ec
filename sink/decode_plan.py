"""The decoder's plan: what each output column is made from (`ColumnPlan`, made by
`plan_column` from the column's configured source), fixed when a `sink.decode.Decoder` is
built, and the canonical Arrow types its columns are checked in before the final cast; with
the Arrow helpers the decoding stages share.
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
    "plan_column",
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


#: The column types a byte source (``@key``, ``@value``, ``@headers.NAME``) can fill.
_BYTES_TARGETS: Final = frozenset({"binary", "string", "int32", "int64"})

#: The column types each Kafka metadata source can fill.
_METADATA_TARGETS: Final[dict[str, frozenset[str]]] = {
    "@topic": frozenset({"string"}),
    "@partition": frozenset({"int32", "int64"}),
    "@offset": frozenset({"int64"}),
    "@timestamp": frozenset({"timestamp", "int64"}),
}

_METADATA_KINDS: Final[dict[str, Kind]] = {
    "@topic": "topic",
    "@partition": "partition",
    "@offset": "offset",
    "@timestamp": "timestamp",
}


def plan_column(
    f: pa.Field,
    mapped: str | None,
    *,
    required: bool,
    primary_key: bool,
    paths: bool,
    decoded_keys: bool,
) -> ColumnPlan:
    """The plan of one table column: where its values come from and what it must hold.

    Args:
        f: the table column (not a source column, not `_op`).
        mapped: its source as configured in ``source.columns`` (``$.a.b``, ``@key``,
            ``@key.a``, ``@value``, ``@headers.NAME``, ``@topic``, ...), None if unmapped.
        required: a null is a fault (a non-nullable or primary key column).
        primary_key: the column is part of the table's primary key.
        paths: the format reads paths (json and the registry formats): an unmapped column
            reads the same-named top-level field.
        decoded_keys: keys are registry-encoded (``source.key_format``): ``@key`` and
            ``@key.a`` read the decoded key.

    Returns:
        The column's plan.

    Raises:
        ValueError: the source cannot fill the column: a JSON path in the raw format, a
            source feeding a column type it cannot produce, or (raw format) a required
            column without a source.
    """
    type_name = type_name_of(f.type)
    pk = primary_key
    if mapped is None:
        if paths:
            return ColumnPlan(f.name, type_name, f.type, "json", (f.name,), required, pk)
        if required:
            raise ValueError(f"column {f.name!r} is required but has no source (raw format)")
        return ColumnPlan(f.name, type_name, f.type, "none")
    if mapped.startswith("$."):
        if not paths:
            raise ValueError(f"column {f.name!r}: JSON path {mapped!r} in the raw format")
        path = tuple(mapped[2:].split("."))
        return ColumnPlan(f.name, type_name, f.type, "json", path, required, pk)
    if decoded_keys and (mapped == "@key" or mapped.startswith("@key.")):
        path = tuple(mapped.split(".")[1:])
        return ColumnPlan(f.name, type_name, f.type, "key", path, required, pk)
    if mapped in {"@key", "@value"} or mapped.startswith("@headers."):
        if type_name not in _BYTES_TARGETS:
            raise ValueError(
                f"column {f.name!r} is {type_name}; {mapped} gives bytes, which feed "
                "binary, string, int32 or int64 columns only"
            )
        header = mapped.removeprefix("@headers.")
        path = (mapped,) if header == mapped else ("@headers", header)
        return ColumnPlan(f.name, type_name, f.type, "bytes", path, required, pk)
    allowed = _METADATA_TARGETS[mapped]
    if type_name not in allowed:
        raise ValueError(
            f"column {f.name!r} is {type_name}; {mapped} feeds {', '.join(sorted(allowed))}"
        )
    return ColumnPlan(f.name, type_name, f.type, _METADATA_KINDS[mapped], (), required, pk)


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
