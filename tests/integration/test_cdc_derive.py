"""The columns of json change events derived from the schema blocks of a topic's newest
events (`sink.formats.derive.peek_schema_blocks`), read from a real broker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from config.settings import Settings
from sink.formats.derive import derive_settings
from tests.support import debezium as dbz
from tests.support.brokers import Broker
from tests.support.kafka import produce

pytestmark = [pytest.mark.broker, pytest.mark.timeout(60)]


def settings(broker: Broker, topic: str, group: str, tmp_path: Path) -> Settings:
    return Settings.model_validate(
        {
            "kafka": {"bootstrap_servers": broker.bootstrap, "topics": [topic], "group_id": group},
            "source": {
                "envelope": "debezium",
                "columns": {"vec": "$.after.embedding", "changed_at": "$.source.ts_ms"},
            },
            "table": {
                "uri": str(tmp_path / "products.lance"),
                "mode": "upsert",
                "primary_key": ["id"],
                "vector": {"column": "vec", "dim": 4},
            },
        }
    )


def test_a_new_tables_columns_come_from_the_topics_schema_blocks(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    events, _ = dbz.history(60, 20, 4, seed=3)
    # The newest events of a partition may be tombstones or a truncate: no block there.
    source = dbz.pg_source(1, 1)
    events.append((dbz.key(1), None))
    events.append((None, dbz.value(dbz.envelope("t", None, None, source), dbz.envelope_schema())))
    produce(kafka_broker.bootstrap, topic, events)
    derived = derive_settings(settings(kafka_broker, topic, group, tmp_path))
    got: dict[str, Any] = {c.name: c.type for c in derived.table.columns}
    assert got == {
        "id": "int32",
        "name": "string",
        "price": "float64",
        "added": "timestamp",
        "updated": "timestamp",
        "attrs": "string",
        "changed_at": "int64",
    }
    assert derived.source.columns["price"] == "$.after.price"
    assert derived.source.columns["changed_at"] == "$.source.ts_ms"


def test_without_schema_blocks_the_columns_must_be_declared(
    kafka_broker: Broker, topic: str, group: str, tmp_path: Path
) -> None:
    with pytest.raises(LookupError, match="no change event with a schema block"):
        derive_settings(settings(kafka_broker, topic, group, tmp_path))  # no such topic yet
    events, _ = dbz.history(10, 5, 4, schemas=False)  # schemas.enable = false
    produce(kafka_broker.bootstrap, topic, events)
    with pytest.raises(LookupError, match=r"schemas\.enable must be on"):
        derive_settings(settings(kafka_broker, topic, group, tmp_path))
