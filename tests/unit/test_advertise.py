"""`query.advertised_url` derived when unset (`sink.advertise`): fan-out reaches every pod's
memtables with a plain config, not only with the one the Helm chart writes."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from config import load_settings
from config.settings import Settings
from engine.engine import writer_config
from sink.advertise import derive_url, first_broker, with_advertised_url

CONFIG = """
[kafka]
bootstrap_servers = "127.0.0.1:9092"
topics = ["events"]

[table]
uri = "./data/events.lance"
columns = [{ name = "id", type = "string" }]
"""


def settings(tmp_path: Path, extra: str = "") -> Settings:
    path = tmp_path / "sink.toml"
    path.write_text(CONFIG + extra)
    return load_settings(path)


def test_a_plain_config_advertises_the_address_routing_to_the_broker(tmp_path: Path) -> None:
    plain = settings(tmp_path)
    assert plain.query.advertised_url is None
    derived = with_advertised_url(plain)
    assert derived.query.advertised_url == "http://127.0.0.1:8080"
    assert writer_config(derived).advertised_url == "http://127.0.0.1:8080"  # the manifests'
    assert plain.query.advertised_url is None  # the settings given are left as they were


def test_a_set_url_or_a_query_api_off_is_left_alone(tmp_path: Path) -> None:
    given = settings(tmp_path, '[query]\nadvertised_url = "http://10.9.8.7:9000"\n')
    assert with_advertised_url(given).query.advertised_url == "http://10.9.8.7:9000"
    off = settings(tmp_path, "[query]\nenabled = false\n")
    assert with_advertised_url(off).query.advertised_url is None


@pytest.mark.parametrize(
    ("host", "url", "how"),
    [
        ("10.1.2.3", "http://10.1.2.3:8080", "query.host"),
        ("fd00::1", "http://[fd00::1]:8080", "query.host"),
        ("[fd00::1]", "http://[fd00::1]:8080", "query.host"),
        ("0.0.0.0", "http://127.0.0.1:8080", "the interface routing to the broker 127.0.0.1"),
    ],
)
def test_the_address_comes_from_a_specific_host_else_the_route(
    host: str, url: str, how: str
) -> None:
    assert derive_url(host, 8080, "127.0.0.1:9092") == (url, how)


def test_a_server_on_every_ipv4_interface_never_advertises_an_ipv6_route() -> None:
    # localhost may resolve to ::1 first: a server on 0.0.0.0 does not listen there.
    url, _ = derive_url("0.0.0.0", 8080, "localhost:9092")
    assert url == "http://127.0.0.1:8080"


def test_without_a_route_the_host_name_s_address_is_used() -> None:
    url, how = derive_url("0.0.0.0", 8080, "no-such-broker.invalid:9092")
    name = socket.gethostname()
    assert url == f"http://{socket.gethostbyname(name)}:8080"
    assert how == f"the address of the host name {name}"


@pytest.mark.parametrize(
    ("servers", "broker"),
    [
        ("b1:9092,b2:9092", ("b1", 9092)),
        ("PLAINTEXT://b1:9093", ("b1", 9093)),
        (" [fd00::1]:9092 ", ("fd00::1", 9092)),
        ("b1", None),
        ("b1:port", None),
    ],
)
def test_the_first_bootstrap_broker(servers: str, broker: tuple[str, int] | None) -> None:
    assert first_broker(servers) == broker
