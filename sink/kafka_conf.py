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
