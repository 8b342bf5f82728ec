"""`schema_field_skipped`: a schema field that gets no derived column says why
(`sink.formats.derive`)."""

from __future__ import annotations

import json
from pathlib import Path

import structlog

from sink.formats.derive import derive_settings
from tests.unit.test_formats_derive import registered, settings


def test_a_skipped_field_says_why(tmp_path: Path) -> None:
    """Arrays and maps logged only '"type": null', and a field named '_offset' only its
    type, as if it had been dropped for no reason: each now carries a reason."""
    schema = {
        "type": "record",
        "name": "Order",
        "fields": [
            {"name": "id", "type": "string"},
            {"name": "_offset", "type": "string"},
            {"name": "tags", "type": {"type": "array", "items": "string"}},
            {"name": "attrs", "type": {"type": "map", "values": "string"}},
            {"name": "vec", "type": {"type": "array", "items": "float"}},
        ],
    }
    reg = registered(json.dumps(schema), "AVRO")
    with structlog.testing.capture_logs() as logs:
        derive_settings(settings(tmp_path, {"format": "avro", "schema_registry": reg}))
    skipped = {e["field"]: e for e in logs if e["event"] == "schema_field_skipped"}
    assert set(skipped) == {"_offset", "tags", "attrs"}
    assert skipped["_offset"]["type"] == "string"
    assert skipped["_offset"]["reason"] == (
        "'_offset': names starting with '_' are reserved for the sink's own columns (_topic, "
        "_partition, _offset); map it to a column of another name in source.columns "
        '(NAME = "$._offset")'
    )
    for field in ("tags", "attrs"):
        assert skipped[field]["type"] is None
        assert skipped[field]["reason"].startswith(
            "its type has no column type (arrays, maps, unions of several types, times of day)"
        )
