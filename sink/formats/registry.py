"""The Schema Registry client, and what its failures mean for a message.

confluent-kafka's own `SchemaRegistryClient` does the HTTP, authentication, TLS, retries
and the schema cache (a schema id never changes, so each id is fetched once per process).
`build_client` makes one from `SchemaRegistrySettings` (``mock://`` URLs give the client's
in-process registry, for tests); `OneRequestPerSchema` makes decode threads that miss the
cache for one schema at once wait for one request instead of each sending its own.
`classify` sorts the failures of a deserializer call:

- the message's fault (dead letter): no Confluent framing (``missing_magic_byte``), a
  schema id the registry does not know (HTTP 404: ``unknown_schema_id``), bytes that do not
  decode with their schema (``not_matching_schema``);
- not the message's fault: the registry cannot be reached or answers with an error that
  is not about the id (connection refused, timeout, TLS, 5xx, 401/403, 429):
  `RegistryUnavailable` is raised out of `Decoder.decode`; the consumer loop pauses the
  partition and decodes the same messages again later (nothing goes to the DLQ for it).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

from confluent_kafka.schema_registry import SchemaRegistryClient

# The HTTP library the client itself uses (httpx2, else httpx), so its errors are caught.
from confluent_kafka.schema_registry.common._httpx_compat import httpx
from confluent_kafka.schema_registry.error import OAuthTokenError, SchemaRegistryError
from confluent_kafka.serialization import SerializationError

from config.settings import SchemaRegistrySettings
from sink.formats import RegistryUnavailable
from sink.formats.records import Fault

__all__ = ["RegistryUnavailable", "build_client", "classify", "framing_fault"]

#: Magic bytes of the Confluent wire format: 0 = 4-byte schema id, 1 = 16-byte schema GUID.
_MAGIC: Final = (0, 1)
#: Shortest framed payload: the magic byte and a 4-byte schema id.
_HEADER_BYTES: Final = 5
#: The header of a value that names its schema by GUID (magic byte 1, then 16 bytes).
_GUID_HEADER_BYTES: Final = 17
_NOT_FOUND: Final = 404


#: In-process mock registries by URL: every client of one ``mock://`` URL in this process
#: is the same mock, so a test's serializers and the sink see the same schemas.
_MOCKS: dict[str, SchemaRegistryClient] = {}
_MOCKS_LOCK: Final = threading.Lock()


class OneRequestPerSchema(SchemaRegistryClient):
    """confluent-kafka's client, sending one request for concurrent misses of one schema.

    The client checks its cache, then asks the registry, without a lock: the decode
    threads that took the first batches of a new schema id each asked for it (two
    ``GET /schemas/ids/1`` for a topic's first batches). Here a lock per schema (id or GUID,
    with the call's arguments) is held around the client's lookup: the first caller asks,
    the others wait and find the answer in the cache. A failed request leaves the cache
    empty, so each waiter then asks in turn, as each would have without the lock."""

    def __init__(self, conf: dict[str, Any]) -> None:
        super().__init__(conf)
        self._schema_locks: dict[tuple[Any, ...], threading.Lock] = {}
        self._schema_locks_lock = threading.Lock()

    def _lock_for(self, key: tuple[Any, ...]) -> threading.Lock:
        with self._schema_locks_lock:
            return self._schema_locks.setdefault(key, threading.Lock())

    def get_schema(
        self,
        schema_id: int,
        subject_name: str | None = None,
        fmt: str | None = None,
        reference_format: str | None = None,
    ) -> Any:
        with self._lock_for(("id", schema_id, subject_name, fmt, reference_format)):
            return super().get_schema(schema_id, subject_name, fmt, reference_format)

    def get_schema_by_guid(self, guid: str, fmt: str | None = None) -> Any:
        with self._lock_for(("guid", guid, fmt)):
            return super().get_schema_by_guid(guid, fmt)


def build_client(settings: SchemaRegistrySettings) -> SchemaRegistryClient:
    """confluent-kafka's registry client for `settings` (`OneRequestPerSchema`).

    A ``mock://`` URL gives the client's in-process mock registry, one per URL and process.
    """
    conf = settings.client_conf()
    if not settings.url.startswith("mock://"):
        return OneRequestPerSchema(conf)
    with _MOCKS_LOCK:
        if settings.url not in _MOCKS:
            _MOCKS[settings.url] = SchemaRegistryClient.new_client(conf)
        return _MOCKS[settings.url]


def framing_fault(payload: bytes) -> Fault | None:
    """Why `payload` cannot be in the Confluent wire format, or None if it may be."""
    if len(payload) <= _HEADER_BYTES or payload[0] not in _MAGIC:
        head = payload[:_HEADER_BYTES].hex(" ") or "empty"
        return (
            "missing_magic_byte",
            (
                f"value is not in the Confluent wire format (magic byte 0 and a 4-byte "
                f"schema id, then the data); it is {len(payload)} bytes starting {head}"
            ),
        )
    return None


def schema_id(payload: bytes) -> str:
    """The schema id (or GUID) a framed payload names, for details."""
    if payload[0] == 0:
        return str(int.from_bytes(payload[1:_HEADER_BYTES], "big"))
    return payload[1:_GUID_HEADER_BYTES].hex()


def decode_framed(
    payloads: Sequence[bytes],
    decode: Callable[[bytes], Any],
    what: str,
    fault_of: Callable[[Exception], Fault | None] = lambda _exc: None,
) -> tuple[list[int], list[Any], dict[int, Fault]]:
    """Decode each framed payload with `decode` (a registry format's deserializer call).

    A payload without the framing is not passed to `decode`; an exception `decode` raises is
    a fault by `fault_of` (the format's own reading of it) or else by `classify`; a schema id
    the registry said it does not know is asked about once per call.

    Returns:
        The positions of the payloads that decoded, their records, and the fault of every
        other payload by position.

    Raises:
        RegistryUnavailable: the registry could not be asked for a schema.
    """
    positions: list[int] = []
    records: list[Any] = []
    faults: dict[int, Fault] = {}
    unknown: dict[bytes, Fault] = {}  # schema ids the registry said it does not know
    for pos, payload in enumerate(payloads):
        fault = framing_fault(payload) or unknown.get(_schema_ref(payload))
        if fault is None:
            try:
                record = decode(payload)
            except Exception as exc:  # noqa: BLE001 - every failure is sorted below
                fault = fault_of(exc) or classify(exc, payload, what)
                if fault[0] == "unknown_schema_id":
                    unknown[_schema_ref(payload)] = fault
            else:
                positions.append(pos)
                records.append(record)
                continue
        faults[pos] = fault
    return positions, records, faults


def _schema_ref(payload: bytes) -> bytes:
    """The bytes of a framed payload that name its schema: the id, or the whole GUID (two
    GUIDs may share their first bytes: keyed by those, one message's unknown GUID was
    another's fault, its detail naming the other GUID)."""
    return payload[: _HEADER_BYTES if payload[:1] == b"\x00" else _GUID_HEADER_BYTES]


def writer_schema_text(client: SchemaRegistryClient, payload: bytes) -> str | None:
    """The text of the writer schema a framed payload names by id (fetched once per id by
    the client); None for a payload that names its schema by GUID (not checked)."""
    if payload[0] != 0:
        return None
    return client.get_schema(int.from_bytes(payload[1:_HEADER_BYTES], "big")).schema_str


def classify(exc: Exception, payload: bytes, what: str) -> Fault:
    """What a deserializer's exception means for one framed payload.

    Args:
        exc: raised by the deserializer (or the schema parser) for `payload`.
        payload: the message value.
        what: the format's name for details ("Avro", "Protobuf", "JSON").

    Returns:
        The dead-letter fault.

    Raises:
        RegistryUnavailable: the registry could not answer (from `exc`).
    """
    if isinstance(exc, SchemaRegistryError):
        if exc.http_status_code == _NOT_FOUND:
            return (
                "unknown_schema_id",
                f"schema id {schema_id(payload)} is unknown to the registry ({exc.error_message})",
            )
        raise RegistryUnavailable(
            f"schema registry answered {exc.http_status_code}: {exc.error_message}"
        ) from exc
    if isinstance(exc, httpx.HTTPError | OAuthTokenError):
        raise RegistryUnavailable(
            f"schema registry unreachable: {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(exc, SerializationError) and "magic byte" in str(exc).lower():
        return ("missing_magic_byte", f"value has no Confluent wire-format header: {exc}")
    head = f"value does not decode as {what} with schema id {schema_id(payload)}"
    if isinstance(exc, EOFError):  # the reader wanted more bytes than the payload has
        said = _short(exc, empty="")
        return (
            "not_matching_schema",
            f"{head}: the data ends early" + (f" ({said})" if said else ""),
        )
    return ("not_matching_schema", f"{head}: {type(exc).__name__}: {_short(exc)}")


#: An object's default repr (``<_io.BytesIO object at 0x7fd2aec82ac0>``) and the word
#: before it: fastavro names the stream it reads from. Differs per message and run, and
#: says nothing about the data.
_OBJECT_REPR_RE: Final = re.compile(r"(?: (?:from|in|of))? <[^<>]* at 0x[0-9a-fA-F]+>")


def _short(exc: Exception, empty: str | None = None) -> str:
    """`exc`'s text for a detail: without object addresses, at most 200 characters; when it
    says nothing, `empty` (default: its repr)."""
    text = _OBJECT_REPR_RE.sub("", str(exc)).strip()
    if not text:
        text = repr(exc) if empty is None else empty
    return text if len(text) <= 200 else text[:197] + "..."


def latest_schema(client: SchemaRegistryClient, subject: str, *, serialized: bool = False) -> Any:
    """The latest registered version of `subject` (`RegisteredSchema`); `serialized` asks
    for a Protobuf schema as a serialized descriptor, as the deserializers do.

    Raises:
        RegistryUnavailable: the registry could not answer.
        LookupError: the subject does not exist.
    """
    try:
        return client.get_latest_version(subject, fmt="serialized" if serialized else None)
    except SchemaRegistryError as exc:
        if exc.http_status_code == _NOT_FOUND:
            raise LookupError(f"subject {subject!r} is not in the schema registry") from exc
        raise RegistryUnavailable(
            f"schema registry answered {exc.http_status_code}: {exc.error_message}"
        ) from exc
    except (httpx.HTTPError, OAuthTokenError) as exc:
        raise RegistryUnavailable(
            f"schema registry unreachable: {type(exc).__name__}: {exc}"
        ) from exc
