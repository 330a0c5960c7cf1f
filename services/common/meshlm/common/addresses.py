"""Peer discovery by address lists (flags/env). In Kubernetes a headless service name resolves
to one A record per pod; `resolve` re-reads DNS so replicas that come and go are followed."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence

Resolver = Callable[[str], Awaitable[list[str]]]


def parse_addresses(value: str | list[str] | None) -> list[str]:
    """ "a:1,b:2" or ["a:1", "b:2"] -> ["a:1", "b:2"]; each must be host:port."""
    if not value:
        return []
    items = value if isinstance(value, list) else value.split(",")
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"address must be host:port, got {item!r}")
        out.append(item)
    return out


def server_name(address: str) -> str | None:
    """The DNS name of a configured host:port: what a TLS peer's certificate must carry, even once
    the name is resolved to one IP per pod. None when the host is an IP literal."""
    host = address.rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host
    return None


async def resolve(address: str) -> list[str]:
    """Every ip:port a host:port resolves to (one per pod behind a headless service).
    Literal IPs and names that do not resolve come back unchanged."""
    host, _, port = address.rpartition(":")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError:
        return [address]
    ips = sorted({str(info[4][0]) for info in infos})
    if len(ips) <= 1:
        return [address]
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


async def resolve_all(
    addrs: Sequence[str],
    names: dict[str, str] | None = None,
    resolver: Resolver = resolve,
) -> list[str]:
    """Every endpoint of an address list, in list order (each name's addresses sorted), without
    repeats: the order is the scheduler index that session ids name. `names`, when given, gets
    endpoint -> the DNS name it was resolved from (what its TLS certificate must carry; IP
    literals have none).

    A dual-stack name (IPv4 and IPv6 addresses, e.g. localhost or a dual-stack pod) would count
    each peer twice: when a name has IPv4 addresses its IPv6 ones are dropped."""
    out: list[str] = []
    for addr in addrs:
        endpoints = await resolver(addr)
        v4 = [e for e in endpoints if not e.startswith("[")]
        name = server_name(addr)
        for endpoint in v4 or endpoints:
            if endpoint not in out:
                out.append(endpoint)
                if names is not None and name is not None:
                    names[endpoint] = name
    return out
