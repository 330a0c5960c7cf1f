"""The reconnect lifecycle every long-lived ring stream shares (docs/ring.md), and the set of
per-endpoint streams an address list resolves to.

    start -> pick an endpoint -> dial (Dialer: options, TLS name) -> [wait until READY] ->
    serve: hello, then the stream's messages -> it ends or fails -> on_down(reason, was_up) ->
    back off (Backoff; reset after a stream that came up) -> pick an endpoint again (re-resolved
    where the subclass re-resolves) -> ...          close(): [serve ends its stream within
    grace_s] cancel, channel closed, on_down("closed").

A PeerStream subclass knows only its messages: `serve` sends its hello (protocol.hello; the
server refuses another protocol version with FAILED_PRECONDITION, logged here as an error),
calls `mark_up()` once the stream counts as up, and returns or raises when the stream is over;
one that can end its stream cleanly (half-close, the peer's reply) does so once `wait_closing()`
returns, and close(grace_s) gives it that long before cancelling it.
Invariants: `connected` is True exactly between mark_up() and the following on_down; on_down
runs once per dial, after every outcome (end, failure, timeout, close); the channel of a dial is
closed before the next one opens.

PeerSet keeps one PeerStream per endpoint of an address list, re-resolved every
`resolve_interval_s` (a headless Kubernetes service name resolves to one address per pod):
new endpoints get a started stream, endpoints that left are closed, `peers` follows the
resolved order. A failed re-resolution is logged and retried next period, never fatal.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import grpc

from meshlm.common import protocol
from meshlm.common.channels import Backoff, Dialer
from meshlm.common.deadline import within
from meshlm.v1 import common_pb2

logger = logging.getLogger(__name__)

RESOLVE_INTERVAL_S = 10.0


class PeerStream(abc.ABC):
    """One stream to one peer at a time, kept open (see the module docstring).

    peer_id: what this process's hello names. what: the peer's kind, for logs ("scheduler").
    endpoint: the one endpoint this stream dials (None: the subclass picks each time, e.g. a
    fail-over over a re-resolved list, by overriding next_endpoint).
    connect_timeout_s: wait that long for the channel to be READY before serving (None: serve
    at once, the stream's first reply tells whether the peer is there)."""

    def __init__(
        self,
        peer_id: str,
        what: str,
        dialer: Dialer | None = None,
        *,
        endpoint: str | None = None,
        backoff: Backoff | None = None,
        connect_timeout_s: float | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.what = what
        self.dialer = dialer or Dialer()
        self.backoff = backoff or Backoff()
        self.connect_timeout_s = connect_timeout_s
        self.connected = False
        self.endpoint = endpoint
        self.address = endpoint or ""  # the endpoint of the current (or last) dial; "" before
        self._up = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()  # set by close(): stop for good

    # ---- what a subclass defines --------------------------------------------------------
    async def next_endpoint(self) -> str | None:
        """The endpoint to dial next (None: none known now, back off and ask again)."""
        return self.endpoint

    @abc.abstractmethod
    async def serve(self, channel: grpc.aio.Channel, endpoint: str) -> None:
        """Run one stream on channel: hello, mark_up(), messages; return or raise when over."""

    def on_down(self, reason: str, was_up: bool) -> None:  # noqa: B027 - an optional hook
        """After every dial: fail what waited on the stream, tell the owner (was_up: it had
        come up)."""

    # ---- life cycle ---------------------------------------------------------------------
    def hello(self) -> common_pb2.Hello:
        return protocol.hello(self.peer_id)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"{self.what}-stream-{self.peer_id}")

    async def close(self, grace_s: float = 0.0) -> None:
        """Stop for good, on_down("closed"): a stream that is up gets grace_s to end by itself
        (serve sees wait_closing() return), then it is cancelled (serve's cleanup runs)."""
        self._closing.set()
        if self._task is not None:
            if grace_s > 0 and self.connected:
                await asyncio.wait({self._task}, timeout=grace_s)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    async def wait_closing(self) -> None:
        """Returns once close() has been called."""
        await self._closing.wait()

    async def wait_up(self, timeout: float) -> bool:
        try:
            await within(self._up.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def mark_up(self) -> None:
        self.connected = True
        self._up.set()

    async def _run(self) -> None:
        while not self.closed:
            try:
                endpoint = await self.next_endpoint()
            except Exception:
                logger.exception("cannot resolve %s addresses", self.what)
                endpoint = None
            if endpoint is not None and await self._dial(endpoint):
                self.backoff.reset()
            if not self.closed:
                await self.backoff.sleep()

    async def _dial(self, endpoint: str) -> bool:
        """One dial of endpoint, served until it is over; True if the stream came up."""
        self.address = endpoint
        channel = self.dialer.channel(endpoint)
        reason = "stream ended"
        try:
            if self.connect_timeout_s is not None:
                await within(channel.channel_ready(), self.connect_timeout_s)
            await self.serve(channel, endpoint)
            if self.closed:
                reason = "closed"
        except asyncio.CancelledError:
            reason = "closed"
            raise
        except asyncio.TimeoutError:
            reason = f"not reachable within {self.connect_timeout_s}s"
        except grpc.aio.AioRpcError as e:
            reason = f"{e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # e.g. another protocol version
                logger.error("%s %s refused the stream: %s", self.what, endpoint, e.details())
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
            if self.connected:
                logger.warning("%s %s stream failed: %s", self.what, endpoint, reason)
        finally:
            was_up = self.connected
            self.connected = False
            self._up.clear()
            self.on_down(reason, was_up)
            await channel.close(grace=None)
        return was_up


P = TypeVar("P", bound=PeerStream)


class PeerSet(Generic[P]):
    """One started PeerStream per endpoint of `addresses`, made by `make(endpoint)` (a stream
    whose `endpoint` is that one); `peers` is in resolved order (resolve_all's: list order, each
    name's addresses sorted). `on_change(peers)` runs after each change, before the streams of
    endpoints that left are closed."""

    def __init__(
        self,
        addresses: Sequence[str],
        dialer: Dialer,
        make: Callable[[str], P],
        what: str,
        resolve_interval_s: float = RESOLVE_INTERVAL_S,
        on_change: Callable[[list[P]], None] | None = None,
    ) -> None:
        self.addresses = list(addresses)
        self.on_change = on_change
        self.dialer = dialer
        self.make = make
        self.what = what
        self.resolve_interval_s = resolve_interval_s
        self.peers: list[P] = []
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    def start(self) -> None:
        """Resolve now and every resolve_interval_s, in the background."""
        self._task = asyncio.create_task(self._refresh_forever(), name=f"{self.what}-resolve")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await asyncio.gather(*(p.close() for p in self.peers), return_exceptions=True)

    def by_address(self, endpoint: str) -> P | None:
        return next((p for p in self.peers if p.endpoint == endpoint), None)

    def up(self) -> list[P]:
        return [p for p in self.peers if p.connected]

    async def wait_any_up(self, timeout: float) -> bool:
        """True as soon as one peer is up (or one joins the set and comes up) within timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.up():
            left = deadline - loop.time()
            if left <= 0:
                return False
            waits = [asyncio.ensure_future(p._up.wait()) for p in self.peers]
            waits.append(asyncio.ensure_future(self._changed.wait()))
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        return True

    async def refresh(self) -> None:
        """Re-resolve: start a stream for each new endpoint, close those that left."""
        endpoints = await self.dialer.resolve(self.addresses)
        current = {p.endpoint: p for p in self.peers}
        if list(current) == endpoints:
            return
        kept: list[P] = []
        for endpoint in endpoints:
            peer = current.pop(endpoint, None)
            if peer is None:
                peer = self.make(endpoint)
                peer.start()
            kept.append(peer)
        self.peers = kept
        if self.on_change is not None:
            self.on_change(kept)
        for gone in current.values():
            logger.info("%s %s left the address list", self.what, gone.endpoint)
            await gone.close()
        self._changed.set()
        self._changed = asyncio.Event()

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                logger.exception("re-resolving %s addresses failed", self.what)
            await asyncio.sleep(self.resolve_interval_s)
