"""The one typed, frozen settings tree of lance-sink.

Every tunable of the sink lives here, grouped by concern into sub-models. The loader
(`config.loader`) fills the tree from four sources with this precedence, lowest first:

    defaults  <  config file (TOML or YAML)  <  environment  <  CLI flags (``--set``)

Environment variables use the prefix ``LANCE_SINK__`` and ``__`` for nesting, e.g.
``LANCE_SINK__KAFKA__GROUP_ID`` or ``LANCE_SINK__TABLE__STORAGE_OPTIONS__AWS_SECRET_ACCESS_KEY``.

Secrets are `SecretStr`: they print as ``**********`` in every dump of the model.
"""

from __future__ import annotations

import importlib
import ipaddress
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlparse

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from google.protobuf.descriptor import Descriptor
    from google.protobuf.descriptor_pool import DescriptorPool

ENV_PREFIX = "LANCE_SINK__"
ENV_NESTED_DELIMITER = "__"

PositiveBytes = Annotated[ByteSize, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
Port = Annotated[int, Field(ge=0, le=65535)]


class KeyedError(ValueError):
    """A check across keys or sections: names the key it is about, relative to the model
    that raises it (a dotted key from the root for `Settings`, a key of its own section for a
    section's model validator), and the other keys involved (`also`, relative alike);
    `config.loader` reports it at `key` instead of at the model, with where each key's value
    came from."""

    def __init__(self, key: str, reason: str, also: tuple[str, ...] = ()) -> None:
        super().__init__(reason)
        self.key = key
        self.also = also


#: Table URI schemes the storage layer can open.
SUPPORTED_URI_SCHEMES = frozenset({"", "file", "s3"})

#: librdkafka properties the sink sets itself (from typed settings or because the
#: commit protocol depends on them). Pass-through must not override them.
SINK_OWNED_LIBRDKAFKA_KEYS: dict[str, str] = {
    "bootstrap.servers": "kafka.bootstrap_servers",
    "group.id": "kafka.group_id",
    "group.instance.id": "kafka.group_instance_id",
    "client.id": "kafka.client_id",
    "auto.offset.reset": "kafka.auto_offset_reset",
    "session.timeout.ms": "kafka.session_timeout_ms",
    "max.poll.interval.ms": "kafka.max_poll_interval_ms",
    "security.protocol": "kafka.security_protocol",
    "sasl.mechanism": "kafka.sasl_mechanism",
    "sasl.mechanisms": "kafka.sasl_mechanism",
    "sasl.username": "kafka.sasl_username",
    "sasl.password": "kafka.sasl_password",
    "ssl.ca.location": "kafka.ssl_ca_location",
    "ssl.certificate.location": "kafka.ssl_certificate_location",
    "ssl.key.location": "kafka.ssl_key_location",
    "ssl.key.password": "kafka.ssl_key_password",
    "statistics.interval.ms": "observability.kafka_statistics_interval_ms",
    "enable.auto.commit": "(owned by the sink: offsets are committed only once durable)",
    "enable.auto.offset.store": "(owned by the sink: offsets are stored only once durable)",
    "partition.assignment.strategy": "(owned by the sink: cooperative-sticky)",
    "enable.partition.eof": "(owned by the sink)",
    "isolation.level": "kafka.isolation_level",
}


#: librdkafka properties whose values are secrets, from librdkafka's own list (the
#: properties its CONFIGURATION.md and `rdkafka_conf.c` flag `_RK_SENSITIVE`: credentials,
#: private keys and their passphrases, the OAUTHBEARER configuration; not the path
#: `ssl.key.location`) plus the OIDC and JWT-assertion secrets it does not flag. Masked
#: wherever the configuration is printed.
LIBRDKAFKA_SECRET_KEYS = frozenset(
    {
        "sasl.username",
        "sasl.password",
        "sasl.oauthbearer.config",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.client.credentials.client.secret",
        "sasl.oauthbearer.assertion.private.key.passphrase",
        "sasl.oauthbearer.assertion.private.key.pem",
        "ssl.key.password",
        "ssl.key.pem",
        "ssl.keystore.password",
        "ssl.ca.pem",
    }
)

#: Names that hold a secret whatever librdkafka version adds them (a new `*.password`,
#: `*.secret`, passphrase, private key or token): masked too. Not `credentials` (the OIDC
#: client id is `...client.credentials.client.id`) nor the token endpoint (a URL).
_SECRET_KEY_RE = re.compile(r"password|passphrase|secret|private\.key|key\.pem|(^|\.)token$")

#: What a masked value prints as (the same as pydantic's `SecretStr`).
MASK = "**********"


def is_secret_librdkafka_key(key: str) -> bool:
    """Whether the librdkafka property `key` holds a secret (see `LIBRDKAFKA_SECRET_KEYS`)."""
    key = key.strip().lower()
    return key in LIBRDKAFKA_SECRET_KEYS or _SECRET_KEY_RE.search(key) is not None


def mask_librdkafka_secrets(conf: Mapping[str, object]) -> dict[str, object]:
    """A copy of librdkafka properties with the value of every secret-holding key masked,
    for printing (`config.loader.redacted`, logs); the clients get the original."""
    return {k: MASK if is_secret_librdkafka_key(k) else v for k, v in conf.items()}


#: SASL mechanisms that authenticate with `sasl_username` and `sasl_password`
#: (OAUTHBEARER gets a token instead).
SASL_PASSWORD_MECHANISMS = frozenset({"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"})


#: librdkafka properties the dead-letter producer takes from the Kafka section or sets itself
#: (its delivery reports gate offset commits). `dlq.librdkafka` must not override them.
DLQ_OWNED_LIBRDKAFKA_KEYS: dict[str, str] = {
    **{
        key: owner
        for key, owner in SINK_OWNED_LIBRDKAFKA_KEYS.items()
        if owner.startswith("kafka.") and owner != "kafka.isolation_level"
    },
    "enable.idempotence": "(owned by the sink: dead letters are produced idempotently)",
    "acks": "(owned by the sink: a dead letter counts once every in-sync replica has it)",
    "message.timeout.ms": "dlq.produce_timeout_ms",
    "transactional.id": "(owned by the sink: the dead-letter producer is not transactional)",
}


#: A Kafka topic name: at most 249 of these characters, and neither "." nor ".." (Kafka's
#: `org.apache.kafka.common.internals.Topic.validate`; librdkafka leaves it to the broker).
_TOPIC_ILLEGAL_RE = re.compile(r"[^a-zA-Z0-9._-]")
TOPIC_MAX_CHARS = 249


def check_topic_name(name: str) -> str | None:
    """Why `name` is not a legal Kafka topic name, or None when it is."""
    if name in {"", ".", ".."}:
        return f"{name!r} is not a legal Kafka topic name"
    if len(name) > TOPIC_MAX_CHARS:
        return f"is {len(name)} characters long, more than Kafka's {TOPIC_MAX_CHARS}"
    illegal = sorted(set(_TOPIC_ILLEGAL_RE.findall(name)))
    if illegal:
        return "holds characters Kafka refuses in a topic name: " + " ".join(
            repr(c) for c in illegal
        )
    return None


class _Section(BaseModel):
    """Base for every sub-model: frozen, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def check_librdkafka_keys(
    conf: dict[str, str | int | float | bool],
    role: str,
    owned: dict[str, str] = SINK_OWNED_LIBRDKAFKA_KEYS,
) -> None:
    """Check pass-through keys against librdkafka itself.

    Builds (and immediately discards) a client of the given role with the properties, so
    unknown keys and invalid values are rejected by the same code that would use them. The
    keys are checked together, as the clients get them: some are valid only with a companion
    (``ssl.keystore.location`` needs ``ssl.keystore.password``), and each checked alone
    refused a right pair. When the set is refused, further probes find the key to name.

    Raises:
        ValueError: naming the offending key (all of them when none can be singled out)
            and librdkafka's reason.
    """
    for key in conf:
        if key in owned:
            owner = owned[key]
            hint = owner if owner.startswith("(") else f"(set {owner} instead)"
            raise ValueError(f"librdkafka property {key!r} cannot be passed through {hint}")
    ck = importlib.import_module("confluent_kafka")

    def refusal(probe: Mapping[str, object]) -> str | None:
        """librdkafka's reason for refusing a client with `probe`; None if it builds."""
        try:
            if role == "producer":
                ck.Producer(dict(probe))
            else:
                ck.Consumer({**probe, "group.id": "lance-sink-config-check"}).close()
        except ck.KafkaException as exc:
            reason = str(exc.args[0].str())
            for key, value in probe.items():
                if is_secret_librdkafka_key(key) and str(value):
                    reason = reason.replace(str(value), MASK)  # the reason may quote it
            return reason
        return None

    together = refusal(conf) if conf else None
    if together is None:
        return
    # The offender: the key without which the rest builds (a bad value, or a key missing its
    # companion), else the first key refused on its own (several bad keys), else the set.
    for key in conf:
        if refusal({k: v for k, v in conf.items() if k != key}) is None:
            raise ValueError(f"{key!r}: librdkafka says {together}")
    for key, value in conf.items():
        reason = refusal({key: value})
        if reason is not None:
            raise ValueError(f"{key!r}: librdkafka says {reason}")
    raise ValueError(f"{', '.join(map(repr, conf))} together: librdkafka says {together}")


class KafkaSettings(_Section):
    """The Kafka consumer side: brokers, group membership, security and fetch batching."""

    bootstrap_servers: str = Field(min_length=1, description="Comma-separated host:port list.")
    group_id: str = Field(default="lance-sink", min_length=1, description="Consumer group id.")
    topics: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1,
        description="Topics to consume; several topics may feed one table. Each is a legal "
        "Kafka topic name (at most 249 of a-z, A-Z, 0-9, '.', '_' and '-'; not '.' or '..'), "
        "or a librdkafka regex subscription starting with '^'.",
    )
    client_id: str = Field(default="lance-sink", description="Client id sent to the brokers.")
    group_instance_id: str | None = Field(
        default=None, description="Static membership id (group.instance.id); unset = dynamic."
    )
    auto_offset_reset: Literal["earliest", "latest"] = Field(
        default="earliest",
        description="Where a partition with no committed offset and no WAL state starts. An "
        "offset the broker no longer has is never replaced silently: one deleted by retention "
        "resumes at the log start (lance_sink_offsets_skipped_total), one past the log end "
        "stops the partition (lance_sink_partition_stopped).",
    )
    isolation_level: Literal["read_committed", "read_uncommitted"] = Field(
        default="read_committed",
        description="read_committed reads committed transactions only (aborted messages never "
        "reach the table); read_uncommitted also ingests aborted and still open ones.",
    )
    session_timeout_ms: PositiveInt = Field(
        default=6_000,
        description="Group session timeout; the heartbeat thread keeps it alive independently "
        "of the poll loop. It also paces rebalances: a process that dies is replaced after "
        "it, and brokers whose coordinator holds each join round for a share of it (tansu, "
        "librdkafka's mock cluster) take about twice it for a member to join. 6 s, the least "
        "a Kafka broker accepts by default (group.min.session.timeout.ms), as librdkafka "
        "heartbeats every second from its own thread whatever the loop does.",
    )
    max_poll_interval_ms: PositiveInt = Field(
        default=300_000,
        description="librdkafka evicts a member that does not call consume() this often. The "
        "loop polls every consume_timeout_ms whatever storage does, so this is a safety net.",
    )
    consume_batch_size: PositiveInt = Field(
        default=10_000,
        le=1_000_000,
        description="Most messages one consume() call returns; larger batches amortise "
        "per-call cost, smaller ones lower latency.",
    )
    consume_timeout_ms: PositiveInt = Field(
        default=5,
        description="Longest a consume() call waits for messages. The loop notices durable "
        "puts between calls, so this bounds how late a commit follows durability; a quarter "
        "of the WAL flush interval keeps the commit delay within a few flush intervals.",
    )
    commit_interval_ms: PositiveInt = Field(
        default=5,
        description="Least time between two asynchronous commits of durable offsets (also "
        "committed synchronously on revoke and shutdown), counted from the last commit "
        "sent: an offset that becomes durable after a quieter spell is committed at once. "
        "A quarter of the WAL flush interval: under load a group commit waits at most this "
        "long for its offset commit, and a process sends at most 200 commits a second (one "
        "request each, for all its partitions); raise it to send fewer.",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="How the clients talk to the brokers."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = (
        Field(
            default=None,
            validate_default=True,
            description="SASL mechanism; required with a SASL security_protocol.",
        )
    )
    sasl_username: str | None = Field(
        default=None,
        validate_default=True,
        description="SASL user name; required with PLAIN and SCRAM mechanisms.",
    )
    sasl_password: SecretStr | None = Field(
        default=None,
        validate_default=True,
        description="SASL password (secret; set it through the environment); required with "
        "PLAIN and SCRAM mechanisms.",
    )
    ssl_ca_location: str | None = Field(default=None, description="CA certificate file (PEM).")
    ssl_certificate_location: str | None = Field(
        default=None, description="Client certificate file (PEM) for mutual TLS."
    )
    ssl_key_location: str | None = Field(default=None, description="Client private key (PEM).")
    ssl_key_password: SecretStr | None = Field(
        default=None, description="Password of the client private key (secret)."
    )
    librdkafka: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Extra librdkafka consumer properties, checked against librdkafka; keys "
        "the sink owns are rejected. topic.metadata.refresh.interval.ms defaults to 10000 "
        "(librdkafka: 300000): how long a topic created after the start, or a partition "
        "added, waits to be consumed.",
    )

    @field_validator("topics")
    @classmethod
    def _topics(cls, value: list[str]) -> list[str]:
        # A name starting with "^" is a librdkafka regex subscription, not a topic name.
        illegal = []
        for topic in (t for t in value if not t.startswith("^")):
            why = check_topic_name(topic)
            if why is not None:
                reason = f"{topic!r} is not a legal Kafka topic name"
                illegal.append(reason if why == reason else f"{reason}: it {why}")
        if illegal:
            raise ValueError("; ".join(illegal))
        return value

    @field_validator("sasl_mechanism")
    @classmethod
    def _sasl(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and str(info.data.get("security_protocol", "")).startswith("SASL"):
            raise ValueError("required with a SASL security_protocol")
        return value

    @field_validator("sasl_username", "sasl_password")
    @classmethod
    def _sasl_credentials(
        cls, value: str | SecretStr | None, info: ValidationInfo
    ) -> str | SecretStr | None:
        mechanism = info.data.get("sasl_mechanism")
        sasl = str(info.data.get("security_protocol", "")).startswith("SASL")
        if sasl and mechanism in SASL_PASSWORD_MECHANISMS:
            text = value.get_secret_value() if isinstance(value, SecretStr) else value
            if not text:
                raise ValueError(
                    f"required with sasl_mechanism {mechanism} (the brokers would refuse "
                    "to authenticate)"
                )
        return value

    @field_validator("librdkafka")
    @classmethod
    def _librdkafka(
        cls, value: dict[str, str | int | float | bool]
    ) -> dict[str, str | int | float | bool]:
        check_librdkafka_keys(value, "consumer")
        return value


class ColumnSpec(_Section):
    """One scalar column of the table."""

    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_]*$")
    type: Literal[
        "string", "int32", "int64", "float32", "float64", "bool", "binary", "timestamp"
    ] = Field(description="Arrow type; timestamp = timestamp[ms, UTC].")
    nullable: bool = True


class VectorSpec(_Section):
    """The vector column: `FixedSizeList<float32>[dim]` searched with `metric`."""

    column: str = Field(
        default="vector", pattern=r"^[A-Za-z][A-Za-z0-9_]*$", description="Column name."
    )
    dim: int = Field(gt=0, le=16_384, description="Dimension: every vector has exactly this many.")
    metric: Literal["l2", "cosine", "dot"] = Field(
        default="l2", description="Distance used by vector search and the vector index."
    )
    allow_nan: bool = Field(
        default=False, description="Accept NaN components (they poison distances; off)."
    )
    encoding: Literal["json", "base64_f32"] = Field(
        default="json",
        description="How the vector is written in a JSON value: json = an array of numbers; "
        "base64_f32 = a string of base64 (RFC 4648, padded) over dim little-endian float32, "
        "i.e. 4 * dim bytes. source.format json only (refused with any other format).",
    )


class TableSettings(_Section):
    """The Lance table rows land in."""

    uri: str = Field(min_length=1, description="Local path or s3://bucket/prefix of the table.")
    mode: Literal["append", "upsert"] = Field(
        default="append",
        description="append: every message is a row. upsert: rows are keyed by primary_key; "
        "the newest version of a key wins and a Kafka tombstone deletes it.",
    )
    columns: list[ColumnSpec] = Field(
        default_factory=list,
        description="Scalar columns, each { name, type, nullable }; type is one of string, "
        "int32, int64, float32, float64, bool, binary, timestamp (milliseconds, UTC). Empty "
        "with a registry format: derived from the subject's latest schema when the table is "
        "created, from the table afterwards (docs/formats.md); with source.envelope = "
        "'debezium' from the after image, in json of the schema blocks of the topic's newest "
        "events.",
    )
    vector: VectorSpec | None = None
    fts_columns: list[str] = Field(
        default_factory=list, description="String columns searchable by full-text (BM25)."
    )
    primary_key: list[str] | None = Field(
        default=None,
        validate_default=True,
        description="Key columns. Required for upsert; for append tables the default key is "
        "the source coordinates (_topic, _partition, _offset).",
    )
    source_columns: bool = Field(
        default=True,
        validate_default=True,
        description="Store the Kafka coordinates as _topic, _partition and _offset columns.",
    )
    storage_options: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="Object-store options (region, endpoint, credentials) for Lance and the WAL.",
    )
    evolve: bool = Field(
        default=False,
        description="Schema evolution at start: add the columns the settings (or, with derived "
        "columns, a newer registry schema) have and the table lacks, as nullable columns "
        "(Lance schema evolution, no rewrite), and widen int32 to int64 and float32 to "
        "float64. With derived columns, a running sink that meets a writer schema with new "
        "or widened fields restarts itself to evolve (docs/formats.md). Off: a difference "
        "between the settings and the table stops the start with an error that says so; "
        "fields of a newer writer schema the derived columns lack are left out, logged once "
        "per schema id (schema_fields_not_in_table).",
    )

    @field_validator("uri")
    @classmethod
    def _uri(cls, value: str) -> str:
        return check_uri(value)

    @field_validator("vector")
    @classmethod
    def _vector(cls, value: VectorSpec | None, info: ValidationInfo) -> VectorSpec | None:
        names = {c.name for c in info.data.get("columns", [])}
        if value is not None and value.column in names:
            raise ValueError(f"vector column {value.column!r} is also a scalar column")
        return value

    @field_validator("columns")
    @classmethod
    def _columns(cls, value: list[ColumnSpec]) -> list[ColumnSpec]:
        names = [c.name for c in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate column names: {', '.join(dupes)}")
        return value

    @field_validator("fts_columns")
    @classmethod
    def _fts(cls, value: list[str], info: ValidationInfo) -> list[str]:
        if not info.data.get("columns"):
            return value  # derived from a schema at start; checked again then
        types = {c.name: c.type for c in info.data.get("columns", [])}
        for col in value:
            if types.get(col) != "string":
                raise ValueError(f"{col!r} is not a string column of the table")
        return value

    @field_validator("primary_key")
    @classmethod
    def _primary_key(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if info.data.get("mode") == "upsert" and not value:
            raise ValueError("required for upsert tables")
        if not info.data.get("columns"):
            return value  # derived from a schema at start; checked again then
        types = {c.name: c.type for c in info.data.get("columns", [])}
        for col in value or []:
            if col not in types:
                raise ValueError(f"{col!r} is not a column of the table")
            if types[col] not in {"string", "int32", "int64", "binary"}:
                raise ValueError(f"{col!r} must be a string, integer or binary column")
        return value

    @field_validator("source_columns")
    @classmethod
    def _source_columns(cls, value: bool, info: ValidationInfo) -> bool:
        if not value and info.data.get("mode") == "append" and not info.data.get("primary_key"):
            raise ValueError("append tables without a primary_key need source_columns = true")
        return value


def check_uri(value: str) -> str:
    """Accept local paths, file:// and s3:// URIs with a bucket."""
    parsed = urlparse(value)
    scheme = parsed.scheme if len(parsed.scheme) > 1 else ""  # "C:" is a drive, not a scheme
    if scheme not in SUPPORTED_URI_SCHEMES:
        raise ValueError(
            f"unsupported URI scheme {scheme!r}; use a local path, file:// or s3://bucket/prefix"
        )
    if scheme == "s3" and not parsed.netloc:
        raise ValueError("an s3:// URI needs a bucket: s3://bucket/prefix")
    if scheme == "s3" and "//" in parsed.path.rstrip("/"):
        # Lance refuses empty key segments; the object store would read "a//b" as "a/b".
        raise ValueError("an s3:// key has an empty segment ('//'): write s3://bucket/a/b")
    return value


#: Source formats whose values carry the Confluent wire format (magic byte, schema id) and
#: are decoded with schemas from a Schema Registry (see docs/formats.md).
REGISTRY_FORMATS = frozenset({"avro", "protobuf", "json_schema"})


class SchemaRegistrySettings(_Section):
    """The Confluent-compatible Schema Registry that registry formats read schemas from,
    through confluent-kafka's own client (its schema cache, retries and TLS)."""

    url: str = Field(
        min_length=1,
        description="Registry URL; several comma-separated URLs are tried in turn "
        "(http://, https://; mock:// is confluent-kafka's in-process registry, for tests).",
    )
    basic_auth_username: str | None = Field(default=None, description="Basic-auth user name.")
    basic_auth_password: SecretStr | None = Field(
        default=None, description="Basic-auth password (secret; set it through the environment)."
    )
    bearer_token: SecretStr | None = Field(
        default=None, description="Static bearer token (secret) sent as 'Authorization: Bearer'."
    )
    bearer_logical_cluster: str = Field(
        default="",
        description="Logical cluster sent with the bearer token (target-sr-cluster; Confluent "
        "Cloud needs it, other registries ignore it).",
    )
    ssl_ca_location: str | None = Field(
        default=None, description="CA certificate file or folder (PEM) for https:// URLs."
    )
    ssl_certificate_location: str | None = Field(
        default=None, description="Client certificate file (PEM) for mutual TLS."
    )
    ssl_key_location: str | None = Field(default=None, description="Client private key (PEM).")
    ssl_key_password: SecretStr | None = Field(
        default=None, description="Password of the client private key (secret)."
    )
    timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=10.0, description="HTTP timeout of one registry request."
    )
    max_retries: NonNegativeInt = Field(
        default=1,
        le=10,
        description="Retries of a failed request inside the client (on a decode thread). Kept "
        "low: a registry that stays unreachable pauses the partition instead, retried with "
        "backoff (unreachable_backoff_max_s) without holding a decode thread.",
    )
    cache_capacity: PositiveInt = Field(
        default=1_000,
        description="Schemas the client keeps by id (a schema id never changes, so one "
        "look-up per id per process is the norm).",
    )
    cache_latest_ttl_s: PositiveInt = Field(
        default=300,
        description="How long the client caches a subject's latest version (used to derive "
        "the table's columns at first start).",
    )
    unreachable_backoff_max_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0,
        description="Longest wait before a partition paused on an unreachable registry tries "
        "again (1 s, doubling per failure up to this).",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        for url in value.split(","):
            scheme = urlparse(url.strip()).scheme
            if scheme not in {"http", "https", "mock"}:
                raise ValueError(f"{url.strip()!r} is not an http://, https:// or mock:// URL")
        return value

    @model_validator(mode="after")
    def _auth(self) -> SchemaRegistrySettings:
        if (self.basic_auth_username is None) != (self.basic_auth_password is None):
            given, missing = ("basic_auth_username", "basic_auth_password")[
                :: 1 if self.basic_auth_password is None else -1
            ]
            raise KeyedError(
                missing, "basic_auth_username and basic_auth_password go together", (given,)
            )
        if self.basic_auth_username is not None and self.bearer_token is not None:
            raise KeyedError(
                "bearer_token",
                "use basic auth or a bearer token, not both",
                ("basic_auth_username", "basic_auth_password"),
            )
        return self

    def client_conf(self) -> dict[str, Any]:
        """The configuration of confluent-kafka's `SchemaRegistryClient`."""
        conf: dict[str, Any] = {
            "url": self.url,
            "timeout": self.timeout_s,
            "max.retries": self.max_retries,
            "retries.wait.ms": 200,
            "retries.max.wait.ms": 2_000,
            "cache.capacity": self.cache_capacity,
            "cache.latest.ttl.sec": self.cache_latest_ttl_s,
        }
        if self.basic_auth_username is not None and self.basic_auth_password is not None:
            password = self.basic_auth_password.get_secret_value()
            conf["basic.auth.user.info"] = f"{self.basic_auth_username}:{password}"
        if self.bearer_token is not None:
            conf["bearer.auth.credentials.source"] = "STATIC_TOKEN"
            conf["bearer.auth.token"] = self.bearer_token.get_secret_value()
            conf["bearer.auth.logical.cluster"] = self.bearer_logical_cluster
        for key, value in (
            ("ssl.ca.location", self.ssl_ca_location),
            ("ssl.certificate.location", self.ssl_certificate_location),
            ("ssl.key.location", self.ssl_key_location),
        ):
            if value:
                conf[key] = value  # noqa: PERF403 - three optional keys, clearer as a loop
        if self.ssl_key_password is not None:
            conf["ssl.key.password"] = self.ssl_key_password.get_secret_value()
        return conf


def descriptor_pool(path: str) -> tuple[DescriptorPool, list[str]]:
    """The message types of the ``FileDescriptorSet`` file at `path`
    (``source.protobuf.descriptor_set``): a new pool holding every file of the set, and
    the full names of the files' top-level messages (google.protobuf's last).

    Raises:
        ValueError: the file cannot be read, is not a ``FileDescriptorSet``, or a file of it
            does not load (it imports one the set lacks); the reason names the path.
    """
    from google.protobuf import descriptor_pb2  # noqa: PLC0415 - protobuf only when used
    from google.protobuf.descriptor_pool import DescriptorPool  # noqa: PLC0415
    from google.protobuf.message import DecodeError  # noqa: PLC0415

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    files = descriptor_pb2.FileDescriptorSet()
    try:
        files.ParseFromString(data)
    except DecodeError as exc:
        raise ValueError(f"{path} is not a FileDescriptorSet: {exc}") from exc
    pool = DescriptorPool()
    names: list[str] = []
    for file in files.file:
        try:
            pool.Add(file)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"{path}: cannot load {file.name} ({exc}); build the set with "
                "protoc --include_imports"
            ) from exc
        package = f"{file.package}." if file.package else ""
        names.extend(package + m.name for m in file.message_type)
    names.sort(key=lambda name: name.startswith("google.protobuf."))
    return pool, names


#: Most message names an error about a missing message lists.
_LISTED_MESSAGES = 10


def find_message(pool: DescriptorPool, names: list[str], path: str, message: str) -> Descriptor:
    """The descriptor of `message` (a full name) in `pool`, from the descriptor set at `path`
    whose top-level messages are `names` (`descriptor_pool`).

    Raises:
        ValueError: the set has no such message; the reason lists the messages it has.
    """
    try:
        found: Descriptor = pool.FindMessageTypeByName(message)
    except KeyError as exc:
        listed = ", ".join(names[:_LISTED_MESSAGES])
        more = ", ..." if len(names) > _LISTED_MESSAGES else ""
        raise ValueError(
            f"{path} has no message {message!r} (its messages: {listed or 'none'}{more})"
        ) from exc
    return found


class ProtobufSettings(_Section):
    """Protobuf without a schema registry: one message type from a descriptor set."""

    descriptor_set: str | None = Field(
        default=None,
        description="A FileDescriptorSet file (protoc --include_imports --descriptor_set_out) "
        "holding the message type; used when there is no schema_registry (values are then "
        "the message's plain bytes, not the Confluent wire format). Read when the settings "
        "load (check-config too), as is the message in it.",
    )
    message: str | None = Field(
        default=None,
        description="Full name of the message type, e.g. 'shop.v1.Order': the type of the "
        "values with a descriptor_set; with a registry, the message table.columns are "
        "derived from (default: the schema's first message).",
    )

    @model_validator(mode="after")
    def _both(self) -> ProtobufSettings:
        if self.descriptor_set is None:
            return self
        if self.message is None:
            raise KeyedError(
                "message", "a descriptor_set needs the message type (message)", ("descriptor_set",)
            )
        # Read now, as the start would: check-config fails on what run would fail on.
        try:
            pool, names = descriptor_pool(self.descriptor_set)
        except ValueError as exc:
            raise KeyedError("descriptor_set", str(exc)) from exc
        try:
            find_message(pool, names, self.descriptor_set, self.message)
        except ValueError as exc:
            raise KeyedError("message", str(exc)) from exc
        return self


class SourceSettings(_Section):
    """How Kafka messages become rows."""

    format: Literal["json", "raw", "avro", "protobuf", "json_schema"] = Field(
        default="json",
        description="json: the value is a JSON object; raw: the value goes into one column; "
        "avro, protobuf, json_schema: the Confluent wire format with schemas from "
        "source.schema_registry (see docs/formats.md).",
    )
    key_format: Literal["raw", "avro", "protobuf", "json_schema"] = Field(
        default="raw",
        description="How Kafka keys are encoded: raw bytes, or a registry format decoded "
        "with source.schema_registry; '@key' then reads the decoded key and '@key.a.b' a "
        "field of a record key (upsert primary keys, the key a tombstone deletes).",
    )
    schema_registry: SchemaRegistrySettings | None = Field(
        default=None,
        description="The Schema Registry; required by avro and json_schema, and by protobuf "
        "unless source.protobuf names a descriptor set.",
    )
    protobuf: ProtobufSettings | None = Field(
        default=None, description="Protobuf's message type, from a descriptor set or by name."
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="column -> source. '$.a.b' is a path into the JSON value; '@key', "
        "'@topic', '@partition', '@offset', '@timestamp', '@headers.NAME' are Kafka "
        "metadata; '@value' is the whole payload (raw). Unmapped columns read the "
        "same-named top-level JSON field.",
    )
    tombstones: Literal["skip", "dlq"] = Field(
        default="skip",
        description="What a null-value message does on an append table (on an upsert table "
        "it deletes its key).",
    )
    envelope: Literal["none", "debezium"] = Field(
        default="none",
        description="none: each value is a row. debezium: each value is a Debezium change "
        "event (json, with or without the JSON converter's schema/payload wrapper; or a "
        "registry format): op c/r/u upserts the after image, d deletes the key in before "
        "(else the Kafka key), Debezium's tombstones are skipped. Needs an upsert table; "
        "unmapped columns read fields of after, '$.' paths address the event (docs/formats.md).",
    )
    truncate: Literal["skip", "dlq"] = Field(
        default="skip",
        description="(envelope debezium) What a truncate event (op t) does: skip logs and "
        "counts it and leaves the table as it is; dlq makes it a cdc_truncate dead letter. "
        "Never applied: a table-wide event has no order against the other partitions.",
    )
    max_message_bytes: PositiveBytes = Field(
        default=ByteSize(1 << 20), description="Larger messages go to the dead-letter topic."
    )
    decode_workers: PositiveInt = Field(
        default=2,
        le=64,
        description="Threads that decode consumed batches while the consumer loop keeps "
        "polling and committing (results are put in offset order per partition). About one "
        "per core the sink may use.",
    )
    decode_processes: bool = Field(
        default=False,
        description="Decode in worker processes (one per decode worker) instead of threads: "
        "the consumer loop, WAL and memtables keep the interpreter lock to themselves. Each "
        "worker holds its own copy of the decoder (and registry clients).",
    )

    @field_validator("columns")
    @classmethod
    def _sources(cls, value: dict[str, str]) -> dict[str, str]:
        for column, source in value.items():
            if not _SOURCE_RE.match(source):
                raise ValueError(
                    f"column {column!r}: source {source!r} is neither a JSON path ($.a.b) "
                    "nor Kafka metadata (@key, @key.a.b with a key_format, @topic, "
                    "@partition, @offset, @timestamp, @headers.NAME, @value)"
                )
        return value

    @model_validator(mode="after")
    def _registry(self) -> SourceSettings:
        if self.key_format != "raw" and self.schema_registry is None:
            raise KeyedError(
                "schema_registry",
                f"key_format {self.key_format!r} needs a [source.schema_registry] section",
                ("key_format",),
            )
        if self.key_format == "raw":
            dotted = sorted(c for c, s in self.columns.items() if s.startswith("@key."))
            if dotted:
                raise KeyedError(
                    f"columns.{dotted[0]}",
                    f"column {dotted[0]!r}: '@key.<field>' reads a field of a decoded key; "
                    "set source.key_format to the key's registry format",
                    ("key_format",),
                )
        if self.envelope == "debezium" and self.format == "raw":
            raise KeyedError(
                "envelope",
                "'debezium' reads change events of the json or a registry format, not raw",
                ("format",),
            )
        if self.format in REGISTRY_FORMATS and self.schema_registry is None:
            if (
                self.format == "protobuf"
                and self.protobuf is not None
                and self.protobuf.descriptor_set is not None
            ):
                return self
            hint = " (or, for protobuf, source.protobuf.descriptor_set)"
            raise KeyedError(
                "schema_registry",
                f"format {self.format!r} needs a [source.schema_registry] section"
                + (hint if self.format == "protobuf" else ""),
                ("format",),
            )
        return self


#: A top-level field of Debezium's after image: what a primary key column may read.
_AFTER_FIELD_RE = re.compile(r"^\$\.after\.[A-Za-z0-9_\-]+$")

_SOURCE_RE = re.compile(
    r"^(\$(\.[A-Za-z0-9_\-]+)+|@key(\.[A-Za-z0-9_\-]+)*|@topic|@partition|@offset|@timestamp"
    r"|@value|@headers\..+)$"
)


class WalSettings(_Section):
    """The write-ahead log each shard appends to before anything is acknowledged."""

    uri: str | None = Field(
        default=None,
        description="Where WAL entries and shard manifests live; default: <table.uri>/_lance_sink.",
    )
    durable_writes: bool = Field(
        default=True,
        description="fsync local WAL entries (and their folder) before acknowledging. Off = "
        "entries survive a process crash but not a power loss. Object-store PUTs are "
        "always durable when they return.",
    )
    max_wal_flush_interval_ms: NonNegativeInt = Field(
        default=20,
        validate_default=True,
        description="Group-commit window: puts arriving within it share one WAL entry, whose "
        "offsets the next offset commit (at most kafka.commit_interval_ms later) takes.",
    )
    max_wal_buffer_size: PositiveBytes = Field(
        default=ByteSize(16 << 20),
        description="An entry is written as soon as this many bytes are buffered, and holds "
        "at most this many (one larger put is an entry of its own).",
    )
    fence_check_interval_ms: NonNegativeInt = Field(
        default=1000,
        description="How stale a writer's knowledge of being fenced may be on reads: this "
        "often (at least every 0.5 s) the process lists the WAL storage's claim board once "
        "(every claim posts a marker there) and checks the manifest of each of its shards "
        "that another process claimed since; queries do no storage I/O for it, and a busy "
        "writer learns it at its next WAL append. Each idle shard's manifest is also "
        "checked every 300 s (one LIST on S3; claims by builds older than the board). 0 "
        "checks on every read of every shard instead (strict; one LIST per shard per query "
        "on S3).",
    )
    fence_probes_per_s: PositiveInt = Field(
        default=64,
        le=10_000,
        description="The most background fence checks (the claim board's listing, or one "
        "LIST of a shard manifest) the process makes per second, all its shards together, "
        "so its idle cost does not grow with the partitions: each idle shard's own check "
        "runs every max(300 s, shards / fence_probes_per_s), which bounds how long a fenced "
        "writer may still answer reads of its shard when the claim that fenced it was not "
        "posted on the board.",
    )
    workers: PositiveInt | None = Field(
        default=None,
        le=64,
        description="WAL workers: the threads that write every shard's WAL entries (group "
        "commit, memtable inserts, seals, idle fence checks), shared by all shards with one "
        "timer, so the thread count does not grow with the partitions. A shard is run by one "
        "worker at a time; this bounds how many shards append at once. Default: 4 per core, "
        "4 to 32. Raise it on an object store with many busy partitions (each append waits "
        "a round trip).",
    )

    @field_validator("uri")
    @classmethod
    def _uri(cls, value: str | None) -> str | None:
        return None if value is None else check_uri(value)

    @field_validator("max_wal_flush_interval_ms")
    @classmethod
    def _interval(cls, value: int, info: ValidationInfo) -> int:
        if value == 0 and info.data.get("durable_writes", True):
            raise ValueError(
                "must be > 0 with durable_writes (0 would write one WAL entry per put, "
                "with no group commit)"
            )
        return value


class MemtableSettings(_Section):
    """When the active memtable is sealed (one predicate, shared by live writes and replay)."""

    max_rows: PositiveInt = Field(default=200_000, description="Seal at this many rows.")
    max_bytes: PositiveBytes = Field(
        default=ByteSize(128 << 20),
        description="Seal at this many resident bytes (rows + indexes).",
    )
    max_batches: PositiveInt = Field(
        default=4_096, description="Seal at this many batches (bounds per-query batch overhead)."
    )
    max_age_s: NonNegativeInt = Field(
        default=300,
        description="Seal a memtable this many seconds after its first row, so a slow "
        "partition's rows reach the Lance table within about this long plus one flush (0 = "
        "seal on size only). Replay seals on size only.",
    )


class BackpressureSettings(_Section):
    """Admission control between the consumer and the shard writers."""

    controller: str = Field(
        default="budget",
        description="'budget' (process-wide byte budget, rejects with Backpressure; what the "
        "sink uses), 'valve' (per-shard blocking valve) or 'module:factory' for your own "
        "(imported when the config loads, called once at start; check-config calls it too).",
    )
    process_budget_bytes: PositiveBytes = Field(
        default=ByteSize(1 << 30),
        description="Unflushed memtable bytes (all shards) above which puts are rejected and "
        "partitions paused. At least two memtables so one can flush while one fills.",
    )
    max_unflushed_memtable_bytes: PositiveBytes = Field(
        default=ByteSize(512 << 20), description="Per-shard limit of the blocking valve."
    )

    @field_validator("controller")
    @classmethod
    def _controller(cls, value: str) -> str:
        if value in {"budget", "valve"}:
            return value
        if not re.match(r"^[\w.]+:[\w.]+$", value):
            raise ValueError("use 'budget', 'valve' or an import path 'package.module:factory'")
        resolve_factory(value)
        return value


def resolve_factory(path: str) -> Callable[..., object]:
    """Import `package.module:attr.attr` and return the callable it names.

    Importing runs the module's top-level code, as starting the sink would: `check-config`
    fails on what `run` would fail on.

    Raises:
        ValueError: the module cannot be imported, has no such attribute, or it is not
            callable (the reason says which).
    """
    module_name, _, attr = path.partition(":")
    try:
        target: object = importlib.import_module(module_name)
    except Exception as exc:  # any failure of the import is the user's module
        raise ValueError(
            f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(  # noqa: TRY004 - pydantic reports only ValueError as a problem
            f"{path!r} is not callable (a factory is called with the limits)"
        )
    return target


class FlushSettings(_Section):
    """Flushing frozen memtables into the Lance table."""

    workers: PositiveInt = Field(default=1, le=16, description="Concurrent flushes.")
    retry_initial_backoff_ms: PositiveInt = Field(
        default=200, description="Wait before retrying a failed flush; doubles per attempt."
    )
    retry_max_backoff_ms: PositiveInt = Field(
        default=10_000, description="Longest wait between flush retries."
    )
    max_attempts: PositiveInt = Field(
        default=8, description="Failed attempts after which the shard writer is poisoned."
    )
    max_commits_per_s: float = Field(
        default=4.0,
        gt=0,
        le=1_000,
        description="The most Lance flush commits per second to the table from this process, "
        "whatever the partition count: the frozen memtables of the shards waiting at the "
        "same time go into one commit (one memtable per shard; upsert tables: shards whose "
        "keys overlap wait for the next commit). A shard flushing alone commits at once "
        "when the previous commit is at least 1 / max_commits_per_s seconds old. 4: a "
        "1,024-partition process makes 4 commits a second instead of 1,024 per round, and "
        "a flush waits at most 250 ms behind the previous one.",
    )
    max_commit_rows: PositiveInt = Field(
        default=1_000_000,
        description="Rows of one flush commit of several shards (five full memtables at "
        "the default memtable.max_rows); the shards past it wait for the next commit. A "
        "single shard's memtable always commits whole.",
    )
    max_commit_bytes: PositiveBytes = Field(
        default=ByteSize(512 << 20),
        description="Bytes of one flush commit of several shards (four full memtables at "
        "the default memtable.max_bytes); the shards past it wait for the next commit.",
    )


class MaintenanceSettings(_Section):
    """Background upkeep of the base table: indexes, compaction, old versions."""

    enabled: bool = Field(
        default=True,
        description="Run base-table maintenance. One pod of the consumer group runs it: the "
        "holder of partition 0 of the first topic in kafka.topics that is not a pattern (it "
        "moves with rebalances); the others stand by. With patterns only, every pod runs it. "
        "Off: this pod never runs it, even holding that partition (then no pod does).",
    )
    process: bool = Field(
        default=True,
        description="Run maintenance in a child process with its own Lance runtime (false: "
        "threads of the sink process). Index builds in the sink process made queries wait "
        "inside Lance for over a second.",
    )
    nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="CPU niceness added to the maintenance process once the table has its "
        "first vector and text indexes (until then queries scan the base flat, so their "
        "builds run at the sink's priority), so ingestion and queries get the CPU first "
        "(0 = the sink's priority).",
    )
    interval_s: PositiveInt = Field(default=30, description="Time between maintenance runs.")
    vector_index: Literal["IVF_PQ", "IVF_HNSW_SQ"] = Field(
        default="IVF_PQ", description="Kind of vector index built on the base table."
    )
    vector_index_min_rows: PositiveInt = Field(
        default=50_000,
        description="Build the vector index once the base table has this many rows (IVF_PQ: "
        "at least 256, the rows it trains its codebooks on).",
    )
    num_partitions: PositiveInt | None = Field(
        default=None, description="IVF partitions; default about sqrt(rows)."
    )
    num_sub_vectors: PositiveInt | None = Field(
        default=None, description="PQ sub-vectors; default dim/16 (must divide dim)."
    )
    fts_index: bool = Field(default=True, description="Build the full-text index on fts_columns.")
    scalar_indexes: dict[str, Literal["BTREE", "BITMAP"]] = Field(
        default_factory=dict,
        description="Scalar indexes to build on filter columns, by column: BTREE (many "
        "distinct values, ranges) or BITMAP (few distinct values). Lance pre-filters base "
        "rows with them (vector + filter on 1M rows: 28 ms without, 12 ms with a BITMAP).",
    )
    optimize_unindexed_rows: PositiveInt = Field(
        default=20_000, description="Run optimize_indices once this many rows are unindexed."
    )
    optimize_interval_s: PositiveInt = Field(
        default=5,
        description="Between full runs, check this often whether optimize_indices is due, so "
        "flushed rows get indexed within seconds (Lance searches unindexed rows flat).",
    )
    compact_min_fragments: PositiveInt = Field(
        default=16,
        description="Compact once this many small fragments exist (a fragment with 10 % of "
        "its rows deleted is compacted anyway).",
    )
    cleanup_retention_s: PositiveInt = Field(
        default=3_600, description="Old table versions younger than this are kept."
    )


class DlqSettings(_Section):
    """Where messages that cannot be decoded or validated go, with their reason."""

    enabled: bool = Field(
        default=True,
        description="Off = a bad message stops its partition (nothing is ever dropped).",
    )
    topic_template: str = Field(
        default="{topic}.dlq",
        description="Dead-letter topic; {topic} = the source topic. Beside it only a-z, A-Z, "
        "0-9, '.', '_' and '-' (Kafka's topic characters); every resulting name must be a "
        "legal topic: at most 249 characters, not '.' or '..'.",
    )
    produce_timeout_ms: PositiveInt = Field(
        default=30_000,
        description="A dead letter not delivered within this is re-sent (the partition waits).",
    )
    lance_table_uri: str | None = Field(
        default=None,
        description="Also write dead letters to this Lance table, full payload included "
        "(also of dead letters the topic only gets an envelope of), once per source offset: "
        "a merge-insert on its topic, partition and offset columns. Compacted once it has 16 "
        "fragments; versions older than maintenance.cleanup_retention_s are removed then.",
    )
    stalled_after_s: PositiveInt = Field(
        default=60,
        description="A partition held longer than this by dead letters not yet acknowledged "
        "is reported: a /readyz reason, /v1/status and lance_sink_dlq_held_seconds. Twice "
        "the default produce_timeout_ms: one full round of librdkafka's own retries is "
        "normal.",
    )
    librdkafka: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Extra librdkafka properties of the dead-letter producer, checked "
        "against librdkafka; keys the sink owns are rejected. message.max.bytes defaults to "
        "source.max_message_bytes + 64 KiB (at least librdkafka's 1000000).",
    )

    @field_validator("librdkafka")
    @classmethod
    def _librdkafka(
        cls, value: dict[str, str | int | float | bool]
    ) -> dict[str, str | int | float | bool]:
        check_librdkafka_keys(value, "producer", DLQ_OWNED_LIBRDKAFKA_KEYS)
        return value

    @field_validator("topic_template")
    @classmethod
    def _template(cls, value: str) -> str:
        try:
            value.format(topic="t")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError("topic_template may only use the {topic} placeholder") from exc
        illegal = sorted(set(_TOPIC_ILLEGAL_RE.findall(value.replace("{topic}", ""))))
        if illegal:
            raise ValueError(
                "a Kafka topic name may only hold the letters a-z and A-Z, the digits 0-9, "
                "'.', '_' and '-' beside the {topic} placeholder; found "
                + " ".join(repr(c) for c in illegal)
            )
        return value


class ObservabilitySettings(_Section):
    """Logs and metrics."""

    metrics_host: str = Field(
        default="0.0.0.0",  # noqa: S104 - a pod serves metrics on all interfaces
        description="Address of the metrics and health endpoints.",
    )
    metrics_port: Port = Field(default=9102, description="Prometheus /metrics and health probes.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Lowest level logged."
    )
    log_format: Literal["auto", "json", "console"] = Field(
        default="auto", description="auto: console on a TTY, JSON otherwise."
    )
    kafka_statistics_interval_ms: PositiveInt = Field(
        default=5_000,
        description="librdkafka statistics: broker reachability for /readyz (not ready once "
        "none came for three intervals and a second). Each names every partition (~1 MB at "
        "1,024 partitions, built by librdkafka and parsed by the sink); lags take the end "
        "offset of the newest fetch response at each scrape, not these.",
    )
    partition_metrics: Literal["partition", "topic"] = Field(
        default="partition",
        description="Labels of the metrics of each topic-partition and its shard. partition: "
        "one series per partition (topic and partition labels) and per shard (shard label), "
        "~36 series a partition. topic: one series per topic (topic label alone, for very "
        "wide topics), so the series do not grow with the partitions: gauges are the sum "
        "over the topic's partitions held by the pod (the 0/1 gauges then count partitions), "
        "lag_seconds, dlq_held_seconds and replay_seconds the largest; counters and "
        "histograms count the topic's events.",
    )


class QuerySettings(_Section):
    """The HTTP query API."""

    enabled: bool = Field(default=True, description="Serve the HTTP query API.")
    host: str = Field(
        default="0.0.0.0",  # noqa: S104 - a pod serves queries on all interfaces
        description="Address of the query API.",
    )
    port: Port = Field(
        default=8080,
        description="Port of the query API. It may equal observability.metrics_port: one "
        "server then serves both (the bearer token still leaves /metrics and the probes "
        "open). The Helm chart refuses that: its Service, probes and NetworkPolicy give each "
        "port its own name and peers.",
    )
    auth_token: SecretStr | None = Field(
        default=None,
        description="If set, requests need 'Authorization: Bearer <token>': the query API, "
        "/openapi.json and /v1/status (/metrics, /healthz and /readyz stay open).",
    )
    max_request_bytes: PositiveBytes = Field(
        default=ByteSize(4 << 20), description="Larger request bodies get 413."
    )
    timeout_ms: PositiveInt = Field(default=10_000, description="Longer queries get 504.")
    slow_query_ms: PositiveInt | None = Field(
        default=1_000,
        description="Queries, and answers to other pods' fan-out requests, that take longer "
        "are logged (query_slow, a warning) with the milliseconds their thread spent in each "
        "stage of the read path: waiting for other pods' fresh rows, loading base fragments "
        "no index covers yet, Lance's search, statistics. null: none are logged.",
    )
    max_concurrent_queries: PositiveInt = Field(
        default=8,
        le=1_024,
        description="Queries running at once; more get 503. A timed-out query's work (which "
        "cannot be interrupted) frees its slot and finishes on as many threads again; past "
        "that, it keeps its slot. Bounds the threads and memory slow queries can take.",
    )
    max_k: PositiveInt = Field(default=1_000, le=100_000, description="Largest k a query may ask.")
    ingest_share: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.5,
        description="On a writer pod (lance-sink run), the share of the consumer loop's time "
        "ingestion may take while queries or other pods' fan-out requests run here: after "
        "each busy iteration the loop pauses (at most 250 ms) so queries get the rest. 1 "
        "never pauses. Nothing pauses while no query runs. See docs/deploy.md for when a "
        "query-only process (lance-sink serve) is the better topology.",
    )
    lance_cpu_threads: PositiveInt | None = Field(
        default=None,
        le=1_024,
        description="Threads of Lance's CPU pool, which queries, flushes and maintenance share "
        "in this process (LANCE_CPU_THREADS; default: that variable if set, else half the "
        "CPUs, at least 1). With every CPU in it, an index optimisation took them all and "
        "queries waited behind it.",
    )
    nprobes: PositiveInt = Field(
        default=20,
        description="IVF partitions probed on the base, at least: more while a filter leaves "
        "fewer than k matching rows in them.",
    )
    refine_factor: PositiveInt | None = Field(
        default=None, description="Re-rank k*refine_factor candidates with exact distances."
    )
    unindexed_cache_bytes: Annotated[ByteSize, Field(ge=0)] = Field(
        default=ByteSize(1 << 30),
        description="Memory for the base rows the vector or text index does not cover yet "
        "(all of them before the first index), searched in memory instead of by Lance's flat "
        "scan (0 = off; beyond it, a vector query reads the fragments not held itself, a text "
        "query falls back to Lance's search). Adds to the pod's memory.",
    )
    lance_index_cache_bytes: Annotated[ByteSize, Field(ge=0)] = Field(
        default=ByteSize(256 << 20),
        description="Bound of the Lance index cache that every query on the base shares (IVF "
        "partitions, posting lists, B-tree pages; Lance's own default, 6 GiB, is no bound for "
        "a pod). Adds to the pod's memory.",
    )
    lance_metadata_cache_bytes: Annotated[ByteSize, Field(ge=0)] = Field(
        default=ByteSize(64 << 20),
        description="Bound of the Lance metadata cache (manifests, file footers) that every "
        "query on the base shares (Lance's own default: 1 GiB). Adds to the pod's memory.",
    )
    advertised_url: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s/]+(/[^\s]*)?$",
        description="Where other pods reach this process's query API (e.g. "
        "http://10.1.2.3:8080; the Helm chart sets the pod IP). Recorded in the shard manifest "
        "when a shard is claimed, so a query to any pod can ask this one for its memtables' "
        "rows. Unset: derived at start (logged as advertised_url_derived) from query.host when "
        "it names one address, else from the address of the interface that routes to the "
        "first bootstrap broker, else from the host name's address; with the query API off, "
        "none is advertised (other pods' answers then name this process's partitions as "
        "missing, cause unadvertised, until their rows are flushed). An IPv6 address goes in "
        "brackets (http://[fd00::1]:8080); an unbracketed one followed by :port, as the chart "
        "writes an IPv6 pod IP (http://fd00::1:8080), is read as address and port and "
        "bracketed; any other host with several ':' is refused as ambiguous.",
    )
    fanout_timeout_ms: PositiveInt = Field(
        default=1_000,
        description="How long a query waits for another pod's memtable rows; past it the "
        "answer is partial (the missing partitions named) or fails, as the request asks.",
    )
    owners_refresh_ms: PositiveInt = Field(
        default=2_000,
        description="How often the shard owners are re-read: the shards the claim board "
        "shows claimed since the last read, and every manifest once a minute (also re-read "
        "whole when an owner answers with another epoch, or does not hold its shard).",
    )

    @field_validator("advertised_url")
    @classmethod
    def _advertised_url(cls, value: str | None) -> str | None:
        return None if value is None else bracket_ipv6_host(value)


def bracket_ipv6_host(url: str) -> str:
    """`url` (an http(s) URL) with an IPv6 host in brackets, as URLs need it.

    A host with several ':' and no brackets is read as an IPv6 address followed by ':port'
    (the last ':' and its digits): what `http://$(POD_IP):8080` becomes on an IPv6 pod,
    `http://fd00::1:8080`, is `http://[fd00::1]:8080`. An address without a port cannot be
    told from an address with one (`fd00::1:8080` is an address too), so it must come in
    brackets.

    Raises:
        ValueError: the host is ambiguous (several ':' that are not an IPv6 address and a
            port), a bracketed host is no IPv6 address, or a port is not 1-65535.
    """
    scheme, _, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    userinfo, at, host_port = authority.rpartition("@")
    if host_port.startswith("["):
        address, bracket, port = host_port[1:].partition("]")
        if not bracket or not _is_ipv6(address.replace("%25", "%")):
            raise ValueError(f"{host_port!r}: the host in brackets must be an IPv6 address")
        if port:
            if not port.startswith(":"):
                raise ValueError(f"{host_port!r}: only ':port' may follow the brackets")
            _check_port(port[1:], host_port)
        return url
    if host_port.count(":") > 1:
        address, _, port = host_port.rpartition(":")
        if not (port.isdigit() and "%" not in address and _is_ipv6(address)):
            raise ValueError(
                f"{host_port!r} is ambiguous: an IPv6 address goes in brackets, with its port "
                "after them (http://[fd00::1]:8080); unbracketed, only an IPv6 address "
                "followed by ':port' is accepted (and bracketed)"
            )
        _check_port(port, host_port)
        authority = f"{userinfo}{at}[{address}]:{port}"
        return f"{scheme}://{authority}{slash}{path}"
    _host, colon, port = host_port.partition(":")
    if colon:
        _check_port(port, host_port)
    return url


def _is_ipv6(address: str) -> bool:
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    return True


def _check_port(port: str, host_port: str) -> None:
    if not (port.isdigit() and 0 < int(port) <= 65535):  # the TCP port range
        raise ValueError(f"{host_port!r}: the port must be a number from 1 to 65535")


class ShutdownSettings(_Section):
    """Graceful drain on SIGTERM/SIGINT."""

    drain_deadline_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0,
        description="Longest the drain (finish appends, commit, close) may take. The Helm "
        "chart's terminationGracePeriodSeconds is set above it.",
    )


class Settings(BaseSettings):
    """The whole configuration of one lance-sink process."""

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        case_sensitive=False,
    )

    kafka: KafkaSettings
    source: SourceSettings = Field(default_factory=SourceSettings)
    table: TableSettings
    wal: WalSettings = Field(default_factory=WalSettings)
    memtable: MemtableSettings = Field(default_factory=MemtableSettings)
    backpressure: BackpressureSettings = Field(default_factory=BackpressureSettings)
    flush: FlushSettings = Field(default_factory=FlushSettings)
    maintenance: MaintenanceSettings = Field(default_factory=MaintenanceSettings)
    dlq: DlqSettings = Field(default_factory=DlqSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    query: QuerySettings = Field(default_factory=QuerySettings)
    shutdown: ShutdownSettings = Field(default_factory=ShutdownSettings)

    @model_validator(mode="after")
    def _cross(self) -> Settings:
        if not self.table.columns:  # derived at start (sink.formats.derive), checked then
            cdc_json = self.source.format == "json" and self.source.envelope == "debezium"
            if self.source.format not in REGISTRY_FORMATS and not cdc_json:
                raise KeyedError(
                    "table.columns",
                    "needs at least one column (only the registry formats avro, protobuf and "
                    "json_schema, and json change events with envelope 'debezium', derive "
                    "the columns from a schema)",
                )
        else:
            table_columns = {c.name for c in self.table.columns}
            if self.table.vector is not None:
                table_columns.add(self.table.vector.column)
            unknown = sorted(set(self.source.columns) - table_columns)
            if unknown:
                raise KeyedError(
                    "source.columns", f"maps unknown table columns: {', '.join(unknown)}"
                )
            indexed = set(self.maintenance.scalar_indexes)
            not_scalar = sorted(indexed - {c.name for c in self.table.columns})
            if not_scalar:
                raise KeyedError(
                    "maintenance.scalar_indexes",
                    "not scalar table columns: " + ", ".join(not_scalar),
                )
        vector = self.table.vector
        if vector is not None and vector.encoding != "json" and self.source.format != "json":
            registry = self.source.format in REGISTRY_FORMATS
            raise KeyedError(
                "table.vector.encoding",
                f"{vector.encoding!r} is for source.format 'json' only (it is "
                f"{self.source.format!r}"
                + (
                    ": the vector is then an array of floats or bytes of little-endian "
                    "float32, read as such without an encoding)"
                    if registry
                    else ")"
                ),
            )
        if self.source.envelope == "debezium":
            self._check_debezium()
        if self.source.format == "raw":
            mapped = set(self.source.columns.values())
            if "@value" not in mapped:
                raise KeyedError("source.columns", "format 'raw' needs a column mapped to '@value'")
        if self.dlq.enabled:
            # A name starting with "^" is a librdkafka subscription pattern, not a topic.
            for topic in (t for t in self.kafka.topics if not t.startswith("^")):
                destination = self.dlq.topic_template.format(topic=topic)
                why = check_topic_name(destination)
                if why is not None:
                    raise KeyedError(
                        "dlq.topic_template",
                        f"the dead-letter topic of {topic!r}, {destination!r}: {why}",
                    )
        if self.backpressure.process_budget_bytes < 2 * self.memtable.max_bytes:
            raise KeyedError(
                "backpressure.process_budget_bytes",
                "must be at least 2 x memtable.max_bytes "
                "(one memtable fills while the previous one flushes)",
            )
        return self

    def _check_debezium(self) -> None:
        """Change events need an upsert table keyed by fields of the after image."""
        if self.table.mode != "upsert":
            raise KeyedError(
                "table.mode",
                "source.envelope = 'debezium' needs an upsert table (mode = 'upsert' with a "
                "primary_key): change events update and delete rows by key",
                ("source.envelope",),
            )
        if self.table.vector is not None and self.table.vector.encoding != "json":
            raise KeyedError(
                "table.vector.encoding",
                "source.envelope = 'debezium' reads vectors as Debezium writes them (arrays "
                "of numbers): leave encoding = 'json'",
                ("source.envelope",),
            )
        for key in self.table.primary_key or ():
            mapped = self.source.columns.get(key)
            if mapped is not None and not _AFTER_FIELD_RE.match(mapped):
                raise KeyedError(
                    f"source.columns.{key}",
                    f"primary key column {key!r} reads {mapped!r}; with source.envelope = "
                    "'debezium' a key column reads a field of the row ('$.after.<field>', or "
                    "unmapped: the field of its name), which deletes find in before or the "
                    "Kafka key",
                    ("table.primary_key",),
                )

    @property
    def wal_uri(self) -> str:
        """The WAL root: `wal.uri`, or `<table.uri>/_lance_sink` by default."""
        return self.wal.uri or self.table.uri.rstrip("/") + "/_lance_sink"
