"""The tokenizer's side of DetokenizerService.Subscribe: one server stream per detokenizer.

A tokenizer subscribes to every detokenizer endpoint with a Hello naming its origin id and
protocol version (docs/ring.md "Detokenizer -> tokenizer"), because any scheduler may push to
any detokenizer; a detokenizer of another version refuses it (FAILED_PRECONDITION). Each received
BatchStrOut / BatchEmbeddingOut goes to the handler (the manager, which de-duplicates resends).
A stream that ends or fails is re-opened with backoff; the address list is re-resolved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc

from meshlm.common.channels import Dialer
from meshlm.common.peer_stream import RESOLVE_INTERVAL_S, PeerSet, PeerStream
from meshlm.v1 import detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2

logger = logging.getLogger(__name__)

StrHandler = Callable[[detokenizer_pb2.BatchStrOut], None]
EmbeddingHandler = Callable[[scheduler_pb2.BatchEmbeddingOut], None]
CONNECT_TIMEOUT_S = 5.0


class Subscription(PeerStream):
    """One detokenizer endpoint's Subscribe stream, kept open. Up: the channel is READY and the
    call is open (the detokenizer sends nothing until it has output for us, so there is no
    first message to wait for)."""

    def __init__(
        self,
        address: str,
        origin: str,
        on_strs: StrHandler,
        on_embeddings: EmbeddingHandler,
        dialer: Dialer | None = None,
    ) -> None:
        super().__init__(origin, "detokenizer", dialer, endpoint=address, connect_timeout_s=CONNECT_TIMEOUT_S)
        self.origin = origin
        self.on_strs = on_strs
        self.on_embeddings = on_embeddings

    async def serve(self, channel: grpc.aio.Channel, endpoint: str) -> None:
        call = detokenizer_pb2_grpc.DetokenizerServiceStub(channel).Subscribe(
            detokenizer_pb2.SubscribeRequest(hello=self.hello())
        )
        try:
            self.mark_up()
            logger.info("subscribed to detokenizer %s as %s", endpoint, self.origin)
            async for out in call:
                kind = out.WhichOneof("msg")
                if kind == "strs":
                    self.on_strs(out.strs)
                elif kind == "embeddings":
                    self.on_embeddings(out.embeddings)
        finally:
            call.cancel()

    def on_down(self, reason: str, was_up: bool) -> None:
        if was_up:
            logger.warning("lost detokenizer %s: %s", self.endpoint, reason)


class DetokenizerPool:
    """Subscriptions to every endpoint of the detokenizer address list (a PeerSet, re-resolved),
    each dialed through `dialer` (plaintext by default)."""

    def __init__(
        self,
        addresses: Sequence[str],
        origin: str,
        on_strs: StrHandler,
        on_embeddings: EmbeddingHandler,
        resolve_interval_s: float = RESOLVE_INTERVAL_S,
        dialer: Dialer | None = None,
    ) -> None:
        self.dialer = dialer or Dialer()
        self.origin = origin
        self.on_strs = on_strs
        self.on_embeddings = on_embeddings
        self._peers: PeerSet[Subscription] = PeerSet(
            addresses, self.dialer, self._subscription, "detokenizer", resolve_interval_s
        )

    def _subscription(self, endpoint: str) -> Subscription:
        return Subscription(endpoint, self.origin, self.on_strs, self.on_embeddings, self.dialer)

    @property
    def subscriptions(self) -> dict[str, Subscription]:
        return {s.endpoint or "": s for s in self._peers.peers}

    async def start(self) -> None:
        await self._peers.refresh()
        self._peers.start()

    async def close(self) -> None:
        await self._peers.close()

    def connected(self) -> list[str]:
        return [a for a, s in self.subscriptions.items() if s.connected]

    async def wait_any_connected(self, timeout: float) -> bool:
        return await self._peers.wait_any_up(timeout)
