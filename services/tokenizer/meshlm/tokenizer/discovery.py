"""What the scheduler and detokenizer clients share: reconnect backoff, channel options, an
address list that is re-resolved while running (a headless Kubernetes service name resolves to
one address per pod), and the Dialer that opens channels to those endpoints (TLS when
configured)."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Awaitable, Callable, Optional, Sequence

import grpc
from meshlm.common.addresses import resolve, server_name
from meshlm.common.grpc_server import MAX_MESSAGE_BYTES
from meshlm.common.tls import PLAINTEXT, TlsConfig, aio_channel

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Fail fast and retry ourselves (backoff below) rather than gRPC's long reconnect waits.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]

RESOLVE_INTERVAL_S = 10.0


class Dialer:
    """Opens the channels of one peer list: plaintext, or TLS (mTLS with a CA) per `tls`.
    Invariant: an endpoint resolve() returned is dialed with the certificate check against the
    DNS name it was resolved from (a pod IP behind a headless service carries no certificate of
    its own name)."""

    def __init__(self, tls: Optional[TlsConfig] = None) -> None:
        self.tls = tls or PLAINTEXT
        self._names: dict[str, str] = {}

    async def resolve(self, addresses: Sequence[str]) -> list[str]:
        """resolve_all, remembering each endpoint's DNS name."""
        return await resolve_all(addresses, self._names)

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        return aio_channel(endpoint, self.tls, CHANNEL_OPTIONS, self._names.get(endpoint))


class Backoff:
    """Exponential backoff with jitter: 0.1 s doubling to `cap` s (short, so a peer that comes
    up is found well within the request connect timeout); reset() after a success."""

    def __init__(self, initial: float = 0.1, cap: float = 1.0) -> None:
        self.initial = initial
        self.cap = cap
        self._next = initial

    def reset(self) -> None:
        self._next = self.initial

    async def sleep(self) -> None:
        delay = self._next * random.uniform(0.8, 1.2)
        self._next = min(self.cap, self._next * 2)
        await asyncio.sleep(delay)


async def resolve_all(addresses: Sequence[str], names: Optional[dict[str, str]] = None) -> list[str]:
    """Every endpoint of an address list, in list order (each name's addresses sorted), no
    duplicates. The order is the scheduler index that session ids name. `names`, when given,
    gets endpoint -> the DNS name it came from (IP literals have none).

    A dual-stack name (IPv4 and IPv6 addresses, e.g. localhost or a dual-stack pod) would
    count each peer twice: when a name has IPv4 addresses its IPv6 ones are dropped."""
    out: list[str] = []
    for addr in addresses:
        endpoints = await resolve(addr)
        v4 = [e for e in endpoints if not e.startswith("[")]
        name = server_name(addr)
        for endpoint in v4 or endpoints:
            if endpoint not in out:
                out.append(endpoint)
                if names is not None and name is not None:
                    names[endpoint] = name
    return out


async def refresh_forever(interval_s: float, refresh: Callable[[], Awaitable[None]], what: str) -> None:
    """Call `refresh` every interval_s (DNS re-resolution of a peer list); a failed refresh is
    logged and retried next period, never fatal."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await refresh()
        except Exception:
            logger.exception("re-resolving %s addresses failed", what)
