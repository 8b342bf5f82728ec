"""librdkafka properties every client of the sink shares (the consumer, the DLQ producer,
`lance-sink lag`'s admin client and probe): brokers, client id, security.

A module of its own so that `lance-sink lag` builds them without importing the service
(and with it the engine and the query API: seconds of imports for a look-up that takes a
tenth of one).
"""

from __future__ import annotations

from typing import Any

from config.settings import Settings


def kafka_security_conf(settings: Settings) -> dict[str, Any]:
    """librdkafka properties shared by the consumer, the DLQ producer and admin clients."""
    k = settings.kafka
    conf: dict[str, Any] = {
        "bootstrap.servers": k.bootstrap_servers,
        "client.id": k.client_id,
        "security.protocol": k.security_protocol,
    }
    if k.sasl_mechanism:
        conf["sasl.mechanism"] = k.sasl_mechanism
    if k.sasl_username:
        conf["sasl.username"] = k.sasl_username
    if k.sasl_password:
        conf["sasl.password"] = k.sasl_password.get_secret_value()
    for name, value in (
        ("ssl.ca.location", k.ssl_ca_location),
        ("ssl.certificate.location", k.ssl_certificate_location),
        ("ssl.key.location", k.ssl_key_location),
    ):
        if value:
            conf[name] = value  # noqa: PERF403 - three optional keys, clearer as a loop
    if k.ssl_key_password:
        conf["ssl.key.password"] = k.ssl_key_password.get_secret_value()
    return conf


def lag_confs(settings: Settings) -> tuple[dict[str, Any], dict[str, Any]]:
    """librdkafka properties of `lance-sink lag`'s admin client and watermark probe.

    Both take the shared connection and security properties and `kafka.librdkafka`, so a
    cluster the sink reaches only with pass-through keys (OAUTHBEARER, TLS options, socket
    settings) is reachable by `lag` too. The admin client is a producer-type handle: the
    consumer-only pass-through keys (fetch sizes, queue limits, group timeouts), which
    librdkafka would ignore with a warning on stderr, are left out of its properties.

    Returns:
        The admin client's properties and the probe consumer's.
    """
    shared = kafka_security_conf(settings)
    passthrough = dict(settings.kafka.librdkafka)
    admin = {k: v for k, v in passthrough.items() if not _consumer_only(k, v)}
    return {**shared, **admin}, {**shared, **passthrough}


def _consumer_only(key: str, value: object) -> bool:
    """Whether librdkafka ignores `key` on a producer-type handle (it says so, per key, in a
    configuration warning: its own table of which client a property applies to)."""
    import logging  # noqa: PLC0415
    import uuid  # noqa: PLC0415

    import confluent_kafka  # noqa: PLC0415

    class _Warnings(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    logger = logging.getLogger(f"lance_sink.lag.conf_probe.{uuid.uuid4().hex}")
    logger.propagate = False
    warnings = _Warnings()
    logger.addHandler(warnings)
    try:
        producer = confluent_kafka.Producer({key: value, "logger": logger})
        producer.poll(0)  # delivers the queued log lines to the logger
    finally:
        logger.removeHandler(warnings)
        logging.Logger.manager.loggerDict.pop(logger.name, None)
    return any("is a consumer property" in line and key in line for line in warnings.lines)
