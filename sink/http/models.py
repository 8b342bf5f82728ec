"""The JSON bodies of the query API: `SearchRequest`, `LookupRequest` and `QueryResponse`.

Pydantic validates a request before any query runs: unknown fields, wrong types, `nprobes`
and `refine_factor` out of range and text that is not valid Unicode are 400s (answered by
`sink.http.errors`). What needs the table (k against `query.max_k`, the vector's dimension,
column names, the filter) is checked later, by `sink.http.app` and the reader. The models
also describe the bodies in ``/openapi.json``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, field_validator

#: Most IVF partitions a request may probe: an IVF index has about sqrt(rows) partitions,
#: so 65 536 covers 4 billion rows; Lance overflows on larger values.
MAX_NPROBES = 65_536
#: Largest re-rank factor a request may ask: Lance re-ranks k * refine_factor candidates
#: exactly, so with `query.max_k` 1 000 this is at most 100 000 rows read (the default is 10).
MAX_REFINE_FACTOR = 100


def _valid_unicode(value: Any) -> Any:
    """Refuse strings (also inside lists) that hold lone surrogates: JSON can carry them
    (``"\\ud800"``) but they are not text, and Lance's tokenizer cannot encode them."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, list):
            _valid_unicode(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = item[exc.start : exc.end].encode("unicode_escape").decode()
                raise ValueError(
                    f"not valid Unicode: lone surrogate {bad} at character {exc.start}"
                ) from exc
    return value


class SearchRequest(BaseModel):
    """Body of `POST /v1/search`: at least one of vector, text, filter."""

    model_config = ConfigDict(extra="forbid")

    _unicode = field_validator("text", "text_column", "filter", "columns")(_valid_unicode)

    vector: list[StrictFloat] | None = Field(
        default=None, description="Query vector (kNN): JSON numbers."
    )
    text: str | None = Field(default=None, description="Full-text query (BM25).")
    text_column: str | None = Field(
        default=None,
        min_length=1,
        description="FTS column to search (default: the first fts_column).",
    )
    phrase: bool = Field(default=False, strict=True, description="Match the text as a phrase.")
    filter: str | None = Field(default=None, description="SQL-like pre-filter.")
    k: int = Field(default=10, strict=True, description="Rows to return (1..query.max_k).")
    columns: list[str] | None = Field(
        default=None, min_length=1, description="Columns (default: all)."
    )
    nprobes: int | None = Field(
        default=None,
        ge=1,
        le=MAX_NPROBES,
        strict=True,
        description="IVF partitions to probe at least (more while a filter leaves fewer than "
        "k rows in them).",
    )
    refine_factor: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REFINE_FACTOR,
        strict=True,
        description="Exact re-rank factor.",
    )
    allow_partial: bool = Field(
        default=True,
        strict=True,
        description="When another pod's fresh rows do not arrive in time: answer without "
        "them, saying so (partial, missing), or fail with 503 (false).",
    )


class LookupRequest(BaseModel):
    """Body of `POST /v1/lookup`: primary-key values (lists for a composite key)."""

    model_config = ConfigDict(extra="forbid")

    _unicode = field_validator("keys", "columns")(_valid_unicode)

    keys: list[Any] = Field(description="Key values; one list per key for composite keys.")
    columns: list[str] | None = Field(
        default=None, min_length=1, description="Columns (default: all)."
    )
    allow_partial: bool = Field(
        default=True,
        strict=True,
        description="When another pod's fresh rows do not arrive in time: answer without "
        "them, saying so (partial, missing), or fail with 503 (false).",
    )


class QueryResponse(BaseModel):
    """A JSON query result."""

    rows: list[dict[str, Any]]
    count: int
    took_ms: float
    partial: bool = Field(
        default=False, description="Present and true when other pods' fresh rows are missing."
    )
    missing: list[dict[str, Any]] = Field(
        default_factory=list, description="The shards whose fresh rows are missing, and why."
    )
