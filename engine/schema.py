"""The table's shape: Arrow schemas, primary key, vector column, and batch validation.

Two schemas matter:

- `table_schema`: what the Lance base table stores (scalar columns, the vector column as
  `FixedSizeList<float32>[dim]`, and the source columns `_topic`, `_partition`, `_offset`).
- `batch_schema`: what `ShardWriter.put` takes and what WAL entries and memtables hold. For
  upsert tables it adds `_op` (0 = upsert, 1 = delete) and relaxes non-key columns to
  nullable so a delete is a row carrying only its key; ordering of upserts and deletes is
  then simply row order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from config.settings import TableSettings
from engine.errors import InvalidRecord, SchemaMismatch

OP_COLUMN = "_op"
OP_UPSERT = 0
OP_DELETE = 1
SOURCE_COLUMNS = ("_topic", "_partition", "_offset")

_ARROW_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "binary": pa.binary(),
    "timestamp": pa.timestamp("ms", tz="UTC"),
}


def arrow_type(name: str) -> pa.DataType:
    """The Arrow type of a configured column type name."""
    return _ARROW_TYPES[name]


@dataclass(frozen=True, slots=True)
class VectorColumn:
    """The vector column and how it is compared."""

    name: str
    dim: int
    metric: Literal["l2", "cosine", "dot"]
    allow_nan: bool = False
    encoding: Literal["json", "base64_f32"] = "json"  # how JSON values carry it


#: Type changes `table.evolve` applies to an existing column (Lance casts them in place).
WIDENINGS: frozenset[tuple[str, str]] = frozenset(
    {(str(pa.int32()), str(pa.int64())), (str(pa.float32()), str(pa.float64()))}
)


@dataclass(frozen=True, slots=True)
class Evolution:
    """What `table.evolve` changes in an existing table: columns to add (all-null, metadata
    only) and columns to widen (`WIDENINGS`)."""

    add: tuple[pa.Field, ...] = ()
    widen: tuple[pa.Field, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.add or self.widen)


@dataclass(frozen=True)
class TableSpec:
    """Everything the engine needs to know about the table's shape.

    Build it with `TableSpec.from_settings`; tests may build one directly.
    """

    uri: str
    mode: Literal["append", "upsert"]
    table_schema: pa.Schema
    primary_key: tuple[str, ...]
    vector: VectorColumn | None = None
    fts_columns: tuple[str, ...] = ()
    storage_options: dict[str, str] = field(default_factory=dict)
    evolve: bool = False

    @classmethod
    def from_settings(cls, table: TableSettings) -> TableSpec:
        fields = [pa.field(c.name, arrow_type(c.type), nullable=c.nullable) for c in table.columns]
        vector = None
        if table.vector is not None:
            v = table.vector
            vector = VectorColumn(v.column, v.dim, v.metric, v.allow_nan, v.encoding)
            fields.append(
                pa.field(v.column, pa.list_(pa.field("item", pa.float32()), v.dim), nullable=False)
            )
        if table.source_columns:
            fields += [
                pa.field("_topic", pa.string(), nullable=False),
                pa.field("_partition", pa.int32(), nullable=False),
                pa.field("_offset", pa.int64(), nullable=False),
            ]
        key = tuple(table.primary_key) if table.primary_key else SOURCE_COLUMNS
        return cls(
            uri=table.uri,
            mode=table.mode,
            table_schema=pa.schema(fields),
            primary_key=key,
            vector=vector,
            fts_columns=tuple(table.fts_columns),
            storage_options={k: v.get_secret_value() for k, v in table.storage_options.items()},
            evolve=table.evolve,
        )

    @property
    def upsert(self) -> bool:
        return self.mode == "upsert"

    @property
    def row_identity(self) -> tuple[str, ...]:
        """Columns whose values tell a visible row from every other: the primary key of an
        upsert table (one live row per key); an append table's source coordinates, where
        rows may share a key; an append table stored without them, every column."""
        if self.upsert:
            return self.primary_key
        if all(name in self.table_schema.names for name in SOURCE_COLUMNS):
            return SOURCE_COLUMNS
        return tuple(self.table_schema.names)

    @property
    def batch_schema(self) -> pa.Schema:
        """The schema of batches given to `put`, WAL entries and memtables."""
        if not self.upsert:
            return self.table_schema
        fields = [
            f if f.name in self.primary_key else f.with_nullable(True) for f in self.table_schema
        ]
        return pa.schema([*fields, pa.field(OP_COLUMN, pa.int8(), nullable=False)])

    def evolution(self, existing: pa.Schema) -> Evolution:
        """What `table.evolve` would change in an existing table to hold our rows.

        Raises:
            SchemaMismatch: naming the field that no evolution can reconcile: a type change
                other than a widening, or a new column that is not nullable.
        """
        add: list[pa.Field] = []
        widen: list[pa.Field] = []
        for f in self.table_schema:
            idx = existing.get_field_index(f.name)
            if idx < 0:
                if not f.nullable:
                    raise SchemaMismatch(
                        f"column {f.name!r} is not in the table and not nullable: existing "
                        "rows have no value for it; declare it nullable to add it",
                        table=self.uri,
                    )
                add.append(f)
                continue
            have = existing.field(idx).type
            if have.equals(f.type):
                continue
            if (str(have), str(f.type)) in WIDENINGS:
                widen.append(f)
                continue
            raise SchemaMismatch(
                f"column {f.name!r} is {have} in the table, {f.type} in the settings; "
                "only int32 -> int64 and float32 -> float64 can be evolved",
                table=self.uri,
            )
        return Evolution(tuple(add), tuple(widen))

    def written_as(self, existing: pa.Schema) -> pa.Schema:
        """The schema our rows are committed in to a table of schema `existing`:
        `table_schema`, each column the table widened (another pod evolved it first) in the
        table's wider type. Lance refuses rows narrower than the table ("Append with
        different schema"); the cast loses nothing."""
        fields = []
        for f in self.table_schema:
            idx = existing.get_field_index(f.name)
            have = existing.field(idx).type if idx >= 0 else f.type
            widened = not have.equals(f.type) and (str(f.type), str(have)) in WIDENINGS
            fields.append(f.with_type(have) if widened else f)
        return pa.schema(fields)

    def check_table(self, existing: pa.Schema) -> None:
        """Check that an existing Lance table can hold our rows.

        Raises:
            SchemaMismatch: naming the first missing or differently-typed column.
        """
        for f in self.table_schema:
            idx = existing.get_field_index(f.name)
            if idx < 0:
                raise SchemaMismatch(
                    f"table has no column {f.name!r} (set table.evolve = true to add it "
                    "as a nullable column)",
                    table=self.uri,
                )
            if not existing.field(idx).type.equals(f.type):
                hint = (
                    " (set table.evolve = true to widen it)"
                    if (str(existing.field(idx).type), str(f.type)) in WIDENINGS
                    else ""
                )
                raise SchemaMismatch(
                    f"column {f.name!r} is {existing.field(idx).type} in the table, "
                    f"{f.type} in the settings{hint}",
                    table=self.uri,
                )
        extra = [n for n in existing.names if self.table_schema.get_field_index(n) < 0]
        non_null_extra = [n for n in extra if not existing.field(n).nullable]
        if non_null_extra:
            raise SchemaMismatch(
                f"table has non-nullable columns the settings do not know: {non_null_extra}",
                table=self.uri,
            )

    def validate(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Check a batch for `put`: schema, non-null columns, key, vector dimension and NaN.

        Returns the batch, with its schema replaced by `batch_schema` when only field
        nullability flags differ.

        Raises:
            InvalidRecord: naming the column and (where one row is at fault) the row.
        """
        expected = self.batch_schema
        if batch.schema.names != expected.names:
            missing = [n for n in expected.names if n not in batch.schema.names]
            unknown = [n for n in batch.schema.names if n not in expected.names]
            column = (missing or unknown or [None])[0]
            raise InvalidRecord(
                f"batch columns {batch.schema.names} do not match {expected.names}",
                column=column,
            )
        for got, want in zip(batch.schema, expected, strict=True):
            if not got.type.equals(want.type):
                raise InvalidRecord(
                    f"column {want.name!r} has type {got.type}, expected {want.type}",
                    column=want.name,
                )
        if not batch.schema.equals(expected):
            batch = pa.RecordBatch.from_arrays(batch.columns, schema=expected)
        live = self._live_rows(batch)
        for f in self.table_schema:
            required = not f.nullable or f.name in self.primary_key
            column = batch.column(f.name)
            if required and column.null_count:
                nulls = column.is_null()
                if live is not None:
                    nulls = pc.and_(nulls, live)
                row = _first_true(nulls)
                if row is not None:
                    what = "primary key" if f.name in self.primary_key else "non-nullable"
                    raise InvalidRecord(f"null in {what} column {f.name!r}", column=f.name, row=row)
        if self.vector is not None and not self.vector.allow_nan:
            self._check_nan(batch)
        batch = self._positive_nan(batch)
        if self.upsert:
            ops = batch.column(OP_COLUMN)
            bad = pc.invert(pc.is_in(ops, pa.array([OP_UPSERT, OP_DELETE], pa.int8())))
            row = _first_true(bad)
            if row is not None:
                raise InvalidRecord(
                    "_op must be 0 (upsert) or 1 (delete)", column=OP_COLUMN, row=row
                )
        return batch

    def _positive_nan(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The batch with every NaN of its float columns (the vector's aside) stored as the
        positive quiet NaN. Filters order NaN above every number, as Lance orders the
        positive NaN; Lance orders a NaN whose sign bit is set (Avro, Protobuf and the
        like carry any bits) below every number, so `f < 0.0` kept it from the base and
        dropped it from memtables. A float column without NaN is left as it is."""
        columns: list[pa.Array] | None = None
        vector = None if self.vector is None else self.vector.name
        for i, f in enumerate(batch.schema):
            if not pa.types.is_floating(f.type) or f.name == vector:
                continue
            column = batch.column(i)
            nan = pc.is_nan(column)
            if not pc.any(nan).as_py():
                continue
            columns = columns if columns is not None else list(batch.columns)
            columns[i] = pc.if_else(nan, pa.scalar(math.nan, f.type), column)
        if columns is None:
            return batch
        return pa.RecordBatch.from_arrays(columns, schema=batch.schema)

    def _live_rows(self, batch: pa.RecordBatch) -> pa.Array | None:
        """For upsert tables, the mask of upsert rows (deletes carry only their key)."""
        if not self.upsert:
            return None
        return pc.equal(batch.column(OP_COLUMN), OP_UPSERT)

    def _check_nan(self, batch: pa.RecordBatch) -> None:
        assert self.vector is not None
        vectors = batch.column(self.vector.name)
        if vectors.null_count:
            vectors = vectors.fill_null(pa.scalar([0.0] * self.vector.dim, vectors.type))
        values = vector_matrix(vectors, self.vector.dim)
        if not values.size or not np.isnan(values.min()):
            return  # min propagates NaN: one pass, no temporary mask for the common case
        nan_rows = np.isnan(values).any(axis=1)
        if nan_rows.any():
            row = int(np.argmax(nan_rows))
            raise InvalidRecord(
                f"NaN in vector column {self.vector.name!r}", column=self.vector.name, row=row
            )

    def conform(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """A batch written under an earlier table schema (a replayed WAL entry) in
        `batch_schema`: columns added since read as null, widened columns are cast.

        Raises:
            InvalidRecord: the batch lacks a column that is not nullable, or has one of a
                type that no evolution explains.
        """
        expected = self.batch_schema
        if batch.schema.equals(expected):
            return batch
        arrays: list[pa.Array] = []
        for f in expected:
            idx = batch.schema.get_field_index(f.name)
            if idx < 0:
                if not f.nullable:
                    raise InvalidRecord(f"batch has no column {f.name!r}", column=f.name)
                arrays.append(pa.nulls(batch.num_rows, f.type))
                continue
            column = batch.column(idx)
            if not column.type.equals(f.type):
                if (str(column.type), str(f.type)) not in WIDENINGS:
                    raise InvalidRecord(
                        f"column {f.name!r} has type {column.type}, expected {f.type}",
                        column=f.name,
                    )
                column = column.cast(f.type)
            arrays.append(column)
        return pa.RecordBatch.from_arrays(arrays, schema=expected)

    def to_table_batch(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Drop `_op` and restore the table's nullability (rows must be upserts)."""
        if self.upsert:
            batch = batch.drop_columns([OP_COLUMN])
        return pa.RecordBatch.from_arrays(batch.columns, schema=self.table_schema)


def vector_matrix(vectors: pa.Array, dim: int) -> np.ndarray:
    """A zero-copy (rows, dim) float32 view of a FixedSizeList<float32> array."""
    if isinstance(vectors, pa.ChunkedArray):
        vectors = vectors.combine_chunks()
    flat = vectors.values.slice(vectors.offset * dim, len(vectors) * dim)
    matrix: np.ndarray = flat.to_numpy(zero_copy_only=False).reshape(len(vectors), dim)
    return matrix


def _first_true(mask: pa.Array) -> int | None:
    """Index of the first true value in a boolean array, or None."""
    idx = pc.index(mask, True).as_py()
    return None if idx is None or idx < 0 else int(idx)
