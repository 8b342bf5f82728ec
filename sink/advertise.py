"""Where other pods reach this process's query API: `query.advertised_url`, derived when unset.

Fan-out (docs/reads.md "Several pods") routes a query to the pod that holds a shard by the
URL its writer recorded in the shard manifest. A process that records none serves its
memtables' rows to nobody: its partitions' fresh rows would be in no other pod's answer.
So a process with the query API on and no `query.advertised_url` derives one:

1. `query.host`, when it names one address (not a wildcard such as `0.0.0.0`): the
   process listens there and nowhere else;
2. else the address of the interface this host routes the first bootstrap broker through
   (a UDP socket connected to it: nothing is sent): the network the group shares;
3. else the address the host name resolves to.

The URL and how it was found are logged at start (`advertised_url_derived`). The Helm chart
sets the pod IP explicitly; with the query API off nothing is advertised.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Final

import structlog

from config.settings import Settings

log = structlog.get_logger("lance_sink")

#: Hosts that listen on every interface, so name no address another pod can use.
WILDCARD_HOSTS: Final = frozenset({"", "0.0.0.0", "::", "[::]", "*"})  # noqa: S104


def with_advertised_url(settings: Settings) -> Settings:
    """`settings` with `query.advertised_url` derived when the query API is on and none is
    set (see the module docstring); unchanged otherwise."""
    query = settings.query
    if not query.enabled or query.advertised_url:
        return settings
    url, how = derive_url(query.host, query.port, settings.kafka.bootstrap_servers)
    log.info("advertised_url_derived", url=url, source=how)
    return settings.model_copy(update={"query": query.model_copy(update={"advertised_url": url})})


def derive_url(host: str, port: int, bootstrap_servers: str) -> tuple[str, str]:
    """The URL other pods reach a query API listening on `host`:`port` at, and how the
    address was found (a phrase for the log)."""
    if host.strip() not in WILDCARD_HOSTS:
        return _url(host.strip().strip("[]"), port), "query.host"
    # A server on 0.0.0.0 takes IPv4 alone: an IPv6 route would name an address it does
    # not listen on.
    family = socket.AF_UNSPEC if host.strip() in ("::", "[::]") else socket.AF_INET
    broker = first_broker(bootstrap_servers)
    if broker is not None:
        address = _route_to(*broker, family)
        if address is not None:
            return _url(address, port), f"the interface routing to the broker {broker[0]}"
    name = socket.gethostname()
    try:
        return _url(socket.gethostbyname(name), port), f"the address of the host name {name}"
    except OSError:
        return _url("127.0.0.1", port), "no route to a broker, no address for the host name"


def first_broker(bootstrap_servers: str) -> tuple[str, int] | None:
    """Host and port of the first entry of a bootstrap list (`host:port`, `[v6]:port`,
    optionally with a `SCHEME://` prefix); None when it cannot be read."""
    entry = bootstrap_servers.split(",", maxsplit=1)[0].strip()
    entry = entry.partition("://")[2] or entry
    host, _, port = entry.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _route_to(host: str, port: int, family: socket.AddressFamily) -> str | None:
    """The local address the host routes `host` through (None when it cannot say)."""
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_DGRAM)
    except OSError:
        return None
    for found, kind, proto, _, address in infos:
        try:
            with socket.socket(found, kind, proto) as probe:
                probe.connect(address)  # UDP: chooses the route, sends nothing
                local = probe.getsockname()[0]
        except OSError:
            continue
        if not ipaddress.ip_address(local.split("%")[0]).is_unspecified:
            return str(local)
    return None


def _url(address: str, port: int) -> str:
    if ":" in address:  # IPv6
        return f"http://[{address}]:{port}"
    return f"http://{address}:{port}"
