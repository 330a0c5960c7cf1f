"""DecodeHandoffClient: a prefill scheduler's Connect streams to its decode schedulers.

A prefill scheduler is a tokenizer to its decode schedulers: one Connect stream per decode
endpoint (headless-service names re-resolved), hello peer_id "prefill/<scheduler id>". Each
prefilled request goes, as KV chunks + PrefilledReq, to the up link with the fewest requests
handed over and not finished yet (then the lowest token usage). The link remembers those rids
until the decode scheduler reports them done (HandoverDone) or rejects one (RequestError).

Failure rules (nothing is lost): a request with no link up fails at once (caller gets None);
when a link breaks, every request it carried is reported through `on_lost` (the decode
scheduler aborts them itself when the stream ends), and the link reconnects with backoff.
Owned by the service's asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from meshlm.common import addresses
from meshlm.common.addresses import Resolver
from meshlm.common.channels import Dialer
from meshlm.common.peer_stream import PeerSet, PeerStream
from meshlm.common.tls import TlsConfig
from meshlm.scheduler.managers.io_struct import PrefilledReq
from meshlm.scheduler.service.handoff_wire import prefilled_to_proto
from meshlm.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

RESOLVE_INTERVAL_S = 5.0
ErrorCallback = Callable[[str, common_pb2.FinishReason], None]
LostCallback = Callable[[list[str], str], None]
DoneCallback = Callable[[list[str]], None]


class DecodeLink(PeerStream):
    """One Connect stream to one decode endpoint. `rids`: handed over, not done yet; when the
    stream goes down they are reported lost (on_lost) and forgotten."""

    def __init__(
        self,
        endpoint: str,
        scheduler_id: str,
        dialer: Dialer,
        connect_timeout_s: float,
        on_output: Callable[[DecodeLink, scheduler_pb2.SchedulerOutput], None],
        on_lost: LostCallback,
    ) -> None:
        super().__init__(
            f"prefill/{scheduler_id}",
            "decode scheduler",
            dialer,
            endpoint=endpoint,
            connect_timeout_s=connect_timeout_s,
        )
        self.queue: asyncio.Queue[scheduler_pb2.SchedulerInput] = asyncio.Queue()
        self.rids: set[str] = set()
        self.load: common_pb2.SchedulerLoad | None = None
        self._on_output = on_output
        self._on_lost = on_lost

    @property
    def up(self) -> bool:
        return self.connected

    def score(self) -> tuple[int, float]:
        return len(self.rids), (self.load.token_usage if self.load is not None else 0.0)

    async def serve(self, channel: grpc.aio.Channel, endpoint: str) -> None:
        hello = scheduler_pb2.SchedulerInput(hello=self.hello())

        async def requests() -> AsyncIterator[scheduler_pb2.SchedulerInput]:
            yield hello
            while True:
                yield await self.queue.get()

        call = scheduler_pb2_grpc.SchedulerServiceStub(channel).Connect(requests())
        try:
            self.mark_up()
            logger.info("decode scheduler %s connected", endpoint)
            async for out in call:
                self._on_output(self, out)
            raise ConnectionError("closed by the decode scheduler")
        finally:
            call.cancel()

    def on_down(self, reason: str, was_up: bool) -> None:
        while not self.queue.empty():
            self.queue.get_nowait()
        lost, self.rids = sorted(self.rids), set()
        if lost:
            why = (
                f"the link to decode scheduler {self.endpoint} was closed (it left the address "
                "list, or this scheduler stops)"
                if self.closed
                else f"decode scheduler {self.endpoint} went away before the request finished"
            )
            self._on_lost(lost, why)


class DecodeHandoffClient:
    def __init__(
        self,
        scheduler_id: str,
        addrs: Sequence[str],
        *,
        on_error: ErrorCallback,
        on_lost: LostCallback,
        on_done: DoneCallback,
        tls: TlsConfig | None = None,
        resolver: Resolver = addresses.resolve,
        connect_timeout_s: float = 2.0,
        token: str | None = None,
    ) -> None:
        self.scheduler_id = scheduler_id
        self.on_error, self.on_lost, self.on_done = on_error, on_lost, on_done
        self.connect_timeout_s = connect_timeout_s
        self.dialer = Dialer(tls, resolver, token=token)
        self._peers: PeerSet[DecodeLink] = PeerSet(
            addrs, self.dialer, self._link, "decode scheduler", RESOLVE_INTERVAL_S
        )

    def _link(self, endpoint: str) -> DecodeLink:
        return DecodeLink(
            endpoint,
            self.scheduler_id,
            self.dialer,
            self.connect_timeout_s,
            self._on_output,
            self.on_lost,
        )

    @property
    def links(self) -> dict[str, DecodeLink]:
        return {link.endpoint or "": link for link in self._peers.peers}

    # ---- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._peers.start()

    async def wait_up(self, timeout: float) -> bool:
        return await self._peers.wait_any_up(timeout)

    def any_up(self) -> bool:
        return bool(self._peers.up())

    async def close(self) -> None:
        await self._peers.close()
        self._peers.peers = []

    # ---- requests -----------------------------------------------------------------------
    def hand_over(self, msg: PrefilledReq, origin: str, trace: common_pb2.TraceContext | None) -> str | None:
        """Queue msg on the least busy up link; its endpoint, or None when no link is up."""
        up = self._peers.up()
        if not up:
            return None
        link = min(up, key=DecodeLink.score)
        for pb in prefilled_to_proto(msg, origin, trace):
            link.queue.put_nowait(pb)
        link.rids.add(msg.req.rid)
        return link.endpoint

    def abort(self, rid: str, abort_all: bool, message: str) -> None:
        """Forward an abort to every link carrying a matching request (rid, or "<rid>_<i>")."""
        for link in self._peers.peers:
            hits = [r for r in link.rids if abort_all or r == rid or r.startswith(rid + "_")]
            for r in hits:
                abort = scheduler_pb2.AbortReq(rid=r, message=message)
                link.queue.put_nowait(scheduler_pb2.SchedulerInput(abort=abort))

    def _on_output(self, link: DecodeLink, out: scheduler_pb2.SchedulerOutput) -> None:
        kind = out.WhichOneof("msg")
        if kind == "load":
            link.load = out.load
        elif kind == "handover_done":
            done = [r for r in out.handover_done.rids if r in link.rids]
            link.rids.difference_update(done)
            if done:
                self.on_done(done)
        elif kind == "error":  # noqa: SIM102 - an error for a rid not ours is dropped, not read as another kind
            if out.error.rid in link.rids:
                link.rids.discard(out.error.rid)
                self.on_error(out.error.rid, out.error.reason)
