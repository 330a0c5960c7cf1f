"""Peer discovery by address lists (flags/env). In Kubernetes a headless service name resolves
to one A record per pod; `resolve` re-reads DNS so replicas that come and go are followed."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Awaitable, Callable, Optional, Sequence


def parse_addresses(value: str | list[str] | None) -> list[str]:
    """"a:1,b:2" or ["a:1", "b:2"] -> ["a:1", "b:2"]; each must be host:port."""
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


def server_name(address: str) -> Optional[str]:
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
    ips = sorted({info[4][0] for info in infos})
    if len(ips) <= 1:
        return [address]
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


async def resolve_all(
    addrs: Sequence[str],
    names: Optional[dict[str, str]] = None,
    resolver: Callable[[str], Awaitable[list[str]]] = resolve,
) -> list[str]:
    """Every endpoint of an address list, in list order, without repeats. `names`, when given,
    gets endpoint -> the DNS name it was resolved from (what its TLS certificate must carry;
    IP literals have none)."""
    out: list[str] = []
    for addr in addrs:
        name = server_name(addr)
        for endpoint in await resolver(addr):
            if endpoint not in out:
                out.append(endpoint)
                if names is not None and name is not None:
                    names[endpoint] = name
    return out
