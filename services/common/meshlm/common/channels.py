"""How every meshlm gRPC client dials its peers: one set of channel options and message limits,
one backoff policy, and the Dialer that resolves an address list and opens (TLS) channels.

Invariants:
* every channel (client) and server of the ring carries the same message-size limit,
  MAX_MESSAGE_BYTES, both ways;
* with a token, every call on a Dialer's channels carries `authorization: Bearer <token>` (the
  ring's internal token, or the gateway's key for the tokenizers: meshlm.common.auth), added
  here once for every client of the ring;
* an endpoint the Dialer resolved from a DNS name is dialed with the TLS certificate check
  against that name (docs/ring.md "TLS": a pod IP behind a headless service has no certificate
  of its own; `grpc.ssl_target_name_override` carries the name);
* a Backoff's delays grow by `factor` from `initial` up to `cap`, each one scaled by a jitter in
  [1 - jitter, 1 + jitter] drawn from its own rng (seed it in tests).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from meshlm.common.addresses import Resolver, resolve, resolve_all
from meshlm.common.auth_interceptors import bearer_interceptors
from meshlm.common.tls import PLAINTEXT, TlsConfig, aio_channel

# The largest message on any link: a resync of many long requests, a KV handover chunk.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Fail fast and retry ourselves (Backoff below) rather than gRPC's long reconnect waits;
    # gRPC's own waits (a dial can meet a subchannel still backing off) no longer than ours.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)
Sleep = Callable[[float], Awaitable[None]]


class Backoff:
    """Exponential backoff with jitter, capped: `initial` s growing by `factor` to `cap` s (short,
    so a peer that comes up is found well within a request's connect timeout, and a system whose
    services start at once is whole within ~0.5 s of its scheduler); reset() after a
    success. `rng` and `sleep` are injectable so tests see exact delays without waiting."""

    def __init__(
        self,
        initial: float = 0.05,
        cap: float = 0.5,
        factor: float = 2.0,
        jitter: float = 0.2,
        rng: random.Random | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if not 0 < initial <= cap:
            raise ValueError(f"backoff needs 0 < initial <= cap, got initial={initial} cap={cap}")
        if factor < 1 or not 0 <= jitter < 1:
            raise ValueError(f"backoff needs factor >= 1 and 0 <= jitter < 1, got {factor}, {jitter}")
        self.initial, self.cap, self.factor, self.jitter = initial, cap, factor, jitter
        self._rng = rng or random.Random()
        self._sleep = sleep
        self._next = initial

    def reset(self) -> None:
        self._next = self.initial

    def next_delay(self) -> float:
        """The next wait (jittered), advancing the schedule."""
        delay = self._next * self._rng.uniform(1 - self.jitter, 1 + self.jitter)
        self._next = min(self.cap, self._next * self.factor)
        return delay

    async def sleep(self) -> None:
        await self._sleep(self.next_delay())


class Dialer:
    """Opens the channels of one service's peers: plaintext, or TLS (mTLS with a CA) per `tls`,
    always with CHANNEL_OPTIONS, and with `token` as the bearer token of every call when given.
    resolve() remembers which DNS name each endpoint came from, so channel() checks the peer's
    certificate against that name."""

    def __init__(self, tls: TlsConfig | None = None, resolver: Resolver = resolve, token: str | None = None) -> None:
        self.tls = tls or PLAINTEXT
        self.token = token
        self._interceptors = bearer_interceptors(token)
        self._resolver = resolver
        self._names: dict[str, str] = {}

    async def resolve(self, addresses: Sequence[str]) -> list[str]:
        """resolve_all of an address list, remembering each endpoint's DNS name."""
        return await resolve_all(addresses, self._names, self._resolver)

    def server_name(self, endpoint: str) -> str | None:
        """The DNS name endpoint was resolved from (None: an IP literal or never resolved)."""
        return self._names.get(endpoint)

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        return aio_channel(endpoint, self.tls, CHANNEL_OPTIONS, self._names.get(endpoint), self._interceptors)
