"""The real confluent-kafka registry client over HTTP, against `tests.support.registry`:
schemas fetched once per id (the client's cache), authentication, a 404 for an unknown id
(a dead letter), and an unreachable or failing registry (`RegistryUnavailable`: not the
message's fault, nothing is dead-lettered)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from config.settings import SourceSettings
from sink.decode import Decoder
from sink.formats import RegistryUnavailable
from tests.support.registry import FakeRegistry
from tests.unit.test_decode import Msg, spec_for

TOPIC = "orders"
SCHEMA = json.dumps(
    {
        "type": "record",
        "name": "Order",
        "fields": [
            {"name": "id", "type": "string"},
            {"name": "n", "type": ["null", "long"], "default": None},
            {"name": "vec", "type": {"type": "array", "items": "float"}},
        ],
    }
)


@pytest.fixture
def registry() -> Iterator[FakeRegistry]:
    reg = FakeRegistry().start()
    yield reg
    reg.stop()


def produce_values(conf: dict[str, Any], n: int, first: int = 0) -> list[bytes]:
    ser = AvroSerializer(SchemaRegistryClient(conf), SCHEMA)
    ctx = SerializationContext(TOPIC, MessageField.VALUE)
    return [ser({"id": f"id-{i}", "n": i, "vec": [0.5] * 4}, ctx) for i in range(first, first + n)]


def messages(values: list[bytes], first: int = 0) -> list[Msg]:
    return [Msg(v, first + i) for i, v in enumerate(values)]


def decoder(registry: FakeRegistry, **extra: Any) -> Decoder:
    reg = {"url": registry.url, "max_retries": 0, **extra}
    return Decoder(spec_for(), SourceSettings(format="avro", schema_registry=reg))


def test_schemas_are_fetched_once_per_id(registry: FakeRegistry) -> None:
    values = produce_values({"url": registry.url}, 200)
    assert registry.requests["POST /subjects/orders-value/versions"] == 1
    dec = decoder(registry)
    for lo in (0, 100):
        out = dec.decode(messages(values[lo : lo + 100], lo))
        assert not out.dead_letters
        assert out.batch is not None
        assert out.batch.column("id").to_pylist() == [f"id-{i}" for i in range(lo, lo + 100)]
    assert registry.requests["GET /schemas/ids/1"] == 1


def test_decode_threads_missing_one_schema_at_once_make_one_request(
    registry: FakeRegistry,
) -> None:
    """The sink's decode threads take a new schema id's first batches at the same time:
    each used to miss the client's cache and ask the registry (a test saw two requests).
    With a slow registry both are sure to miss at once."""
    values = produce_values({"url": registry.url}, 400)
    dec = decoder(registry)
    registry.delay_s = 0.3
    start = threading.Barrier(4)

    def decode(lo: int) -> list[str]:
        start.wait()
        out = dec.decode(messages(values[lo : lo + 100], lo))
        assert not out.dead_letters
        assert out.batch is not None
        return cast("list[str]", out.batch.column("id").to_pylist())

    with ThreadPoolExecutor(4) as pool:
        ids = list(pool.map(decode, range(0, 400, 100)))
    assert ids == [[f"id-{i}" for i in range(lo, lo + 100)] for lo in range(0, 400, 100)]
    assert registry.requests["GET /schemas/ids/1"] == 1


def test_a_failed_request_is_made_again_by_each_waiting_thread(registry: FakeRegistry) -> None:
    """The lock does not share failures: a thread that waited for a request that failed
    asks itself (and fails the same way, here), as it would have without the lock."""
    values = produce_values({"url": registry.url}, 200)
    dec = decoder(registry)
    registry.fail_with = 503
    registry.delay_s = 0.2
    start = threading.Barrier(2)

    def decode(lo: int) -> str:
        start.wait()
        with pytest.raises(RegistryUnavailable) as info:
            dec.decode(messages(values[lo : lo + 100], lo))
        return str(info.value)

    with ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(decode, (0, 100)))
    assert all("503" in e for e in errors), errors
    assert registry.requests["GET /schemas/ids/1"] == 2
    registry.fail_with, registry.delay_s = None, 0.0
    assert dec.decode(messages(values[:100])).batch is not None


def test_unknown_schema_id_is_a_dead_letter(registry: FakeRegistry) -> None:
    good = produce_values({"url": registry.url}, 1)[0]
    unknown = b"\x00\x00\x00\x00\x07" + good[5:]
    out = decoder(registry).decode(messages([good, unknown, unknown, good]))
    assert out.batch is not None
    assert out.batch.num_rows == 2
    assert [(d.offset, d.reason) for d in out.dead_letters] == [
        (1, "unknown_schema_id"),
        (2, "unknown_schema_id"),
    ]
    assert "schema id 7 is unknown to the registry (Schema not found)" in out.dead_letters[0].detail
    assert registry.requests["GET /schemas/ids/7"] == 1  # asked once per batch


def test_basic_auth(registry: FakeRegistry) -> None:
    registry.basic_auth = ("sink", "s3cret")
    conf = {"url": registry.url, "basic.auth.user.info": "sink:s3cret"}
    values = produce_values(conf, 3)
    dec = decoder(registry, basic_auth_username="sink", basic_auth_password="s3cret")
    assert dec.decode(messages(values)).batch is not None
    wrong = decoder(registry, basic_auth_username="sink", basic_auth_password="nope")
    with pytest.raises(RegistryUnavailable, match="401"):
        wrong.decode(messages(values))


def test_bearer_token(registry: FakeRegistry) -> None:
    values = produce_values({"url": registry.url}, 2)
    registry.bearer = "tok"
    assert decoder(registry, bearer_token="tok").decode(messages(values)).batch is not None
    with pytest.raises(RegistryUnavailable, match="401"):
        decoder(registry, bearer_token="other").decode(messages(values))


def test_an_unreachable_registry_is_not_the_messages_fault(registry: FakeRegistry) -> None:
    values = produce_values({"url": registry.url}, 5)
    dec = decoder(registry)
    registry.stop()
    with pytest.raises(RegistryUnavailable, match="unreachable"):
        dec.decode(messages(values))
    registry.start()
    registry.fail_with = 503
    with pytest.raises(RegistryUnavailable, match="503"):
        dec.decode(messages(values))
    registry.fail_with = None
    out = dec.decode(messages(values))
    assert not out.dead_letters
    assert out.batch is not None
    assert out.batch.num_rows == 5
