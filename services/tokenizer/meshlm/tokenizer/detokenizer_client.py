"""The tokenizer's side of DetokenizerService.Subscribe: one server stream per detokenizer.

A tokenizer subscribes to every detokenizer endpoint with a Hello naming its origin id and
protocol version (docs/ring.md "Detokenizer -> tokenizer"), because any scheduler may push to
any detokenizer; a detokenizer of another version refuses it (FAILED_PRECONDITION). Each received
BatchStrOut / BatchEmbeddingOut goes to the handler (the manager, which de-duplicates resends).
A stream that ends or fails is re-opened with backoff; the address list is re-resolved.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional, Sequence

import grpc
from meshlm.common import protocol
from meshlm.tokenizer.discovery import (
    RESOLVE_INTERVAL_S,
    Backoff,
    Dialer,
    refresh_forever,
)
from meshlm.v1 import detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2

logger = logging.getLogger(__name__)

StrHandler = Callable[[detokenizer_pb2.BatchStrOut], None]
EmbeddingHandler = Callable[[scheduler_pb2.BatchEmbeddingOut], None]


class Subscription:
    """One detokenizer endpoint's Subscribe stream, kept open."""

    def __init__(
        self,
        address: str,
        origin: str,
        on_strs: StrHandler,
        on_embeddings: EmbeddingHandler,
        dialer: Optional[Dialer] = None,
    ) -> None:
        self.address = address
        self.dialer = dialer or Dialer()
        self.origin = origin
        self.on_strs = on_strs
        self.on_embeddings = on_embeddings
        # Up: the channel is READY and the call is open (the detokenizer sends nothing until
        # it has output for us, so there is no first message to wait for).
        self.connected = False
        self.up = asyncio.Event()
        self._task: Optional[asyncio.Task] = None
        self._closed = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"detokenizer-subscribe-{self.address}")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._set_down()

    async def _run(self) -> None:
        backoff = Backoff()
        while not self._closed:
            try:
                await self._run_once(backoff)
                reason = "stream ended"
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                reason = f"{e.code().name}: {e.details()}"
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
                logger.exception("detokenizer %s subscription failed", self.address)
            if self.connected:
                logger.warning("lost detokenizer %s: %s", self.address, reason)
            self._set_down()
            if not self._closed:
                await backoff.sleep()

    async def _run_once(self, backoff: Backoff) -> None:
        channel = self.dialer.channel(self.address)
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout=5.0)
            call = detokenizer_pb2_grpc.DetokenizerServiceStub(channel).Subscribe(
                detokenizer_pb2.SubscribeRequest(hello=protocol.hello(self.origin))
            )
            try:
                self.connected = True
                self.up.set()
                backoff.reset()
                logger.info("subscribed to detokenizer %s as %s", self.address, self.origin)
                async for out in call:
                    kind = out.WhichOneof("msg")
                    if kind == "strs":
                        self.on_strs(out.strs)
                    elif kind == "embeddings":
                        self.on_embeddings(out.embeddings)
            finally:
                call.cancel()
        except asyncio.TimeoutError:
            pass
        finally:
            await channel.close()

    def _set_down(self) -> None:
        self.connected = False
        self.up.clear()


class DetokenizerPool:
    """Subscriptions to every endpoint of the detokenizer address list (re-resolved), each
    dialed through `dialer` (plaintext by default)."""

    def __init__(
        self,
        addresses: Sequence[str],
        origin: str,
        on_strs: StrHandler,
        on_embeddings: EmbeddingHandler,
        resolve_interval_s: float = RESOLVE_INTERVAL_S,
        dialer: Optional[Dialer] = None,
    ) -> None:
        self.addresses = list(addresses)
        self.dialer = dialer or Dialer()
        self.origin = origin
        self.on_strs = on_strs
        self.on_embeddings = on_embeddings
        self.resolve_interval_s = resolve_interval_s
        self.subscriptions: dict[str, Subscription] = {}
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> None:
        await self._refresh()
        self._task = asyncio.create_task(
            refresh_forever(self.resolve_interval_s, self._refresh, "detokenizer"), name="detokenizer-resolve"
        )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(
            *(s.close() for s in self.subscriptions.values()), return_exceptions=True
        )

    def connected(self) -> list[str]:
        return [a for a, s in self.subscriptions.items() if s.connected]

    async def wait_any_connected(self, timeout: float) -> bool:
        if self.connected():
            return True
        waits = [asyncio.create_task(s.up.wait()) for s in self.subscriptions.values()]
        if not waits:
            return False
        try:
            await asyncio.wait(
                waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waits:
                w.cancel()
        return bool(self.connected())

    async def _refresh(self) -> None:
        endpoints = await self.dialer.resolve(self.addresses)
        for addr in endpoints:
            if addr not in self.subscriptions:
                sub = Subscription(addr, self.origin, self.on_strs, self.on_embeddings, self.dialer)
                self.subscriptions[addr] = sub
                sub.start()
        for addr in [a for a in self.subscriptions if a not in endpoints]:
            logger.info("detokenizer %s left the address list", addr)
            await self.subscriptions.pop(addr).close()
