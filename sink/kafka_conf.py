"""librdkafka properties every client of the sink shares (the consumer, the DLQ producer,
`lance-sink lag`'s admin client and probe): brokers, client id, security.

A module of its own so that `lance-sink lag` builds them without importing the service
(and with it the engine and the query API: seconds of imports for a look-up that takes a
tenth of one).
"""

from __future__ import annotations

import re
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
    ignored = consumer_only_keys(passthrough)
    admin = {k: v for k, v in passthrough.items() if k not in ignored}
    return {**shared, **admin}, {**shared, **passthrough}


#: How librdkafka words the configuration warning of a consumer property set on a
#: producer-type handle ("Configuration property fetch.min.bytes is a consumer property and
#: will be ignored by this producer instance").
_CONSUMER_PROPERTY = re.compile(r"Configuration property (\S+) is a consumer property")


def consumer_only_keys(conf: dict[str, Any]) -> set[str]:
    """The keys of `conf` that librdkafka ignores on a producer-type handle (it says so, per
    key, in a configuration warning: its own table of which client a property applies to).

    One handle with all the keys, as the admin client gets them: some keys are valid only
    with a companion (``ssl.keystore.location`` needs ``ssl.keystore.password``), and a
    handle with one of them alone is refused. A set librdkafka refuses (the settings check
    accepted it, so only a changed librdkafka could) is left whole to the admin client,
    whose construction then reports librdkafka's reason.
    """
    import logging  # noqa: PLC0415
    import uuid  # noqa: PLC0415

    import confluent_kafka  # noqa: PLC0415

    if not conf:
        return set()

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
        producer = confluent_kafka.Producer({**conf, "logger": logger})
        producer.poll(0)  # delivers the queued log lines to the logger
    except confluent_kafka.KafkaException:
        return set()
    finally:
        logger.removeHandler(warnings)
        logging.Logger.manager.loggerDict.pop(logger.name, None)
    named = {m.group(1) for line in warnings.lines if (m := _CONSUMER_PROPERTY.search(line))}
    return named & set(conf)
