"""The syntax tree of a filter (`engine.filters`): one node per comparison, with its faces.

Each node evaluates itself three ways: `Node.evaluate` on a memtable `RecordBatch` with
`pyarrow.compute` kernels (SQL three-valued logic: a null is unknown), `Node.sql` as the SQL
filter string Lance plans for the base table, and `Node.expression` as a pyarrow Expression.
The parser (`engine.filters`) builds trees with `all_of` / `any_of` and the leaves'
`negate`, so every tree is normalised as it is built: n-ary, flattened AND/OR nodes, `NOT`
pushed down to the leaves, and equality chains on one column merged into IN lists.
`shape` measures a tree for the complexity limits.
"""

from __future__ import annotations

import datetime as dt
import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import pyarrow as pa
import pyarrow.compute as pc

#: A boolean pyarrow array (nulls = unknown). pyarrow ships no types, so this is `Any`.
Mask: TypeAlias = Any

_UNKNOWN = pa.scalar(None, pa.bool_())

#: `NOT (a op b)` is `a op' b` under three-valued logic (NULL stays unknown either way).
_NEGATED_OP = {"=": "!=", "!=": "=", "<": ">=", ">=": "<", ">": "<=", "<=": ">"}


class Node:
    """A node of the predicate tree: the faces of one predicate.

    Trees are in negation normal form (`NOT` is pushed down to the leaves by De Morgan's
    laws, which hold in three-valued logic) with n-ary, flattened AND/OR nodes, so a chain of
    N terms is one node of N children, never N nested nodes.
    """

    def expression(self) -> pc.Expression:
        """The node as a pyarrow Expression."""
        raise NotImplementedError

    def evaluate(self, batch: pa.RecordBatch) -> Mask:
        """The node's truth per row of `batch` (null where unknown)."""
        raise NotImplementedError

    def sql(self) -> str:
        """The node as a SQL filter string that Lance's parser reads back exactly."""
        raise NotImplementedError

    def negate(self) -> Node:
        """`NOT` of the node, pushed down to the leaves (still in negation normal form)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Compare(Node):
    """`column op value`, with `value` already of the column's type."""

    column: str
    op: str
    value: pa.Scalar

    _KERNELS = {  # noqa: RUF012 - a constant table, not per-instance state
        "=": pc.equal,
        "!=": pc.not_equal,
        "<": pc.less,
        "<=": pc.less_equal,
        ">": pc.greater,
        ">=": pc.greater_equal,
    }

    def expression(self) -> pc.Expression:
        field = pc.field(self.column)
        value = pc.scalar(self.value)
        ops: dict[str, Callable[[], pc.Expression]] = {
            "=": lambda: field == value,
            "!=": lambda: field != value,
            "<": lambda: field < value,
            "<=": lambda: field <= value,
            ">": lambda: field > value,
            ">=": lambda: field >= value,
        }
        if self.op in {">", ">="} and pa.types.is_floating(self.value.type):
            return ops[self.op]() | pc.is_nan(field)  # NaN is above every number
        return ops[self.op]()

    def evaluate(self, batch: pa.RecordBatch) -> Mask:
        column = batch.column(self.column)
        result = self._KERNELS[self.op](column, self.value)
        if self.op in {">", ">="} and pa.types.is_floating(column.type):
            # NaN is above every number (Lance's order): IEEE's `NaN > x` is false. The
            # other operators already agree: `=`, `<`, `<=` are false and `!=` true for NaN.
            nan = pc.is_nan(column)
            if pc.any(nan).as_py():
                result = pc.or_kleene(result, nan)
        return result

    def sql(self) -> str:
        return f"{_sql_ident(self.column)} {self.op} {_sql_literal(self.value)}"

    def negate(self) -> Node:
        return Compare(self.column, _NEGATED_OP[self.op], self.value)


@dataclass(frozen=True)
class In(Node):
    """`column [NOT] IN (values)`: a NULL value is neither in nor not in (unknown)."""

    column: str
    values: pa.Array
    negated: bool = False

    def expression(self) -> pc.Expression:
        # A NULL value is neither IN nor NOT IN: unknown, like SQL (`is_in` alone says false).
        field = pc.field(self.column)
        values = self.values
        if pa.types.is_floating(values.type):
            field, values = _signless(field, values.type), _signless(values, values.type)
        hit = pc.if_else(field.is_valid(), field.isin(values), _UNKNOWN)
        return ~hit if self.negated else hit

    def evaluate(self, batch: pa.RecordBatch) -> Mask:
        column = batch.column(self.column)
        values = self.values
        if pa.types.is_floating(values.type):
            # -0.0 = 0.0 (as `=` says): is_in hashes the bits, which differ.
            column, values = _signless(column, values.type), _signless(values, values.type)
        hit = pc.is_in(column, value_set=values)
        if column.null_count:
            hit = pc.if_else(pc.is_valid(column), hit, _UNKNOWN)
        return pc.invert(hit) if self.negated else hit

    def sql(self) -> str:
        values = ", ".join(_sql_literal(v) for v in self.values)
        return f"{_sql_ident(self.column)} {'NOT IN' if self.negated else 'IN'} ({values})"

    def negate(self) -> Node:
        return In(self.column, self.values, not self.negated)


@dataclass(frozen=True)
class IsNull(Node):
    """`column IS [NOT] NULL`."""

    column: str
    negated: bool = False

    def expression(self) -> pc.Expression:
        field = pc.field(self.column)
        return field.is_valid() if self.negated else field.is_null()

    def evaluate(self, batch: pa.RecordBatch) -> Mask:
        column = batch.column(self.column)
        return pc.is_valid(column) if self.negated else pc.is_null(column)

    def sql(self) -> str:
        return f"{_sql_ident(self.column)} IS {'NOT NULL' if self.negated else 'NULL'}"

    def negate(self) -> Node:
        return IsNull(self.column, not self.negated)


@dataclass(frozen=True)
class Like(Node):
    """`column [NOT] LIKE pattern`, for the patterns both tiers evaluate alike."""

    column: str
    kind: str  # prefix | suffix | contains | equal
    text: str
    negated: bool = False

    def expression(self) -> pc.Expression:
        field = pc.field(self.column)
        hit: pc.Expression
        if self.kind == "prefix":
            hit = pc.starts_with(field, self.text)
        elif self.kind == "suffix":
            hit = pc.ends_with(field, self.text)
        elif self.kind == "contains":
            hit = pc.match_substring(field, self.text)
        else:
            hit = field == pc.scalar(self.text)
        return ~hit if self.negated else hit

    def evaluate(self, batch: pa.RecordBatch) -> Mask:
        column = batch.column(self.column)
        if self.kind == "prefix":
            hit = pc.starts_with(column, self.text)
        elif self.kind == "suffix":
            hit = pc.ends_with(column, self.text)
        elif self.kind == "contains":
            hit = pc.match_substring(column, self.text)
        else:
            hit = pc.equal(column, pa.scalar(self.text, column.type))
        return pc.invert(hit) if self.negated else hit

    def sql(self) -> str:
        # The pattern's text holds no '%', '_' or '\' (the parser refuses them), so it is
        # matched literally by SQL's LIKE.
        pattern = {
            "prefix": f"{self.text}%",
            "suffix": f"%{self.text}",
            "contains": f"%{self.text}%",
            "equal": self.text,
        }[self.kind]
        like = "NOT LIKE" if self.negated else "LIKE"
        return f"{_sql_ident(self.column)} {like} {_sql_string(pattern)}"

    def negate(self) -> Node:
        return Like(self.column, self.kind, self.text, not self.negated)


@dataclass(frozen=True)
class BoolColumn(Node):
    """A bool column used as a predicate (`flag`, `NOT flag`)."""

    column: str
    negated: bool = False

    def expression(self) -> pc.Expression:
        field = pc.field(self.column)
        return ~field if self.negated else field

    def evaluate(self, batch: pa.RecordBatch) -> Mask:
        column = batch.column(self.column)
        return pc.invert(column) if self.negated else column

    def sql(self) -> str:
        return f"{'NOT ' if self.negated else ''}{_sql_ident(self.column)}"

    def negate(self) -> Node:
        return BoolColumn(self.column, not self.negated)


@dataclass(frozen=True)
class _And(Node):
    children: tuple[Node, ...]

    def expression(self) -> pc.Expression:
        return functools.reduce(operator.and_, (c.expression() for c in self.children))

    def evaluate(self, batch: pa.RecordBatch) -> Mask:
        return functools.reduce(pc.and_kleene, (c.evaluate(batch) for c in self.children))

    def sql(self) -> str:
        parts = (f"({c.sql()})" if isinstance(c, _Or) else c.sql() for c in self.children)
        return " AND ".join(parts)

    def negate(self) -> Node:
        return any_of([c.negate() for c in self.children])


@dataclass(frozen=True)
class _Or(Node):
    children: tuple[Node, ...]

    def expression(self) -> pc.Expression:
        return functools.reduce(operator.or_, (c.expression() for c in self.children))

    def evaluate(self, batch: pa.RecordBatch) -> Mask:
        return functools.reduce(pc.or_kleene, (c.evaluate(batch) for c in self.children))

    def sql(self) -> str:
        return " OR ".join(c.sql() for c in _exclusions_in_or(list(self.children)))

    def negate(self) -> Node:
        return all_of([c.negate() for c in self.children])


def all_of(children: list[Node]) -> Node:
    """AND of `children`: nested ANDs flattened into one node, and `col != v` / `col NOT IN
    (...)` terms on one column merged into one `NOT IN` list."""
    return _junction(children, _And, negated=True)


def any_of(children: list[Node]) -> Node:
    """OR of `children`: nested ORs flattened into one node, and `col = v` / `col IN (...)`
    terms on one column merged into one `IN` list (the value set is hashed once, so a chain
    of N equalities costs one pass over the rows, not N)."""
    return _junction(children, _Or, negated=False)


def _junction(children: list[Node], kind: type[_And | _Or], *, negated: bool) -> Node:
    flat: list[Node] = []
    for child in children:
        flat.extend(child.children if isinstance(child, kind) else [child])
    # `col = v` (OR) or `col != v` (AND) terms and IN lists of the same polarity, by column.
    merge_op = "!=" if negated else "="
    lists: dict[str, list[pa.Scalar]] = {}
    first: dict[str, int] = {}
    out: list[Node | None] = []
    for child in flat:
        column: str | None = None
        values: list[pa.Scalar] = []
        if isinstance(child, Compare) and child.op == merge_op:
            column, values = child.column, [child.value]
        elif isinstance(child, In) and child.negated == negated:
            column, values = child.column, list(child.values)
        if column is None:
            out.append(child)
            continue
        if column not in lists:
            lists[column] = []
            first[column] = len(out)
            out.append(None)  # filled below, where the column's first term was
        lists[column].extend(values)
    for column, values in lists.items():
        ctype = values[0].type
        distinct = list(dict.fromkeys(v.as_py() for v in values))
        node: Node
        if len(distinct) == 1:
            node = Compare(column, merge_op, pa.scalar(distinct[0], type=ctype))
        else:
            node = In(column, pa.array(distinct, type=ctype), negated)
        out[first[column]] = node
    nodes = [n for n in out if n is not None]
    return nodes[0] if len(nodes) == 1 else kind(tuple(nodes))


def _exclusions_in_or(nodes: list[Node]) -> list[Node]:
    """The children of an OR as Lance gets them (`_Or.sql`): `col NOT IN A OR col NOT IN
    B` (or `!=`) as one `col NOT IN (A ∩ B)`, and as `col IS NOT NULL` when A and B share
    no value. Lance (DataFusion's simplifier) took the disjoint form for TRUE, keeping NULL
    rows.

    The disjoint rewrite holds only where no NOT is above the OR: for a NULL value the OR
    is unknown and `IS NOT NULL` false, which select the same rows (Kleene's logic is
    regular: a formula true with an unknown part is true whatever that part is), but their
    negations do not (NOT unknown is unknown, NOT false is true). So it is made in the SQL
    face of a finished tree, whose NOTs are all pushed down to the leaves, never in the
    tree itself, which a parent's NOT may still negate while the filter is parsed: `NOT (c
    != 1 OR c != 2)` became `c IS NULL` and returned the NULL rows from every tier."""
    sets: dict[str, list[pa.Scalar]] = {}
    first: dict[str, int] = {}
    out: list[Node | None] = []
    for node in nodes:
        column: str | None = None
        if isinstance(node, Compare) and node.op == "!=":
            column, values = node.column, [node.value]
        elif isinstance(node, In) and node.negated:
            column, values = node.column, list(node.values)
        if column is None:
            out.append(node)
            continue
        if column not in sets:
            sets[column], first[column] = values, len(out)
            out.append(None)
        else:
            kept = {v.as_py() for v in values}
            sets[column] = [v for v in sets[column] if v.as_py() in kept]
    for column, values in sets.items():
        merged: Node
        if not values:
            merged = IsNull(column, negated=True)
        elif len(values) == 1:
            merged = Compare(column, "!=", values[0])
        else:
            merged = In(column, pa.array([v.as_py() for v in values], type=values[0].type), True)
        out[first[column]] = merged
    return [n for n in out if n is not None]


def _signless(values: Any, ftype: pa.DataType) -> Any:
    """Floats of type `ftype` (an array or an Expression) with -0.0 made 0.0: `x + 0.0`
    (IEEE: -0.0 + 0.0 = 0.0; NaN stays NaN, null stays null)."""
    return pc.add(values, pa.scalar(0.0, ftype))


def shape(node: Node) -> tuple[int, int]:
    """(comparisons, AND/OR nesting depth) of a tree."""
    if isinstance(node, _And | _Or):
        shapes = [shape(c) for c in node.children]
        return sum(s[0] for s in shapes), 1 + max(s[1] for s in shapes)
    return 1, 0


def sql_integer(value: int) -> str:
    """An integer as SQL text Lance's parser (DataFusion) reads back as that int64: -2**63
    written out would be read as the negation of 2**63, which is not an int64, and fail."""
    return "(-9223372036854775807 - 1)" if value == -(2**63) else str(value)


def _sql_ident(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _sql_literal(value: pa.Scalar) -> str:
    """A typed literal as Lance's SQL filter parser (DataFusion) reads it back exactly."""
    t = value.type
    v = value.as_py()
    if pa.types.is_boolean(t):
        return "TRUE" if v else "FALSE"
    if pa.types.is_integer(t):
        return sql_integer(int(v))
    if pa.types.is_floating(t):
        return repr(float(v))
    if pa.types.is_timestamp(t):
        stamp: dt.datetime = v
        if stamp.tzinfo is not None:
            stamp = stamp.astimezone(dt.UTC)
        return f"TIMESTAMP '{stamp.isoformat(timespec='microseconds')}'"
    return _sql_string(str(v))
